"""The colocated memory plan (prime_spmd/memory.py): parameter counts from the config, the parts' arithmetic,
a refusal that names the flags, and an out-of-memory error that names its phase."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_spmd import memory
from prime_spmd.models.tiny import build_tiny_model


def test_model_shape_counts_the_real_parameters(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "m", preset="qwen3-nano")
    shape = memory.model_shape(str(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (2, 64, 2)


def test_model_shape_of_a_vision_language_model(tmp_path) -> None:
    """A Qwen3-VL counts its vision tower too; transformers 5.17 has no causal-LM class for it (the H100 run of
    benchmarks/vlm.py --rl-steps failed there), so the count builds it as image-text-to-text."""
    from transformers import AutoModelForImageTextToText

    from prime_spmd.models.vlm import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / "vl")
    shape = memory.model_shape(str(path))
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.num_params > sum(p.numel() for p in model.model.language_model.parameters())
    assert shape.vision and not memory.model_shape(str(build_tiny_model(tmp_path / "m", preset="qwen3-nano"))).vision
    kw = dict(num_trainable=shape.num_params, lora=False, offload="none", share_weights=True, kv_cache_tokens=64,
              micro_batch_tokens=1024, activation_checkpointing=False)  # fmt: skip
    text = memory.estimate(dataclasses.replace(shape, vision=False), **kw).train["activations"]
    assert memory.estimate(shape, **kw).train["activations"] == memory.VISION_ACTIVATION_FACTOR * text


def _shape() -> memory.ModelShape:  # the Qwen3-4B shape's counts
    return memory.ModelShape(
        num_params=4_022_468_096, num_layers=36, hidden_size=2560, intermediate_size=9728,
        num_kv_heads=8, head_dim=128, vocab_size=151_936,
    )  # fmt: skip


def test_plan_parts_and_offload() -> None:
    kw = dict(kv_cache_tokens=65536, micro_batch_tokens=8192, activation_checkpointing=True, release_kv_cache=True)
    full = memory.estimate(_shape(), num_trainable=4_022_468_096, lora=False, offload="none", share_weights=True, **kw)
    n = 4_022_468_096
    assert full.parts["trained weights (fp32)"] == 4 * n and full.parts["AdamW moments"] == 8 * n
    assert full.parts["engine weights"] == 2 * n  # full fine-tuning: fp32 masters, so the engine keeps a bf16 copy
    assert full.generate["KV cache"] == 2 * 36 * 8 * 128 * 65536 * 2  # released while the trainer steps
    assert full.train["gradients (fp32)"] == 4 * n
    resident = sum(full.parts.values())
    assert full.total == resident + max(full.generate["KV cache"], sum(full.train.values()))
    kept = memory.estimate(
        _shape(), num_trainable=n, lora=False, offload="none", share_weights=True, **kw | {"release_kv_cache": False}
    )
    assert kept.total == full.total + full.generate["KV cache"]
    off = memory.estimate(_shape(), num_trainable=n, lora=False, offload="optimizer", share_weights=True, **kw)
    assert "AdamW moments" not in off.parts and off.host["AdamW moments"] == 8 * n
    assert full.total - off.total == 8 * n - memory.OFFLOAD_STAGING_BYTES  # the moments leave; two chunks stage them
    lora = memory.estimate(
        _shape(), num_trainable=33_000_000, num_adapted=10**9, lora=True, offload="none", share_weights=True, **kw
    )
    assert lora.parts["frozen base weights"] == 2 * (n - 33_000_000) and "engine weights" not in lora.parts
    assert lora.parts["engine weights (LoRA-merged)"] == 2 * 10**9
    # 4B full fine-tuning does not fit 80 GB without offload, and does with it
    with pytest.raises(ValueError, match=r"--trainer.offload optimizer") as err:
        memory.check_fits(full, 80 * 10**9)
    assert "AdamW moments" in str(err.value)
    memory.check_fits(off, 80 * 10**9)


def test_phase_names_an_out_of_memory_error() -> None:
    with pytest.raises(RuntimeError, match=r"out of device memory during generate") as err:
        with memory.phase("generate"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "--trainer.offload optimizer" in str(err.value)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    with memory.phase("train"):  # anything else passes through untouched
        pass


def test_plan_of_an_rl_job_counts_the_adapted_linears(tmp_path) -> None:
    from prime_spmd.config import RLJobConfig
    from prime_spmd.config.sections import LoraConfig, ModelConfig

    path = build_tiny_model(tmp_path / "m", preset="qwen3-nano")  # hidden 64, 4 heads x 16, 2 kv heads, mlp 128
    lora = LoraConfig(rank=4, target_modules=["q_proj", "down_proj"])
    cfg = RLJobConfig(model=ModelConfig(path=str(path), lora=lora))
    plan = memory.plan_rl_job(cfg, num_trainer_ranks=1)
    adapted = 2 * (64 * 64 + 128 * 64)  # 2 layers x (q_proj + down_proj)
    assert plan.parts["engine weights (LoRA-merged)"] == 2 * adapted
    assert plan.parts["trained weights (fp32)"] == 4 * 4 * 2 * ((64 + 64) + (128 + 64))
    two_ranks = memory.plan_rl_job(cfg, num_trainer_ranks=2)  # no sharing across ranks: the engine keeps its copy
    assert two_ranks.parts["engine weights"] == 2 * memory.model_shape(str(path)).num_params


def test_activation_count_covers_the_measured_h100_runs() -> None:
    """The Qwen3-0.6B shape's colocated RL on the H100 (compiled blocks, no checkpointing): 32,768-token micro-batches
    ran out of memory with ~49.9 GiB of activations allocated (002d098), and the run at 8,192 peaked at 26.3 GiB
    (4e1f824). The activation term must cover the first; the count before (4 x hidden + 3 x MLP width a block) gave
    24.5 GiB and let the run start."""
    shape = memory.ModelShape(
        num_params=596_049_920, num_layers=28, hidden_size=1024, intermediate_size=3072, num_kv_heads=8,
        head_dim=128, vocab_size=151_936, num_heads=16,
    )  # fmt: skip
    kw = dict(num_trainable=shape.num_params, lora=False, offload="none", share_weights=False,
              kv_cache_tokens=0, activation_checkpointing=False)  # fmt: skip
    gib = 2**30
    assert memory.estimate(shape, micro_batch_tokens=32768, **kw).train["activations"] > 49.9 * gib
    small = memory.estimate(shape, micro_batch_tokens=8192, **kw).train["activations"]
    assert 12 * gib < small < 16 * gib  # the 26.3 GiB peak less ~12.6 GiB of weights, moments, gradients, KV cache


def test_masked_attention_terms() -> None:
    """Shared-prompt attention (masked rows): one additive mask of the micro-batch's tokens x the row length (capped
    at the micro-batch), its rows repeated for the query heads of a key/value head (Qwen3-4B: 32 over 8); the
    activations do not change (no k/v expanded to every head)."""
    kw = dict(num_trainable=1, lora=False, offload="none", share_weights=True, kv_cache_tokens=0,
              micro_batch_tokens=4096, activation_checkpointing=False)  # fmt: skip
    shape = dataclasses.replace(_shape(), num_heads=32)
    base = memory.estimate(shape, **kw)
    masked = memory.estimate(shape, masked_row_tokens=2000, **kw)
    assert masked.train["activations"] == base.train["activations"]
    assert masked.train["attention mask"] == 2 * 4 * 4096 * 2000 and "attention mask" not in base.train
    assert memory.estimate(shape, masked_row_tokens=10**6, **kw).train["attention mask"] == 2 * 4 * 4096 * 4096
    mha = dataclasses.replace(shape, num_kv_heads=32)
    assert memory.estimate(mha, masked_row_tokens=2000, **kw).train["attention mask"] == 2 * 4096 * 2000


def test_rl_job_plan_counts_the_masked_rows_with_shared_prompts(tmp_path) -> None:
    """``plan_rl_job``: with --trainer.share_prompts (the default) a group's prompt and samples attend in one masked
    row of up to group size x sequence length tokens; without it documents fill masked rows of up to the sequence
    length; in exact mode no mask (its own kernels)."""
    from prime_spmd.config import RLJobConfig
    from prime_spmd.config.sections import ModelConfig, TrainerConfig

    path = str(build_tiny_model(tmp_path / "m", preset="qwen3-nano"))  # 4 heads x 16, 2 kv heads: grouped

    def mask_bytes(**trainer) -> int | None:
        cfg = RLJobConfig(model=ModelConfig(path=path), trainer=TrainerConfig(micro_batch_tokens=4096, seq_len=64,
                                                                              **trainer))  # fmt: skip
        return memory.plan_rl_job(cfg, num_trainer_ranks=1).train.get("attention mask")

    group = RLJobConfig().rollout.group_size
    assert mask_bytes() == 2 * 2 * 4096 * group * 64  # 2 query heads a kv head
    assert mask_bytes(share_prompts=False) == 2 * 2 * 4096 * 64
    cfg = RLJobConfig(model=ModelConfig(path=path, exact=True), trainer=TrainerConfig(micro_batch_tokens=4096))
    assert "attention mask" not in memory.plan_rl_job(cfg, num_trainer_ranks=1).train


def test_lm_head_loss_and_row_padding_terms() -> None:
    """The fused LM-head loss's chunk (fp32 logits + bf16 d logits of up to 4,096 tokens, C x V <= 2**30) with its
    d weight and d hidden, in every plan; row padding only with masked rows. The learning benchmark's runs (Qwen3-0.6B,
    128 x 1,046-token KV slots, 16,384-token micro-batches, groups of 8, one trainer rank) peaked at 57.1 GiB (H100,
    4b65079: plan 51.1 GiB without these terms) and 62.5 GiB (H200, 090adcf: plan 57.5 with a 10% row allowance):
    the plan must cover both."""
    shape = memory.ModelShape(
        num_params=596_049_920, num_layers=28, hidden_size=1024, intermediate_size=3072, num_kv_heads=8,
        head_dim=128, vocab_size=151_936, num_heads=16,
    )  # fmt: skip
    kw = dict(num_trainable=shape.num_params, lora=False, offload="none", share_weights=False,
              kv_cache_tokens=128 * 1046, micro_batch_tokens=16384, activation_checkpointing=False)  # fmt: skip
    plain = memory.estimate(shape, **kw)
    assert plain.train["LM-head loss"] == 4096 * 151_936 * 6 + (151_936 + 16384) * 1024 * 2
    assert "row padding" not in plain.train
    small = memory.estimate(shape, **kw | {"micro_batch_tokens": 1000})  # at most the micro-batch's tokens a chunk
    assert small.train["LM-head loss"] == 1000 * 151_936 * 6 + (151_936 + 1000) * 1024 * 2
    masked = memory.estimate(shape, masked_row_tokens=8 * 1046, one_rank=True, **kw)
    assert masked.train["row padding"] == int(memory.ROW_PAD_ALLOWANCE * masked.train["activations"])
    # the same settings peaked at 57.1 GiB on the H100 (4b65079) and 62.5 on the H200 (090adcf, shorter completions:
    # rows of 1.24x the model's tokens at the peak step)
    assert 62.5 * 2**30 < masked.total < 64 * 2**30


def test_lm_head_chunk_bounds_are_the_kernels() -> None:
    """memory sits below kernels (no import up): its copies of the fused loss's chunk bounds must match, and its chunk
    is never below the loss's."""
    import inspect

    from prime_spmd.kernels.lm_logprob import fused_loss

    assert memory.LM_HEAD_CHUNK_ELEMENTS == fused_loss.TRITON_LOGITS_BUFFER_ELEMENTS
    default = inspect.signature(fused_loss.fused_lm_head_loss).parameters["chunk_tokens"].default
    assert memory.LM_HEAD_CHUNK_TOKENS == default
    for tokens in (100, 1000, 4096, 16384):
        got = fused_loss.num_chunk_tokens(tokens, 151_936, default, fused_loss.TRITON_LOGITS_BUFFER_ELEMENTS)
        assert got <= min(memory.LM_HEAD_CHUNK_TOKENS, memory.LM_HEAD_CHUNK_ELEMENTS // 151_936, tokens)


def test_one_rank_plan_counts_the_compute_weights_and_the_gradient_reduce(tmp_path) -> None:
    """One trainer rank (FSDP2 root alone): the trained weights' bf16 compute copy lives through the backward, and
    the reduce copies the fp32 gradients into a buffer of their size once the activations are gone. The Qwen3-8B
    full fine-tuning run with offload that ran out of memory on an H200 at 090adcf (plan 112.3 GiB, out of memory
    asking for the second 30.5 GiB gradient buffer) now plans 131.9 GiB and is refused on that card; its reduce
    phase alone is two fp32 gradient copies."""
    n = 8_190_735_360
    shape = memory.ModelShape(num_params=n, num_layers=36, hidden_size=4096, intermediate_size=12288,
                              num_kv_heads=8, head_dim=128, vocab_size=151_936, num_heads=32)  # fmt: skip
    kw = dict(num_trainable=n, lora=False, offload="optimizer", share_weights=False, kv_cache_tokens=64 * 320,
              micro_batch_tokens=4096, activation_checkpointing=False, masked_row_tokens=8 * 320)  # fmt: skip
    many = memory.estimate(shape, **kw)
    one = memory.estimate(shape, one_rank=True, **kw)
    assert not many.reduce and "compute weights" not in many.train
    assert one.train["compute weights"] == 2 * n and one.reduce == {"gradients (fp32)": 4 * n,
                                                                     "gradient reduce buffer": 4 * n}  # fmt: skip
    assert one.total == sum(one.parts.values()) + max(sum(one.train.values()), sum(one.reduce.values()))
    assert abs(one.total / 2**30 - 131.9) < 0.1  # 131.4 + the offload's 0.5 GiB of device staging
    memory.check_fits(many, int(139.8 * 2**30))  # what let the 090adcf run start
    with pytest.raises(ValueError, match=r"gradient reduce buffer"):
        memory.check_fits(one, int(139.8 * 2**30))  # the H200's 139.8 GiB, 92% usable
    assert "gradient reduce buffer (reduce)" in one.describe()
    small = memory.estimate(shape, one_rank=True, **kw | {"micro_batch_tokens": 256})  # the reduce is the peak
    assert small.total == sum(small.parts.values()) + 8 * n
    lora = memory.estimate(shape, one_rank=True, **kw | {"num_trainable": 10**7, "lora": True})
    assert "compute weights" not in lora.train and lora.reduce["gradient reduce buffer"] == 4 * 10**7
    # plan_rl_job: one_rank follows the trainer ranks
    from prime_spmd.config import RLJobConfig
    from prime_spmd.config.sections import ModelConfig

    cfg = RLJobConfig(model=ModelConfig(path=str(build_tiny_model(tmp_path / "m", preset="qwen3-nano"))))
    assert memory.plan_rl_job(cfg, num_trainer_ranks=1).reduce and not memory.plan_rl_job(cfg, 2).reduce


def test_offload_staging_is_the_optimizers_two_chunks() -> None:
    """memory sits below the trainer (no import up): its copy of the offloaded optimizer's device staging must match
    HostOffloadAdamW's two chunks at its default size, and a plan with --trainer.offload optimizer counts it."""
    import inspect

    from prime_spmd.trainer.offload import HostOffloadAdamW

    chunk = inspect.signature(HostOffloadAdamW.__init__).parameters["chunk_bytes"].default
    assert memory.OFFLOAD_STAGING_BYTES == 2 * chunk
    shape = memory.ModelShape(num_params=10**6, num_layers=2, hidden_size=64, intermediate_size=128, num_kv_heads=2,
                              head_dim=16, vocab_size=101, num_heads=4)  # fmt: skip
    kw = dict(num_trainable=10**6, lora=False, share_weights=False, kv_cache_tokens=64, micro_batch_tokens=64,
              activation_checkpointing=False)  # fmt: skip
    off, on_device = memory.estimate(shape, offload="optimizer", **kw), memory.estimate(shape, offload="none", **kw)
    assert off.parts["AdamW moment staging"] == 2 * chunk and "AdamW moment staging" not in on_device.parts


def test_fragmentation_hint_names_expandable_segments_when_cached_memory_is_free() -> None:
    hint = memory.fragmentation_hint(int(21.4 * memory.GIB), "")
    assert "21.4 GiB" in hint and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in hint
    assert memory.fragmentation_hint(int(0.5 * memory.GIB), "") == ""  # too little to matter
    assert memory.fragmentation_hint(4 * memory.GIB, "max_split_size_mb:128, expandable_segments:True") == ""


def test_master_offload_plan_holds_the_weights_once() -> None:
    """--trainer.offload master (one rank): the bf16 parameters are the only device weights (the engine reads them when
    it shares, else it holds its own copy), the fp32 gradients live only while the trainer steps beside the largest
    parameter's bf16 gradient, masters and moments are host bytes, and there is no compute copy and no reduce phase.
    The 8B anchor's settings (32 x 4,064-token KV cache released, 8,192-token micro-batches, checkpointing) plan
    57.2 GiB against 107.3 with --trainer.offload optimizer: it fits an H100 (79.2 GiB)."""
    n = 8_190_735_360
    shape = memory.ModelShape(num_params=n, num_layers=36, hidden_size=4096, intermediate_size=12288,
                              num_kv_heads=8, head_dim=128, vocab_size=151_936, num_heads=32)  # fmt: skip
    kw = dict(num_trainable=n, lora=False, share_weights=True, kv_cache_tokens=32 * 4064, micro_batch_tokens=8192,
              activation_checkpointing=True, release_kv_cache=True, masked_row_tokens=8 * 4064, one_rank=True)  # fmt: skip
    master, opt = memory.estimate(shape, offload="master", **kw), memory.estimate(shape, offload="optimizer", **kw)
    assert master.parts == {"trained weights (compute dtype)": 2 * n,
                            "master + moment staging": memory.OFFLOAD_STAGING_BYTES}  # fmt: skip
    assert master.host == {"master weights (fp32)": 4 * n, "AdamW moments": 8 * n} and not master.reduce
    assert master.train["gradients (fp32)"] == 4 * n and "compute weights" not in master.train
    assert master.train["gradient before its hook"] == 151_936 * 4096 * 2
    assert abs(master.total / 2**30 - 57.2) < 0.05 and abs(opt.total / 2**30 - 107.3) < 0.05
    memory.check_fits(master, int(79.2 * 2**30))
    unshared = memory.estimate(shape, offload="master", **kw | {"share_weights": False})
    assert unshared.parts["engine weights"] == 2 * n and unshared.total == master.total + 2 * n
