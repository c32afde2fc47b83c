#!/usr/bin/env bash
# The test command: builds/reuses .venv, then runs the CPU test suites (unit, kernels, distributed,
# integration). Extra arguments go to pytest. pytest's exit code 5 (no tests collected) is success.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
# The venv first on PATH: tests launch `torchrun` (launch/*.sh) and `python -m prime_spmd` subprocesses.
export PATH="$PWD/.venv/bin:$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TRITON_INTERPRET=${TRITON_INTERPRET:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests (exit 5): treated as success" >&2
  exit 0
fi
exit $rc
