"""The TRL side of benchmarks/rl_e2e.py: ``rl_e2e.py --trl-worker SPEC`` runs ``trl_worker`` in the interpreter
that has TRL (``--trl-python``), GRPOTrainer on the spec's model with the prompts ours takes, in the same order,
scored with the env's own generator and scorer (``task_fns``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def task_fns(task: dict):
    """(example(split, index, seed) -> (prompt, answer), reward(answer, text), exact(answer, text)) of ``task``,
    the env's own generator and scorer (the TRL side scores with them too)."""
    if task["name"] == "number_list":
        from prime_spmd.data.number_list import example_rng, item_lcs_ratio, number_list_example, parse_task_args

        nl, _ = parse_task_args({k: str(v) for k, v in task["args"].items()}, "--task-arg")
        return (lambda split, i, seed: number_list_example(example_rng(seed, split, i), nl), item_lcs_ratio,
                lambda a, t: float(t.strip() == a))  # fmt: skip
    from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example

    a = task["args"]
    return (lambda split, i, seed: reverse_text_example(example_rng(seed, split, i), a["min_chars"], a["max_chars"],
                                                        a["alphabet"]), lcs_ratio, lambda x, t: float(t == x))  # fmt: skip


def train_order(seed: int, label: str, n: int, count: int) -> list[int]:
    """The first ``count`` train example ids ours takes (rl/mixture.py's planner: one environment, no difficulty
    filter, a seeded permutation of the split per epoch), for TRL's dataset."""
    import random

    perm = list(range(n))
    random.Random(f"mixture/{seed}/{label}/0").shuffle(perm)
    return [perm[i % n] for i in range(count)]


