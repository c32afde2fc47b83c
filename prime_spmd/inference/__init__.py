"""Inference engines: the interface, the native PyTorch engine, the vLLM engine, sampling."""
