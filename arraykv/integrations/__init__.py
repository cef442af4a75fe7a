"""Bridges to inference code: a NumPy/CuPy Llama decoder over GGUF weights and an ONNX Runtime hook."""
