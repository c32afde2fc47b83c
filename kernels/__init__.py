"""Triton kernels, each beside a PyTorch reference (see README.md in each folder)."""
