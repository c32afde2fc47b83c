"""Fused decode linears: RMSNorm prologue, GEMM for few rows, bias / SiLU-gate / residual epilogues."""
