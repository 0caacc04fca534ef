"""The uplink a Flower app's train message asks for: written by the coordinator's wrappers
(``fedge.flower``) and read by the device's ``compression_mod``, here once, so the two sides of one
wire convention cannot drift. Fedge's own engine names its codec in the round's config
(:class:`fedge.protocol.round_config.RoundConfig`) instead; both encode through the same device code."""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import ConfigRecord

from fedge.protocol.config_keys import CODEC_KEY, LAYOUT_KEY, ROUND_KEY, SEED_KEY
from fedge.protocol.round_config import typed_value

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
        codec, layout = (typed_value(key, config.get(key), str) for key in (CODEC_KEY, LAYOUT_KEY))
        number, seed = (typed_value(key, config.get(key), int, 0) for key in (ROUND_KEY, SEED_KEY))
        return cls(codec, layout, number, seed)