def grpo_config(s: dict, out: Path, cuda: bool):
    """TRL's GRPOConfig matching ours' run: group size, max new tokens, T=1, constant lr, AdamW betas, grad
    clipping, steps and seed; one batch per step (per_device_train_batch_size = prompts x group size). Generation:
    transformers' ``generate``, or its continuous batching engine with ``continuous_batching`` (--trl-continuous-batching)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=s["prompts"] * s["group_size"],
        num_generations=s["group_size"], max_completion_length=s["max_tokens"], temperature=1.0, top_p=1.0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=s["steps"], beta=0.0, logging_steps=1, save_strategy="no", report_to=[],
        bf16=cuda, use_cpu=not cuda, seed=s["seed"], shuffle_dataset=False, disable_tqdm=True,
        gradient_accumulation_steps=1, dataloader_num_workers=0,
        use_transformers_continuous_batching=bool(s.get("continuous_batching")),
    )  # fmt: skip


def truncated_rewards(
    rewards: list[float], completion_ids, max_tokens: int, ends: set[int], value: float
) -> list[float]:
    """Ours' ``--rollout.truncated_reward`` on TRL's side: ``value`` for a completion of ``max_tokens`` ids that holds
    no end token (cut off, as ours' finish_reason "length"), else its reward."""
    cut = [len(ids) >= max_tokens and not ends.intersection(ids) for ids in completion_ids]
    return [value if c else r for c, r in zip(cut, rewards)]


def eval_copy(model, cache: dict, dtype):
    """``model``'s current weights in a second model of ``dtype`` (built once into ``cache``, refreshed each call):
    a plain forward in that dtype, as ours' engine generates, with none of the trainer's autocast."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    if "model" not in cache:  # built on the device: a CPU build would first run the random init there
        with torch.device(model.device):
            cache["model"] = AutoModelForCausalLM.from_config(model.config, dtype=dtype).eval()
        cache["model"].generation_config = copy.deepcopy(model.generation_config)
    cache["model"].load_state_dict(model.state_dict())
    return cache["model"]


def trl_evaluate(trainer, tok, held_out: list, s: dict, lcs_ratio, sink, step: int, cache: dict) -> None:
    """Held-out reward of the current weights: each eval prompt sampled eval_samples times at T=1 with
    transformers' generate (TRL's own generation path), the same scorer; one row of steps.jsonl. With
    ``s["eval_dtype"]`` bfloat16 (CUDA) a bf16 copy of the weights generates, in the numerics ours' evals sample in
    (``eval_copy``); float32: TRL's fp32 model itself (under its bf16 autocast when it trains in bf16)."""
    import torch

    from prime_spmd.envs.base import completion_text

    cuda = s["device"] == "cuda"
    t = time.perf_counter()
    dtype = getattr(torch, s.get("eval_dtype", "float32"))
    m = trainer.model if dtype == torch.float32 else eval_copy(trainer.model, cache, dtype)
    was_training, side = m.training, tok.padding_side
    m.eval()
    tok.padding_side = "left"
    rewards = []
    with torch.no_grad(), torch.random.fork_rng(devices=[m.device] if cuda else []):
        torch.manual_seed(s["seed"])
        for b in range(0, len(held_out), 64):
            chunk = held_out[b : b + 64]
            texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p, _ in chunk]  # fmt: skip
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(m.device)
            gen = m.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=s["max_tokens"], num_return_sequences=s["eval_samples"],
                             pad_token_id=tok.pad_token_id)  # fmt: skip
            for j, ids in enumerate(gen[:, enc["input_ids"].shape[1] :].tolist()):
                rewards.append(lcs_ratio(chunk[j // s["eval_samples"]][1], completion_text(tok, ids)))
    tok.padding_side = side
    m.train(was_training)
    if cuda:
        torch.cuda.synchronize()
    sink.write(json.dumps(dict(eval_step=step, eval_reward=sum(rewards) / max(len(rewards), 1),
                               eval_time_s=time.perf_counter() - t)) + "\n")  # fmt: skip
    sink.flush()


def time_generation(trainer, timing: dict, cuda: bool) -> None:
    """Wrap ``trainer._generate`` to add its time to ``timing["gen_s"]``: TRL reports no generation time of its
    own, so it is timed from outside."""
    import torch

    generate = trainer._generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        res = generate(*a, **kw)
        if cuda:
            torch.cuda.synchronize()
        timing["gen_s"] += time.perf_counter() - t0
        return res

    trainer._generate = timed_generate


def step_timer(s: dict, timing: dict, scored: dict, sink, evaluate):
    """A TrainerCallback that times each step, stops past ``stop_at_unix``, writes one steps.jsonl row per step
    (reward, time split, generated tokens, peak memory) and runs ``evaluate`` every ``eval_interval`` steps."""
    import torch
    from transformers import TrainerCallback

    cuda = s["device"] == "cuda"

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            timing.update(t0=time.perf_counter(), gen_s=0.0)

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            timing["step_s"] = time.perf_counter() - timing["t0"]
            if time.time() > s["stop_at_unix"]:
                control.should_training_stop = True

        def on_log(self, a, state, control, logs=None, **kw):
            if logs is None or "reward" not in logs:
                return
            step_s, gen_s = timing.get("step_s", float("nan")), timing["gen_s"]
            row = dict(step=state.global_step - 1, step_time_s=step_s, gen_time_s=gen_s, train_time_s=step_s - gen_s,
                       reward_mean=logs["reward"], completion_len_mean=logs.get("completions/mean_length"),
                       peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)  # fmt: skip
            row["generated_tokens"] = (row["completion_len_mean"] or 0.0) * s["prompts"] * s["group_size"]
            # reward_mean: the task's reward, as ours' metrics report it; TRL's logged reward is what it trained on
            # (after --truncated-reward), kept as reward_trained
            row["reward_trained"] = row["reward_mean"]
            if scored["task"]:
                row["reward_mean"] = sum(scored["task"]) / len(scored["task"])
            scored["task"].clear()
            for key, vals in (("reward_parsed", scored["parsed"]), ("env/exact_match", scored["exact"])):
                row[key] = sum(vals) / len(vals) if vals else None
                vals.clear()
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            done = state.global_step
            if s["eval_interval"] and (done % s["eval_interval"] == 0 or done == s["steps"]):
                evaluate(done)  # the weights after `done` steps, as ours' eval_step

    return StepTimer()


def trl_worker(spec_path: str) -> None:
    """Runs in the TRL interpreter: GRPOTrainer on the spec's model and prompts; one JSON line per step (and per
    held-out eval, every ``eval_interval`` steps: generate + the env's scorer, as ours' in-run evals)."""
    import_start = time.time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from prime_spmd.envs.base import completion_text, end_token_ids

    s = json.loads(Path(spec_path).read_text())
    out, task, cuda = Path(s["out"]), s["task"], s["device"] == "cuda"
    t0 = float(os.environ.get("PRIME_BENCH_T0_UNIX", time.time()))
    startup = {"python_started_s": import_start - t0, "spans": [["imports", import_start - t0, time.time() - t0]]}
    example, lcs_ratio, exact = task_fns(task)
    rows = []
    # ours' env dataset seed is 0 (--env.seed); its order follows --trainer.seed (the planner's permutation)
    for i in train_order(s["seed"], task["name"], 100_000, s["steps"] * s["prompts"]):
        text, answer = example("train", i, 0)
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": answer})

    scored = {"parsed": [], "exact": [], "task": []}  # this step's side metrics, read by on_log

    def reward(completions, answer, completion_ids, **_) -> list[float]:
        # The same scorer as ours: completion_text (decoded, cut at the first end token) of the sampled ids.
        # TRL's own `completions` text went through its Qwen3 response parser (which can strip what our
        # scorer counts); its score is logged as reward_parsed, not trained on.
        texts = [completion_text(tok, list(ids)) for ids in completion_ids]
        scored["parsed"] += [lcs_ratio(a, c[0]["content"]) for c, a in zip(completions, answer)]
        scored["exact"] += [exact(a, t) for t, a in zip(texts, answer)]
        rewards = [lcs_ratio(a, t) for t, a in zip(texts, answer)]
        scored["task"] += rewards
        if s.get("truncated_reward") is not None:
            rewards = truncated_rewards(
                rewards, completion_ids, s["max_tokens"], end_token_ids(tok), s["truncated_reward"]
            )
        return rewards

    cfg = grpo_config(s, out, cuda)
    ts = time.time() - t0
    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    startup["spans"].append(["model_load", ts, time.time() - t0])
    ts = time.time() - t0
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)  # fmt: skip
    startup["spans"].append(["trainer_build", ts, time.time() - t0])
    (out / "startup_timing.json").write_text(json.dumps(startup))
    held_out = [example("eval", i, 0) for i in range(s["eval_examples"])]
    timing = {"gen_s": 0.0}
    time_generation(trainer, timing, cuda)
    sink = (out / "steps.jsonl").open("w")

    eval_cache: dict = {}

    def evaluate(step: int) -> None:
        trl_evaluate(trainer, tok, held_out, s, lcs_ratio, sink, step, eval_cache)

    if s["eval_interval"]:
        evaluate(0)  # the SFT weights: the baseline, as ours' eval before its first step
    trainer.add_callback(step_timer(s, timing, scored, sink, evaluate))
    trainer.train()
    sink.close()
    if s["save"]:
        trainer.save_model(str(out / "hf"))
        tok.save_pretrained(str(out / "hf"))
