"""``--rollout.advantage benchmarks/speed_advantages.py:alternating``: advantages +1, -1, +1, ... in every group.

Speed and memory runs at real shapes start from random weights, whose rewards are all 0: every group's advantages
would be 0, the fused LM-head loss would produce no gradient and the optimizer would do nothing. These advantages
(group mean 0 for even groups) make every step run the full backward and optimizer update. Rewards mean nothing here.
"""

from __future__ import annotations


def alternating(rewards: list[float]) -> list[float]:
    return [1.0 if i % 2 == 0 else -1.0 for i in range(len(rewards))]
