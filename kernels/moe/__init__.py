"""MoE experts: route -> permute by expert -> grouped GEMM gate/up + SwiGLU -> grouped GEMM down -> weighted un-permute."""
