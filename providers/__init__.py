"""Built-in execution providers. Each registers through the onnx_genrt.providers entry points."""
