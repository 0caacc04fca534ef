"""Fedge server: the coordinator (Flower ServerApp round loops, run directory, CLI)."""
