"""Entry point: ``python -m prime_spmd {sft,rl,eval,plot} [--config FILE.toml] [--section.field VALUE ...]``.

Parse -> (dry run: print and exit) -> init distributed -> build -> run. The same program runs on
every rank under torchrun; the global rank decides the role.
"""

from __future__ import annotations

import sys

USAGE = """usage: python -m prime_spmd {sft,rl,eval,plot} [--config FILE.toml] [flags]

subcommands:
  sft    supervised fine-tuning (FSDP2 on every rank)
  rl     asynchronous RL: trainer ranks + in-process inference engines
  eval   run an environment's eval split with the inference engine
  plot   write PNG plots of a run directory's metrics.jsonl

`python -m prime_spmd SUBCOMMAND --help` lists every flag with its docstring."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    prog = f"python -m prime_spmd {cmd}"
    from prime_spmd.config import EvalJobConfig, RLJobConfig, SFTJobConfig, parse_cli, to_json

    if cmd == "plot":
        from prime_spmd.plots import plot_main

        return plot_main(rest)
    classes = {"sft": SFTJobConfig, "rl": RLJobConfig, "eval": EvalJobConfig}
    if cmd not in classes:
        print(f"unknown subcommand {cmd!r}; expected one of: sft, rl, eval, plot\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        cfg = parse_cli(classes[cmd], rest, prog)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        print(to_json(cfg))
        return 0
    if cmd == "sft":
        from prime_spmd.trainer.sft import run_sft

        run_sft(cfg)
    elif cmd == "rl":
        from prime_spmd.rl.loop import run_rl

        run_rl(cfg)
    else:
        from prime_spmd.eval import run_eval

        run_eval(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
