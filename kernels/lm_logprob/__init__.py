"""Fused LM-head log-probability + entropy: per-token log p(target) and entropy without [N, V] logits.

Use it through `prime_spmd.kernels.lm_logprob.op.lm_head_logprobs`; see README.md for shapes, limits and timings.
"""
