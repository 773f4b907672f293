"""onnx-genrt: run ONNX generative models through pluggable execution providers."""

__version__ = "0.1.0"
