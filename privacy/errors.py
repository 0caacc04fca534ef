"""Errors of the secure-aggregation protocol.

Each names what failed, so the coordinator can log why a device's message was refused and carry on
(or abort the round, when the sum can no longer be unmasked) instead of producing a wrong sum.
"""

from __future__ import annotations

__all__ = [
    "SecAggError",
    "AdvertisementError",
    "ShareError",
    "RingError",
    "MaskedInputError",
    "UnmaskError",
    "ProtocolError",
    "ConsistencyError",
]


class SecAggError(ValueError):
    """Base class: something in a secure-aggregation round was refused."""


class AdvertisementError(SecAggError):
    """A key advertisement is malformed, unsigned, signed by the wrong identity, or for another round."""


class ShareError(SecAggError):
    """An encrypted share failed authentication or decoding, or a reconstructed secret failed its check."""


class RingError(SecAggError):
    """The ring cannot hold the sum (too many summands for its width) or a setting does not fit it."""


class MaskedInputError(SecAggError):
    """A masked upload has the wrong length or header."""


class UnmaskError(SecAggError):
    """The sum cannot be unmasked: too few shares arrived, or a request would reveal too much."""


class ProtocolError(SecAggError):
    """A stage was called out of order, or a message names a device outside the round."""


class ConsistencyError(UnmaskError):
    """The survivor set a device was shown is not the one a quorum of the round signed: it reveals nothing."""
