#!/usr/bin/env bash
# The main job: the reverse-text demo, SFT warm-up then RL, on the embedded native engine.
# CPU by default (a few minutes on 2 cores); on a CUDA machine the same commands use the GPU.
#   bash scripts/demo.sh [OUT_DIR]        (default outputs/reverse_text)
# Steps: build .venv -> SFT a random ~0.8M-parameter Qwen3 from scratch -> eval -> RL -> eval,
# then print the eval reward before and after RL and the path of the reward-curve PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/reverse_text}
bash scripts/setup_env.sh
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
run() { echo "+ $*" >&2; "$@"; }
run $PY -m prime_spmd sft --config configs/reverse_text/sft.toml \
  --output_dir "$OUT/sft" --model.path "$OUT/base"
run $PY -m prime_spmd eval --config configs/reverse_text/eval.toml \
  --model.path "$OUT/sft/hf" --output_dir "$OUT/eval_sft"
run $PY -m prime_spmd rl --config configs/reverse_text/rl.toml \
  --model.path "$OUT/sft/hf" --output_dir "$OUT/rl"
run $PY -m prime_spmd eval --config configs/reverse_text/eval.toml \
  --model.path "$OUT/rl/hf" --output_dir "$OUT/eval_rl"
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
before = json.loads((out / "eval_sft" / "summary.json").read_text())
after = json.loads((out / "eval_rl" / "summary.json").read_text())
print("\nreverse-text eval (held-out strings, sampled at T=1):")
for name, s in (("after SFT", before), ("after RL ", after)):
    print(f"  {name}: mean reward {s['reward_mean']:.3f}  pass@1 {s.get('pass@1', float('nan')):.3f}")
print(f"reward curve: {out / 'rl' / 'plots' / 'reward.png'}")
PYEOF
