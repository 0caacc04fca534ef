"""Fedge deploy: the cloud tier and model artifacts.

For now: atomic writes and the fp32 model file that hands models between tiers. DDP training,
pruning, quantization, ONNX export and signed bundles build on these.
"""
