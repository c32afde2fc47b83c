"""SFT options that need a real run: activation checkpointing changes nothing numerically, --ckpt.no_save_final
leaves no end-of-run checkpoint, and
local Parquet / JSONL datasets (prompt/completion and chat rows) train through the same path."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from prime_spmd.config.job import SFTJobConfig
from prime_spmd.config.sections import CkptConfig, DataConfig, LogConfig, ModelConfig, OptimConfig, SFTTrainerConfig


def _cfg(tmp: Path, name: str, model: Path, **kw) -> SFTJobConfig:
    return SFTJobConfig(
        output_dir=str(tmp / name),
        model=ModelConfig(path=str(model), impl="hf"),
        trainer=SFTTrainerConfig(
            max_steps=3, batch_size=6, micro_batch_tokens=128, seq_len=64, **kw.pop("trainer", {})
        ),
        optim=OptimConfig(lr=1e-3),
        data=kw.pop("data", DataConfig()),
        ckpt=kw.pop("ckpt", CkptConfig(save_hf=False)),
        log=LogConfig(progress=False, plots=False),
        eval_examples=0,
    )


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_activation_checkpointing_and_file_datasets(tmp_path: Path) -> None:
    from prime_spmd.models.tiny import build_tiny_model
    from prime_spmd.trainer.sft import run_sft

    model = build_tiny_model(tmp_path / "base", "qwen3-nano", initializer_range=0.3)
    run_sft(_cfg(tmp_path, "plain", model))
    no_final = CkptConfig(save_hf=False, save_final=False)
    run_sft(_cfg(tmp_path, "ac", model, trainer={"activation_checkpointing": True}, ckpt=no_final))
    # Recomputation repeats the same fp32 ops in the same order on CPU: equal to the last bit.
    assert _losses(tmp_path / "plain") == _losses(tmp_path / "ac")
    # the end-of-run checkpoint, and none with --ckpt.no_save_final
    assert [p.name for p in (tmp_path / "plain" / "checkpoints").iterdir()] == ["step_000003"]
    assert not any((tmp_path / "ac" / "checkpoints").glob("step_*"))

    rows = [{"prompt": f"say {w}", "completion": w} for w in ("apple", "kiwi", "plum", "fig", "lime", "pear")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    chat = [
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
        for r in rows
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    run_sft(_cfg(tmp_path, "pq", model, data=DataConfig(source="parquet", path=str(tmp_path / "d.parquet"))))
    run_sft(_cfg(tmp_path, "jl", model, data=DataConfig(source="jsonl", path=str(tmp_path / "d.jsonl"))))
    # The same rows as prompt/completion (Parquet) and as chat messages (JSONL) render identically.
    assert _losses(tmp_path / "pq") == _losses(tmp_path / "jl")
    assert _losses(tmp_path / "pq")[-1] < _losses(tmp_path / "pq")[0]
