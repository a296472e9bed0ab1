"""Inference engines: the reference engine and the ONNX Runtime engine."""
