"""Batch-invariant matmul, RMSNorm, SiLU-gate, causal attention and log-softmax: the kernels of exact mode."""
