"""Errors raised by the compression layer."""

from __future__ import annotations

__all__ = ["PayloadError", "SpecError"]


class PayloadError(ValueError):
    """An encoded update failed validation.

    Raised by every decoder before any output is produced, so a caller (the coordinator) can reject
    the update, log the reason and carry on with the round. The message names the field that failed.
    """


class SpecError(ValueError):
    """A codec spec string (e.g. ``qsgd:bits=4,bucket=512``) is malformed or names no codec."""
