"""Bad input gets a clear error naming the thing and the fix (or, for dataset rows, is skipped and
counted with the first few shown): malformed rows, model directories missing files, a tokenizer
without a chat template, config values out of range."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from prime_spmd.config.sections import DataConfig
from prime_spmd.data.sft import SFTDataset
from prime_spmd.log import logger

GOOD = {"prompt": "abc", "completion": "cba"}
BAD_ROWS = {  # row -> the message naming what is wrong
    "missing field": ({"prompt": "abc"}, r"missing field\(s\): need 'prompt' and 'completion' or 'messages'"),
    "wrong type": ({"prompt": "abc", "completion": 7}, r"'completion' must be a string, got int"),
    "prompt type": ({"prompt": 3, "completion": "x"}, r"'prompt' must be a non-empty string or a list of messages"),
    "empty prompt": ({"prompt": "  ", "completion": "x"}, r"empty prompt"),
    "empty chat prompt": ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}, "empty prompt"),
    "message content type": ({"prompt": [{"role": "user", "content": 5}], "completion": "x"}, r"'prompt' message 0 needs a string 'role' and 'content'"),
    "not an object": ([1, 2], r"row is a list, expected an object"),
    "too long": ({"prompt": "a" * 80, "completion": "x"}, r"prompt alone has \d+ tokens .* > --trainer.seq_len=48; raise --trainer.seq_len"),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from prime_spmd.models.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("m") / "base", "qwen3-nano"))


def _jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return path


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_bad_rows_skipped_counted_first_few_shown(tmp_path: Path, tokenizer) -> None:
    rows = [GOOD, *(row for row, _ in BAD_ROWS.values()), GOOD]
    path = _jsonl(tmp_path / "d.jsonl", rows, extra_lines=("{not json",))
    data = SFTDataset(DataConfig(source="jsonl", path=str(path)), tokenizer, seed=0, seq_len=48)
    seen = _Lines()
    logger.addHandler(seen)
    try:
        samples = data.batch(0, len(rows) + 1)  # one epoch: every row once
    finally:
        logger.removeHandler(seen)
    assert len(samples) == 2
    assert data.num_bad_rows == len(BAD_ROWS) + 1 and data.num_too_long == 1
    shown = [line for line in seen.lines if line.startswith("skipping bad row")]
    assert len(shown) == 3, seen.lines  # the first few only
    assert all(str(path) in line for line in shown)
    assert shown[-1].endswith("(further bad rows are only counted: metric bad_rows)")


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_bad_row_error_mode_names_row_index(tmp_path: Path, tokenizer, kind: str) -> None:
    row, message = BAD_ROWS[kind]
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, row])
    data = SFTDataset(DataConfig(source="jsonl", path=str(path), bad_rows="error"), tokenizer, seed=0, seq_len=48)
    with pytest.raises(ValueError, match=rf"d.jsonl: row 1: {message}"):
        data.batch(0, 2)


def test_invalid_json_line_and_empty_or_missing_file(tmp_path: Path, tokenizer) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [GOOD], extra_lines=("{oops",))
    data = SFTDataset(DataConfig(source="jsonl", path=str(path), bad_rows="error"), tokenizer, seed=0, seq_len=48)
    with pytest.raises(ValueError, match=r"row 1: line 2 is not valid JSON"):
        data.batch(0, 2)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"--data.path=.*empty.jsonl' has no rows"):
        SFTDataset(DataConfig(source="jsonl", path=str(tmp_path / "empty.jsonl")), tokenizer, 0, 48)
    with pytest.raises(ValueError, match=r"--data.path=.*nope.jsonl': no such file"):
        SFTDataset(DataConfig(source="jsonl", path=str(tmp_path / "nope.jsonl")), tokenizer, 0, 48)


ALL_BAD_FILES = {  # a file whose one row is bad -> the reason the error gives
    "no assistant turn": ('{"messages": [{"role": "user", "content": "hi"}]}', r"'messages' must be a list of at least 2"),
    "invalid json": ("{oops", r"line 1 is not valid JSON"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(ALL_BAD_FILES))
def test_file_without_a_good_row_stops_before_training(tmp_path: Path, tokenizer, kind: str) -> None:
    line, reason = ALL_BAD_FILES[kind]
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(
        ValueError, match=rf"--data.path='{path}': all 1 rows are bad, nothing to train on \(row 0: {reason}"
    ):
        SFTDataset(DataConfig(source="jsonl", path=str(path)), tokenizer, seed=0, seq_len=48)
    path.write_text(line + "\n" + json.dumps(GOOD) + "\n")  # one good row is enough: the bad one is skipped
    assert len(SFTDataset(DataConfig(source="jsonl", path=str(path)), tokenizer, 0, 48).batch(0, 2)) == 1


def test_sft_run_on_an_all_bad_file_writes_no_checkpoint(tmp_path: Path, tokenizer) -> None:
    import torch.distributed as dist

    from prime_spmd.config.job import SFTJobConfig
    from prime_spmd.config.sections import LogConfig, ModelConfig, SFTTrainerConfig
    from prime_spmd.trainer.sft import run_sft

    path = tmp_path / "bad.jsonl"
    path.write_text(ALL_BAD_FILES["invalid json"][0] + "\n")
    cfg = SFTJobConfig(
        output_dir=str(tmp_path / "run"),
        model=ModelConfig(path=tokenizer.name_or_path, impl="hf"),
        trainer=SFTTrainerConfig(max_steps=2, batch_size=2, micro_batch_tokens=64, seq_len=48),
        data=DataConfig(source="jsonl", path=str(path)),
        log=LogConfig(progress=False, plots=False),
        eval_examples=0,
    )
    try:
        with pytest.raises(ValueError, match=r"bad.jsonl': all 1 rows are bad"):
            run_sft(cfg)
    finally:
        if dist.is_initialized():  # the run raised before closing its world of one
            dist.destroy_process_group()
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tokenizer_without_chat_template(tmp_path: Path, tokenizer) -> None:
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    path = _jsonl(tmp_path / "d.jsonl", [GOOD])
    data = SFTDataset(DataConfig(source="jsonl", path=str(path)), tok, seed=0, seq_len=48)
    with pytest.raises(ValueError, match=r"the tokenizer has no chat_template.*--model.tokenizer_path"):
        data.batch(0, 1)


def test_model_dir_missing_files(tmp_path: Path) -> None:
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import check_model_dir, load_model

    d = tmp_path / "model"
    d.mkdir()
    with pytest.raises(ValueError, match=r"--model.path=.*model' has no config.json; is it a Hugging Face model"):
        check_model_dir(str(d))
    (d / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no weights \(\*.safetensors or \*.bin\).*--model.init_tiny"):
        load_model(ModelConfig(path=str(d)), device=__import__("torch").device("cpu"))
    with pytest.raises(ValueError, match=r"no such directory \(and not a hub id"):
        check_model_dir(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match=r"is a file; expected a model directory"):
        check_model_dir(str(d / "config.json"))


def test_config_values_out_of_range_name_the_flag(capsys) -> None:
    from prime_spmd.__main__ import main
    from prime_spmd.config.rl_sections import LossConfig
    from prime_spmd.config.sections import CkptConfig, LogConfig, NativeEngineConfig, SamplingConfig, TrainerConfig

    cases = [
        (lambda: TrainerConfig(max_skipped_steps=-1), r"--trainer.max_skipped_steps=-1 is invalid: must be >= 0"),
        (lambda: TrainerConfig(max_steps=0), r"--trainer.max_steps=0 is invalid: must be >= 1"),
        (lambda: CkptConfig(keep_last=0), r"--ckpt.keep_last=0 is invalid: must be >= 1"),
        (lambda: LogConfig(interval_steps=0), r"--log.interval_steps=0 is invalid"),
        (lambda: SamplingConfig(top_p=0.0), r"--sampling.top_p=0.0 is invalid: must be in \(0, 1\]"),
        (lambda: DataConfig(min_chars=9, max_chars=3), r"--data.min_chars=9 is invalid"),
        (lambda: DataConfig(source="jsonl"), r"--data.path='' is invalid: --data.source=jsonl needs a file path"),
        (lambda: LossConfig(max_log_ratio=0.0), r"--loss.max_log_ratio=0.0 is invalid: must be > 0"),
        (
            lambda: NativeEngineConfig(decode_steps_per_launch=-1),
            r"--inference.native.decode_steps_per_launch=-1 is invalid: must be >= 0 \(0: auto\)",
        ),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    # from the command line: exit status 2 and the message, no traceback
    with pytest.raises(SystemExit) as e:  # tyro's error box
        main(["sft", "--model.path", "m", "--trainer.max_skipped_steps", "-2"])
    assert e.value.code == 2
    assert "--trainer.max_skipped_steps=-2 is invalid: must be >= 0" in capsys.readouterr().err
