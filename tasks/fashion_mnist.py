"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (offline; optional).

``apt-get install dataset-fashion-mnist`` puts the four IDX files (gzip) under
``/usr/share/datasets/fashion-mnist``; ``$FEDGE_FASHION_MNIST_DIR`` points elsewhere. Nothing is
downloaded: without the files the task raises :class:`DatasetMissing` naming the package.

60,000 training and 10,000 test images of 28x28, 10 classes (Xiao et al. 2017,
https://arxiv.org/abs/1708.07747). ``train_samples`` / ``test_samples`` take the first N of a
seeded shuffle, so a CPU benchmark can use a stratified-enough subset. The model is a two-block CNN
(conv-relu-pool x2, two linear layers) of 105k parameters. ``model=small`` is the same shape at half
the channels with one linear layer, 9k parameters. ``model=simple-cnn`` is NIID-Bench's ``simple-cnn``
(Li, Diao, Chen, He, ICDE 2022: 5x5 convolutions of 6 and 16 channels, each with ReLU and 2x2 max
pooling, then fully connected layers of 120 and 84), 44,426 parameters, for comparing with its table.

The small one is for differential privacy with few devices per round. The noise on a round's mean
has norm z C sqrt(d) / (q N). At ten devices per round that is 32 z C for the default CNN, against
at most C of signal; the small model cuts it to 9.5 z C.
"""

from __future__ import annotations

import gzip
import os
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedge.tasks.base import Task, TensorData

__all__ = ["DEFAULT_DIR", "MODELS", "DatasetMissing", "FashionCNN", "FashionMNISTTask", "SimpleCNN", "available",
           "read_idx"]

DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


class DatasetMissing(FileNotFoundError):
    """The Fashion-MNIST files are not installed."""


def data_dir() -> Path:
    return Path(os.environ.get("FEDGE_FASHION_MNIST_DIR", DEFAULT_DIR))


def available() -> bool:
    return all((data_dir() / name).is_file() for pair in _FILES.values() for name in pair)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (optionally gzip): magic 0x0000 08 <ndim>, big-endian u32 sizes, then uint8 data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {body.size} values for shape {shape}")
    return body.reshape(shape)


@lru_cache(maxsize=2)
def _load(split: str, samples: int, seed: int) -> TensorData:
    directory = data_dir()
    if not available():
        raise DatasetMissing(f"Fashion-MNIST not found in {directory}: apt-get install dataset-fashion-mnist "
                             "(or set FEDGE_FASHION_MNIST_DIR)")
    images, labels = (read_idx(directory / name) for name in _FILES[split])
    order = np.random.default_rng(seed).permutation(len(labels))[: samples or None]
    x = torch.from_numpy(images[order].astype(np.float32) / 255.0).unsqueeze(1)
    return TensorData(x, torch.from_numpy(labels[order].astype(np.int64)))


#: the models ``model=`` names
MODELS = ("cnn", "small", "simple-cnn")


class SimpleCNN(nn.Module):
    """NIID-Bench's ``simple-cnn`` for 28x28 single-channel images (its ``SimpleCNNMNIST``)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 120), nn.ReLU(), nn.Linear(120, 84),
                                        nn.ReLU(), nn.Linear(84, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class FashionCNN(nn.Module):
    def __init__(self, num_classes: int = 10, small: bool = False) -> None:
        super().__init__()
        first, second = (8, 16) if small else (16, 32)
        self.features = nn.Sequential(
            nn.Conv2d(1, first, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(first, second, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        flat = second * 7 * 7
        self.classifier = (nn.Sequential(nn.Flatten(), nn.Linear(flat, num_classes)) if small else
                           nn.Sequential(nn.Flatten(), nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, num_classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class FashionMNISTTask(Task):
    num_classes = 10
    input_shape = (1, 28, 28)

    def __init__(self, train_samples: int = 0, test_samples: int = 0, seed: int = 0, model: str = "cnn") -> None:
        if train_samples < 0 or test_samples < 0:
            raise ValueError("sample counts must be >= 0 (0 = all)")
        if model not in MODELS:
            raise ValueError(f"fashion: model={model!r} is not one of {', '.join(MODELS)}")
        self.train_samples, self.test_samples, self.seed, self.model = train_samples, test_samples, seed, model
        extras = [f"{k}={v}" for k, v in (("train_samples", train_samples), ("test_samples", test_samples),
                                          ("seed", seed)) if v]
        extras += [f"model={model}"] if model != "cnn" else []
        self.spec = "fashion" + (":" + ",".join(extras) if extras else "")

    def build_model(self) -> nn.Module:
        if self.model == "simple-cnn":
            return SimpleCNN(self.num_classes)
        return FashionCNN(self.num_classes, small=self.model == "small")

    def train_pool(self) -> TensorData:
        return _load("train", self.train_samples, self.seed)

    def test_data(self) -> TensorData:
        return _load("test", self.test_samples, self.seed)
