"""The uplink a Flower app's train message asks for: written by the coordinator's wrappers
(``fedge.flower``) and read by the device's ``compression_mod``, here once, so the two sides of one
wire convention cannot drift. Fedge's own engine names its codec in the round's config
(:class:`fedge.protocol.round_config.RoundConfig`) instead; both encode through the same device code."""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import ConfigRecord

from fedge.protocol.config_keys import CODEC_KEY, LAYOUT_KEY, ROUND_KEY, SEED_KEY
from fedge.protocol.records import ProtocolError

__all__ = ["UplinkRequest"]


@dataclass(frozen=True)
class UplinkRequest:
    """The codec a node encodes its update with, the digest of the model layout it encodes against,
    and the round (or version) and seed the codec derives its round's randomness from."""

    codec: str
    layout: str
    round: int
    seed: int

    def write(self, config: ConfigRecord) -> None:
        config[CODEC_KEY], config[LAYOUT_KEY] = self.codec, self.layout
        config[ROUND_KEY], config[SEED_KEY] = int(self.round), int(self.seed)

    @classmethod
    def read(cls, config: ConfigRecord | None) -> UplinkRequest | None:
        """The request a train message's config carries (None: none; the server is not wrapped).
        Raises :class:`ProtocolError` for a partial or mistyped one."""
        if config is None or CODEC_KEY not in config:
            return None
        codec, layout, number, seed = (config.get(key) for key in (CODEC_KEY, LAYOUT_KEY, ROUND_KEY, SEED_KEY))
        if not (isinstance(codec, str) and isinstance(layout, str)):
            raise ProtocolError(f"the uplink request needs text {CODEC_KEY!r} and {LAYOUT_KEY!r}")
        for key, value in ((ROUND_KEY, number), (SEED_KEY, seed)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProtocolError(f"the uplink request's {key!r} must be an integer >= 0, got {value!r}")
        return cls(codec, layout, number, seed)  # type: ignore[arg-type]

