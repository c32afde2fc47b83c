"""Config: TOML defaults, CLI overrides, clear errors naming key, file and allowed values."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prime_spmd.__main__ import main
from prime_spmd.config import EvalJobConfig, RLJobConfig, SFTJobConfig, load_toml, parse_cli
from prime_spmd.config.job import RL_DEFAULT_LR, SFT_DEFAULT_LR
from prime_spmd.config.loader import auto_flags
from prime_spmd.config.sections import TopologyConfig
from prime_spmd.distributed.topology import plan_topology

ROOT = Path(__file__).resolve().parents[2]


def _toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_toml_defaults_and_cli_override(tmp_path: Path) -> None:
    p = _toml(tmp_path, '[model]\npath = "m"\n[optim]\nlr = 1e-4\nwarmup_steps = 3\n')
    cfg = parse_cli(SFTJobConfig, ["--config", str(p), "--optim.lr", "3e-4"], "x")
    assert cfg.optim.lr == 3e-4 and cfg.optim.warmup_steps == 3 and cfg.model.path == "m"
    assert cfg.config == str(p)


def test_unknown_key_names_key_file_and_allowed(tmp_path: Path) -> None:
    p = _toml(tmp_path, "[optim]\nlearning_rate = 1e-4\n")
    with pytest.raises(ValueError) as e:
        load_toml(SFTJobConfig, p)
    msg = str(e.value)
    assert "optim.learning_rate" in msg and str(p) in msg and "lr" in msg and "unknown key" in msg


def test_unknown_section(tmp_path: Path) -> None:
    p = _toml(tmp_path, "[optimizer]\nlr = 1\n")
    with pytest.raises(ValueError, match=r"unknown key 'optimizer'.*allowed keys here: .*optim"):
        load_toml(SFTJobConfig, p)


def test_wrong_type_and_bad_choice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'trainer.max_steps' = 'ten' has the wrong type; expected int"):
        load_toml(SFTJobConfig, _toml(tmp_path, '[trainer]\nmax_steps = "ten"\n'))
    with pytest.raises(
        ValueError, match=r"'optim.schedule' = 'linear' is not allowed; allowed values: \('constant', 'cosine'\)"
    ):
        load_toml(SFTJobConfig, _toml(tmp_path, '[optim]\nschedule = "linear"\n'))


def test_out_of_range_value_names_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--optim.lr=-1.0 is invalid: must be > 0") as e:
        load_toml(SFTJobConfig, _toml(tmp_path, "[optim]\nlr = -1.0\n"))
    assert "c.toml" in str(e.value)
    with pytest.raises(ValueError, match=r"micro_batch_tokens=16 is invalid: must be >= --trainer.seq_len=64"):
        load_toml(SFTJobConfig, _toml(tmp_path, "[trainer]\nseq_len = 64\nmicro_batch_tokens = 16\n"))


def test_impossible_topologies_say_what_fits() -> None:
    with pytest.raises(ValueError, match=r"num_inference_ranks=4 does not fit a world of 4 ranks.*would fit: 1..3"):
        plan_topology(TopologyConfig(mode="disjoint", num_inference_ranks=4), 4, 0)
    with pytest.raises(ValueError, match=r"not a multiple of --topology.engine_tp=2"):
        TopologyConfig(num_inference_ranks=3, engine_tp=2)
    with pytest.raises(ValueError, match=r"--topology.ep=3 does not divide the 2 trainer ranks; would fit: \[1, 2\]"):
        plan_topology(TopologyConfig(num_inference_ranks=2, ep=3), 4, 0)
    with pytest.raises(ValueError, match=r"spans two nodes"):
        plan_topology(TopologyConfig(num_inference_ranks=4, engine_tp=4), 6, 0, local_world_size=4)
    with pytest.raises(ValueError, match=r"colocated mode runs one engine per rank"):
        plan_topology(TopologyConfig(mode="colocated", engine_tp=2), 2, 0)


def test_topology_layouts() -> None:
    t = plan_topology(TopologyConfig(num_inference_ranks=4, engine_tp=2), 6, 4)
    assert (t.mode, t.trainer_ranks, t.inference_ranks, t.engine_leaders) == ("disjoint", [0, 1], [2, 3, 4, 5], [2, 4])
    assert t.is_inference and not t.is_trainer and t.engine_index == 1 and t.is_engine_leader
    c = plan_topology(TopologyConfig(), 1, 0)
    assert c.mode == "colocated" and c.is_trainer and c.is_inference and c.is_controller


def test_cli_errors_exit_2_with_message(capsys) -> None:
    assert main(["sft", "--config", "/nonexistent.toml"]) == 2
    assert "--config='/nonexistent.toml': no such file" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "unknown subcommand 'train'" in capsys.readouterr().err


def test_dry_run_prints_resolved_config(capsys) -> None:
    rc = main(["sft", "--config", str(ROOT / "configs/reverse_text/sft.toml"), "--dry_run", "--optim.lr", "0.01"])
    assert rc == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["optim"]["lr"] == 0.01 and cfg["model"]["init_tiny"] == "qwen3-1m"


def _flags(cfg: object) -> set[str]:
    """Every dotted flag of a job config (nested sections such as model.lora included)."""
    import dataclasses

    flags = set()
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v == [] and f.name == "envs":  # a list of sections has flags (--envs.0.name) once the TOML gives entries
            continue
        flags |= {f"{f.name}.{g}" for g in _flags(v)} if dataclasses.is_dataclass(v) else {f.name}
    return flags


@pytest.mark.parametrize("cmd", ["sft", "rl", "eval"])
def test_help_lists_exactly_the_subcommands_flags(cmd: str) -> None:
    """Each subcommand's --help shows its own flags with their docstrings, and none that it would ignore."""
    out = subprocess.run(
        [sys.executable, "-m", "prime_spmd", cmd, "--help"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "400", "PATH": ""},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    own = _flags({"sft": SFTJobConfig, "rl": RLJobConfig, "eval": EvalJobConfig}[cmd]())

    def shown(flag: str) -> bool:
        # an option starts a help row ("│ --flag TYPE", booleans "│ --flag, --no_flag"), not a docstring's mention
        return re.search(rf"│ --{re.escape(flag)}(?![\w.])", text) is not None

    for flag in own:
        assert shown(flag), flag
    everything = _flags(SFTJobConfig()) | _flags(RLJobConfig()) | _flags(EvalJobConfig())
    foreign = {f for f in everything - own if shown(f)}
    assert not foreign, f"{cmd} --help shows flags it ignores: {sorted(foreign)}"
    assert "Peak learning rate (AdamW)" in text or cmd == "eval"
    if cmd == "rl":  # its batch is prompts_per_step x group_size; the SFT-only and eval-only flags stay out
        assert "--trainer.batch_size" not in text and "--rollout.group_size" in text


def test_each_subcommand_has_its_learning_rate_and_needs_a_model_path(capsys) -> None:
    assert SFTJobConfig().optim.lr == SFT_DEFAULT_LR and RLJobConfig().optim.lr == RL_DEFAULT_LR
    for cmd in ("sft", "rl", "eval"):
        assert main([cmd, "--dry_run"]) == 2
        assert "--model.path is required" in capsys.readouterr().err
    assert main(["rl", "--dry_run", "--model.path", "m"]) == 0
    assert json.loads(capsys.readouterr().out)["optim"]["lr"] == RL_DEFAULT_LR


def test_auto_flags_lists_the_settings_left_to_the_run() -> None:
    flags = auto_flags(RLJobConfig())
    assert {"model.dtype", "trainer.loss_impl", "topology.bridge_timeout_s", "inference.max_model_len"} <= set(flags)
    assert "model.path" not in flags and "optim.lr" not in flags
    assert "trainer.loss_impl" not in auto_flags(
        parse_cli(SFTJobConfig, ["--model.path", "m", "--trainer.loss_impl", "triton"], "x")
    )


def test_config_json_holds_what_every_auto_resolved_to(tmp_path: Path) -> None:
    """A run writes a ``resolved`` block that covers every ``auto`` (and 0-means-pick) setting of its config."""
    model = tmp_path / "model"
    sft_out, eval_out = tmp_path / "sft", tmp_path / "eval"
    sft = ["sft", "--model.path", str(model), "--model.init_tiny", "qwen3-nano", "--output_dir", str(sft_out),
           "--trainer.max_steps", "1", "--trainer.batch_size", "2", "--trainer.seq_len", "32",
           "--trainer.micro_batch_tokens", "64", "--eval_examples", "0", "--ckpt.no_save_hf", "--log.no_plots",
           "--log.no_progress"]  # fmt: skip
    assert main(sft) == 0
    ev = ["eval", "--model.path", str(model), "--output_dir", str(eval_out), "--env.num_eval_examples", "2",
          "--sampling.max_tokens", "4", "--inference.max_batch_size", "2", "--log.no_progress"]  # fmt: skip
    assert main(ev) == 0
    for out, cls, argv in ((sft_out, SFTJobConfig, sft), (eval_out, EvalJobConfig, ev)):
        written = json.loads((out / "config.json").read_text())
        resolved = written.pop("resolved")
        missing = set(auto_flags(parse_cli(cls, argv[1:], "x"))) - set(resolved)
        assert not missing, f"{argv[0]}: auto settings without a resolved value: {sorted(missing)}"
        assert all(v != "auto" for v in resolved.values()), resolved
    resolved = json.loads((sft_out / "config.json").read_text())["resolved"]
    assert resolved["model.dtype"] == "float32" and resolved["trainer.loss_impl"] == "reference"
    assert resolved["trainer.compile"] == "off" and resolved["topology.backend"] == "gloo"
    resolved = json.loads((eval_out / "config.json").read_text())["resolved"]
    assert resolved["inference.native.decode_attention"] == "bmm" and resolved["inference.native.sampler"] == "torch"


def test_rl_config_cross_section_rule() -> None:
    with pytest.raises(ValueError, match="max_model_len=10 is shorter than --trainer.seq_len=64"):
        parse_cli(
            RLJobConfig,
            [
                "--model.path",
                "m",
                "--inference.max_model_len",
                "10",
                "--trainer.seq_len",
                "64",
                "--trainer.micro_batch_tokens",
                "64",
            ],
            "x",
        )
