"""Minimal Flower ClientApp/ServerApp pair: the baseline of ``bench/deployment_rounds.py``."""
