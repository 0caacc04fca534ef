"""scikit-learn digits with Fedge's held-out split: a stratified 20% (``random_state=42``) for the
server's evaluation; the other 80% is the pool that nodes shard among themselves."""

from __future__ import annotations

import numpy as np
import torch

TEST_FRACTION = 0.2
SPLIT_SEED = 42
SHARD_SEED = 42


def split() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((x_pool, y_pool), (x_test, y_test)); x is (N, 1, 8, 8) in [0, 1]."""
    # imported here: the import is part of what a ClientApp process pays per message, and the
    # client measures it (data-seconds)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        list(range(len(y))), test_size=TEST_FRACTION, stratify=digits.target, random_state=SPLIT_SEED
    )
    return (x[train_idx], y[train_idx]), (x[test_idx], y[test_idx])


def shard(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This node's IID shard of the pool: a slice of one seeded permutation."""
    (x, y), _ = split()
    order = np.random.default_rng(SHARD_SEED).permutation(len(y))
    mine = torch.as_tensor(np.array_split(order, num_partitions)[partition_id])
    return x[mine], y[mine]
