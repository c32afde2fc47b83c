"""The data bridge keeps no finished send alive: retained payloads stay bounded over many steps.

Two bridge members run in two threads of this process (gloo over a HashStore), in the lockstep the
disjoint RL loop has: the inference side sends one batch per step, the controller receives it and
answers (standing in for the weight broadcast that precedes the next batch).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from prime_spmd.distributed.groups import SENDS_PER_OBJECT, Bridge
from prime_spmd.rl.schedule import unreceived_batches_bound

STEPS = 60


def _member(store: dist.Store, rank: int, out: dict) -> None:
    bridge = Bridge("data", store, [0, 1], rank, "gloo", timedelta(seconds=60))
    retained = []
    for step in range(STEPS):
        if rank == 1:  # inference rank: send batch `step` (64 KiB), then wait for the controller's go
            bridge.isend_object({"step": step, "tokens": bytes(64 << 10)}, dst=0)
            # what InferenceLoop (rl/inference_loop.py) does after each batch (max_async 0: the previous batch was received)
            bridge.wait_sends(keep_newest=SENDS_PER_OBJECT * unreceived_batches_bound(0))
            assert bridge.recv_object(src=0) == ("go", step)
            retained.append((bridge.num_pending_sends(), bridge.pending_send_bytes()))
        else:  # controller
            assert bridge.recv_object(src=1)["step"] == step
            bridge.isend_object(("go", step), dst=1)
    bridge.close()
    out[rank] = retained


def test_data_bridge_releases_finished_sends() -> None:
    store = dist.HashStore()
    out: dict = {}
    threads = [threading.Thread(target=_member, args=(store, r, out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(out) == {0, 1}, "a bridge member failed (see the thread's exception above)"
    retained = out[1]
    # Each step's batch was received before the "go" came back, so at most the newest send (2 works:
    # length + payload) may still be held. Before the fix every payload was kept: 2 * STEPS works.
    assert max(n for n, _ in retained) <= 2, retained
    assert max(b for _, b in retained) <= 2 * (64 << 10) + 4096, retained
    # flat: the last steps retain no more than the first ones
    assert retained[-1][1] <= max(b for _, b in retained[:5]), retained
