"""The loss interface the trainer computes: a sum over tokens of a per-token function (``TokenLoss``).

The RL losses (``rl/loss.py``) and the SFT loss (``trainer/sft.py``) implement it.
"""

from __future__ import annotations

import torch


class TokenLoss:
    """A loss that is a sum over tokens of ``token_loss(logprob, entropy, fields)``.

    ``fields`` holds per-token float tensors aligned with the targets, including ``loss_mask``
    (1.0 where the target is trained); ``token_loss`` must be elementwise over tokens and return 0
    where the mask is 0. ``stats`` returns summed, detached statistics of a micro-batch.

    ``sequence_level``: ``token_loss`` couples the tokens of a document (e.g. GSPO's per-sample ratio), so it
    must see the whole micro-batch at once; the policy then skips the chunked fused LM-head loss.
    """

    sequence_level: bool = False

    def token_loss(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def stats(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}
