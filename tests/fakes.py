"""Small fakes shared by several test files."""

from __future__ import annotations

import collections

import torch


class QueueBridge:
    """Stands in for the weight bridge in one process: the sender's broadcasts are queued (copied), the
    receiver's broadcasts pop them in order (set ``receiving`` to switch sides)."""

    def __init__(self) -> None:
        self.sent: collections.deque[torch.Tensor] = collections.deque()
        self.receiving = False

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.receiving:
            tensor.copy_(self.sent.popleft())
        else:
            self.sent.append(tensor.detach().clone())
