"""The deterministic async schedule (max_async = k), as pure functions every rank evaluates.

Weights version w_n = parameters after n optimizer steps. Batch j is generated with
w_max(0, j - k); trainer step j trains on batch j and makes w_(j+1). A run starting at step s
(0, or the step of the checkpoint it resumes from) does:

1. initial sync: trainer sends w_s to the engines;
2. pre-generation: fresh runs generate batches 0..k with w_0; a resumed run restores batches
   s..s+k-1 from the checkpoint and generates batch s+k with w_s;
3. for j = s .. N-1: train step j; then, if j+1+k < N: send w_(j+1), generate batch j+1+k.

So generation of batch j+1+k (inference ranks) overlaps training of step j+1.. in disjoint mode,
and k = 0 is on-policy. Every rank knows the next collective; nothing polls.
"""

from __future__ import annotations


def version_of_batch(j: int, k: int) -> int:
    """Weights version that generates batch j."""
    return max(0, j - k)


def pregenerated_batches(start: int, k: int, num_steps: int) -> list[int]:
    """Batches generated before the first training step of a run starting at ``start``."""
    if start == 0:
        return list(range(min(k + 1, num_steps)))
    return [start + k] if start + k < num_steps else []


def batch_after_step(j: int, k: int, num_steps: int) -> int | None:
    """The batch generated after training step j (with w_(j+1)), or None when no sync/generation follows."""
    b = j + 1 + k
    return b if b < num_steps else None


def restored_batches(start: int, k: int, num_steps: int) -> list[int]:
    """Batches a resumed run takes from its checkpoint (generated before the checkpoint)."""
    if start == 0:
        return []
    return [b for b in range(start, min(start + k, num_steps))]


def unreceived_batches_bound(k: int) -> int:
    """Most batches an engine leader can have sent that the controller has not yet received.

    When batch b = j+1+k is sent, the engine holds w_(j+1), which the controller sends only after
    taking batch j for step j: batches <= j are received, j+1 .. j+1+k (k + 1) may not be. The
    pre-generated batches 0..k are k + 1 as well.
    """
    return k + 1


def eval_after_step(j: int, interval_steps: int, final: bool, num_steps: int) -> bool:
    """Whether w_(j+1) is evaluated after training step j: every ``interval_steps`` steps (--eval.interval_steps),
    and after the last step when ``final``. Disjoint inference ranks evaluate it after generating that step's batch."""
    if interval_steps <= 0:
        return False
    return (j + 1) % interval_steps == 0 or (final and j == num_steps - 1)


def eval_at_start(start: int, interval_steps: int) -> bool:
    """Whether w_0 is evaluated before the first step (a fresh run with --eval.interval_steps > 0): the baseline
    the later evals compare with. Disjoint inference ranks evaluate it after the pre-generated batches."""
    return start == 0 and interval_steps > 0


def weights_after_step(j: int, k: int, num_steps: int, evaluate: bool) -> bool:
    """Whether w_(j+1) goes to the engines after step j: a batch or an evaluation needs it."""
    return batch_after_step(j, k, num_steps) is not None or evaluate
