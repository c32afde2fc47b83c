"""benchmarks/stack_sampler.py: the start-up profile's sampler and its per-function seconds."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.stack_sampler import StackSampler, children, summarize


def test_summarize_counts_inclusive_once_a_sample_and_exclusive_at_the_leaf() -> None:
    prof = {"interval_s": 0.5, "stacks": [["a:main", "b:f", "b:f"], ["a:main", "<frozen x>:load", "c:g"]],
            "samples": [[0.0, "T", 0, 0.5], [0.5, "T", 0, 0.5], [1.0, "T", 1, 0.75], [1.5, "U", 1, 0.5],
                        [9.0, "T", 1, 0.5]]}  # fmt: skip
    out = summarize(prof, 0.0, 2.0)
    t = out["threads"]["T"]
    assert t["sampled_s"] == 1.75  # three samples in the window, by their weights; the one at 9.0 is outside it
    # recursion counts once a sample; the import machinery's frames are left out of inclusive
    assert dict(t["inclusive_s"]) == {"a:main": 1.75, "b:f": 1.0, "c:g": 0.75}
    assert dict(t["exclusive_s"]) == {"b:f": 1.0, "c:g": 0.75}
    assert t["inclusive_s"][0] == ["a:main", 1.75]  # largest first
    assert out["threads"]["U"]["sampled_s"] == 0.5


def sleepy(seconds: float) -> None:
    time.sleep(seconds)


def test_sampler_finds_the_function_a_thread_waits_in(tmp_path) -> None:
    t0 = time.time()
    sampler = StackSampler(t0, duration_s=30.0, interval_s=0.005).start()
    sleepy(0.4)
    time.sleep(0.1)
    sampler.dump(tmp_path / "s.json")
    prof = json.loads((tmp_path / "s.json").read_text())
    assert [list(x) for x in sampler.stop()["samples"][: len(prof["samples"])]] == prof["samples"]  # stop(): the same
    assert not sampler._thread.is_alive()
    main = summarize(prof, 0.0, time.time() - t0)["threads"]["MainThread"]
    inclusive = dict(main["inclusive_s"])
    # sleeping 0.4 s in sleepy: about 0.4 s of samples there (loose: a loaded 2-core machine delays the sampler)
    assert inclusive["benchmarks/test_stack_sampler.py:sleepy"] == pytest.approx(0.4, abs=0.15)
    assert "stack-sampler" not in summarize(prof, 0.0, 99.0)["threads"]


def test_children_splits_a_functions_time_by_the_frames_it_called() -> None:
    prof = {"interval_s": 1.0, "stacks": [["m:main", "a:f", "<frozen i>:load", "b:g"], ["m:main", "a:f"],
                                         ["m:main", "c:h"], ["m:main", "a:f", "a:f", "d:k"]],
            "samples": [[0.0, "MainThread", 0, 1.0], [1.0, "MainThread", 1, 0.5], [2.0, "MainThread", 2, 1.0],
                        [3.0, "MainThread", 3, 2.0], [4.0, "T", 0, 1.0], [9.0, "MainThread", 0, 1.0]]}  # fmt: skip
    # f's callees: g (the import frame between them skipped), f itself once more (recursion: the outermost f's
    # callee), and its own time; h is not under f; thread T and the sample at 9.0 are outside
    assert children(prof, "a:f", 0.0, 5.0) == [["a:f", 2.0], ["b:g", 1.0], ["<self>", 0.5]]
    assert children(prof, "m:main", 0.0, 5.0) == [["a:f", 3.5], ["c:h", 1.0]]


def test_sampler_writes_its_path_when_its_time_runs_out(tmp_path) -> None:
    path = tmp_path / "s.json"
    sampler = StackSampler(time.time(), duration_s=0.2, interval_s=0.005, path=path).start()
    sleepy(0.1)
    sampler._thread.join(timeout=5)
    prof = json.loads(path.read_text())  # no dump() call: the thread wrote it
    assert prof["samples"] and len(prof["samples"]) == len(sampler.samples)
    # stopped before its time runs out (a run that exits sooner: rl_e2e's atexit), it writes its file too
    early = StackSampler(time.time(), duration_s=60.0, interval_s=0.005, path=tmp_path / "early.json").start()
    sleepy(0.05)
    assert len(early.stop()["samples"]) == len(json.loads((tmp_path / "early.json").read_text())["samples"]) > 0
