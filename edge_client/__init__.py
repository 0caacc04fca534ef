"""Fedge edge client: the device side (Flower ClientApp, local trainer, update encoder)."""
