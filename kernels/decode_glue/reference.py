"""The decode step's glue, the spec (PyTorch; the native engine's CPU path runs these):

    step_inputs:  x [B, D] = embed[ids]            (the embedding rows of the step's input tokens)
                  cos [B, Dh], sin [B, Dh] = cos_table[pos], sin_table[pos]   (RoPE rows of each position)
                  lens [B] = min(pos + 1, kv_len)  (positions each row attends: its own and every earlier one)
    advance:      ids = tokens; pos = min(pos + 1, max_pos); steps += 1; out[0] = tokens; out[1] = logprobs
                  (in place; out is float64 [2, B], the row the host copies after the step)

Legend (docs/conventions.md): B rows (slots 0..B-1 of a decode step), D hidden size, Dh head dim.
"""

from __future__ import annotations

import torch


def step_inputs_reference(
    ids_B: torch.Tensor, pos_B: torch.Tensor, embed_VD: torch.Tensor, cos_TDh: torch.Tensor, sin_TDh: torch.Tensor,
    kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x [B, D], cos [B, Dh], sin [B, Dh], lens [B] int64); see the module docstring."""
    return embed_VD[ids_B], cos_TDh[pos_B], sin_TDh[pos_B], (pos_B + 1).clamp(max=kv_len)


def advance_reference(ids_B, pos_B, steps_B, out_2B, tokens_B, logprobs_B, max_pos: int) -> None:
    """After a decode step, in place: next input ids, positions (+1, kept inside the cache: free rows keep decoding),
    step indices (+1), and the step's output (tokens, logprobs as float64) for the host copy."""
    ids_B.copy_(tokens_B)
    pos_B.add_(1).clamp_(max=max_pos)
    steps_B.add_(1)
    out_2B[0].copy_(tokens_B)
    out_2B[1].copy_(logprobs_B)
