"""The live page of a running federation: what the coordinator's run directory says, served read-only.

``snapshot`` reads the run directory (settings, ``metrics.jsonl``, ``devices.json``, the leaves'
directories) into one JSON object; ``server`` serves it and a self-updating page (``page.html``: no
script or chart library, nothing fetched from elsewhere) on 127.0.0.1, or elsewhere only over TLS
and with a token.
"""
