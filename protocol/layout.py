"""An ``ArrayRecord`` as one flat float32 vector and back: what a codec encodes.

Flower's strategies send the model as an ``ArrayRecord`` of named numpy arrays. The codecs work on
one flat vector, so both sides flatten the floating-point arrays in the record's own key order;
arrays of other dtypes (integer buffers such as BatchNorm's ``num_batches_tracked``) are not
compressed and travel as they are. The layout's digest (names, shapes, dtypes) is sent with the
codec spec, so a reply built for another model is refused instead of mis-decoded.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
from flwr.app import Array, ArrayRecord

from fedge.protocol.records import ProtocolError

__all__ = ["Layout", "LayoutError"]


class LayoutError(ProtocolError):
    """The arrays do not have the layout the other side described."""


class Layout:
    """Which arrays of a record are flattened (floating point), in order, with their shapes."""

    def __init__(self, record: ArrayRecord) -> None:
        self._set([(name, tuple(array.shape), array.dtype) for name, array in record.items()])

    def _set(self, entries: list[tuple[str, tuple[int, ...], np.dtype]]) -> None:
        self.entries = entries
        self.floats = [(name, shape, dtype) for name, shape, dtype in self.entries
                       if np.issubdtype(dtype, np.floating)]
        self.numel = int(sum(int(np.prod(shape)) for _, shape, _ in self.floats))

    @property
    def spec(self) -> str:
        """Names, shapes and dtypes as JSON: what a node needs to build the model's arrays."""
        return json.dumps([[n, list(s), str(d)] for n, s, d in self.entries], separators=(",", ":"))

    @property
    def digest(self) -> str:
        text = json.dumps([[n, list(s), str(d)] for n, s, d in self.entries])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_spec(cls, spec: str) -> Layout:
        """The layout ``spec`` describes, without building its arrays (checked: a malformed spec
        raises :class:`LayoutError`)."""
        try:
            entries = []
            for name, shape, dtype in json.loads(spec):
                if not (isinstance(name, str) and all(isinstance(s, int) and 0 <= s < 2**31 for s in shape)):
                    raise ValueError(f"bad entry {name!r} {shape!r}")
                if int(np.prod(shape)) > 2**31:
                    raise ValueError(f"{name!r} is too large")
                entries.append((name, tuple(shape), np.dtype(dtype)))
        except (ValueError, TypeError) as err:
            raise LayoutError(f"the layout the server sent is malformed: {err}") from None
        layout = cls.__new__(cls)
        layout._set(entries)
        return layout

    @classmethod
    def zeros(cls, spec: str) -> ArrayRecord:
        """An ``ArrayRecord`` of zeros in the layout ``spec`` describes (checked, as :meth:`from_spec`)."""
        entries = cls.from_spec(spec).entries
        return ArrayRecord({name: Array(np.zeros(shape, dtype=dtype)) for name, shape, dtype in entries})

    def sizes(self) -> list[int]:
        return [int(np.prod(shape)) for _, shape, _ in self.floats]

    def flatten(self, record: ArrayRecord) -> np.ndarray:
        if [(n, tuple(a.shape), a.dtype) for n, a in record.items()] != self.entries:
            raise LayoutError("the arrays' names, shapes or dtypes differ from the model's")
        parts = [record[name].numpy().astype(np.float32, copy=False).ravel() for name, _, _ in self.floats]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def rebuild(self, flat: np.ndarray, like: ArrayRecord) -> ArrayRecord:
        """``like`` with its floating-point arrays replaced by ``flat`` (cast back to their dtypes)."""
        if flat.shape != (self.numel,):
            raise LayoutError(f"{flat.shape[0] if flat.ndim == 1 else flat.shape} values for a model of {self.numel}")
        out, offset = ArrayRecord(), 0
        floats = {name for name, _, _ in self.floats}
        for name, shape, dtype in self.entries:
            if name in floats:
                size = int(np.prod(shape))
                out[name] = Array(flat[offset:offset + size].reshape(shape).astype(dtype))
                offset += size
            else:
                out[name] = like[name]
        return out
