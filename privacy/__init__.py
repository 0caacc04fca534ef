"""Privacy: secure aggregation of quantized updates and (later) client-level differential privacy.

Pure protocol code, like ``compression/`` and ``aggregation/``: it never imports Flower. The round
engine carries its messages (``server/``, ``edge_client/``); everything here works on bytes and
numpy arrays, so the protocol can be tested stage by stage without any process.
"""
