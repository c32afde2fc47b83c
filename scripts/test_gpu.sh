#!/usr/bin/env bash
# The GPU test suite (docs/testing.md), on a machine with a CUDA GPU, in steps with their own time limits
# (900 s in all; STEPS="kernels unit" or "gpu exact" runs some, e.g. to fit a 10-minute device call):
#   1. kernels: tests/kernels, the same files as on CPU, with their tensors on CUDA (the `device` fixture
#      in tests/conftest.py): Triton kernels compiled instead of interpreted;
#   2. unit: tests/unit/test_loss_impls.py, test_native_engine.py, test_native_decode_attention.py, test_native_decode_linear.py, test_native_prefill.py,
#      test_paged_kv_cache.py on CUDA (kernels compiled,
#      the native engine with compiled decode and CUDA graphs), test_train_compile.py (inductor on CUDA),
#      test_attention_backends.py (no cuDNN SDPA);
#   3. gpu: tests/gpu (-m gpu), real shapes in bf16 (LM head, loss-fused head, MoE experts, FP8 quantize / linears /
#      engine with CUDA graphs: test_fp8_real_shapes.py, sm >= 8.9);
#   4. exact: --model.exact on CUDA (tests/unit/test_exact_mode.py, test_exact_rl.py, tests/gpu/test_exact_mode_gpu.py):
#      engine logprobs == trainer logprobs bit for bit, ~5k tokens at the Qwen3-0.6B layer shape, RL at lag 0.
#   bash scripts/test_gpu.sh [OUTDIR]     (default $OUT, else /tmp/test_gpu)
# Writes OUTDIR/{kernels,unit,gpu,exact}.{log,xml} and OUTDIR/summary.txt (counts, times, each failure's message,
# the measured errors recorded by the tests as junit properties). Exits nonzero if a step fails or times out.
# With pytest-timeout importable each test has its own limit (a slow test fails alone, with its stack);
# a step past its limit gets SIGINT, so pytest still prints the tracebacks so far and writes its junit file.
# Needs torch, triton, transformers, and tyro (+ docstring_parser, typeguard: prime_spmd.config imports it; several
# unit files import ModelConfig / LossConfig from there): where tyro is not importable, the wheels of
# scripts/gpu_wheels.sh in .whl/ (carry it) are installed into a temp dir first. verifiers is not needed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/test_gpu}}
mkdir -p "$OUT"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'scripts/test_gpu.sh needs a CUDA GPU')" || exit 1
unset TRITON_INTERPRET  # kernels compile for the GPU (tests/conftest.py sets it only without CUDA)
if ! python3 -c "import tyro" 2> /dev/null; then
  whls=(.whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl)
  if [ -f "${whls[0]}" ]; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${whls[@]}"
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "tyro not importable and no .whl/tyro-*.whl (bash scripts/gpu_wheels.sh, carry .whl): files importing prime_spmd.config fail"
  fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
rc=0
per_test=()
python3 -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout) || echo "pytest-timeout not importable: no per-test limits"
step() {  # name, step limit in s, per-test limit in s, pytest arguments
  local name=$1 limit=$2 test_limit=$3
  shift 3
  case " ${STEPS:-kernels unit gpu exact} " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s, per test ${test_limit}s, $(date +%T))"
  # -v: results as they come; --tb=short -rfE: tracebacks and a one-line summary per failure at the end
  # (also printed after a SIGINT); -k 15: SIGKILL if pytest ignores the SIGINT.
  timeout -s INT -k 15 "$limit" python3 -m pytest -v -p no:cacheprovider -o addopts="" --strict-markers \
    --continue-on-collection-errors --durations=15 --tb=short -rfEs --junitxml="$OUT/$name.xml" \
    ${per_test[@]+"${per_test[@]}" "$test_limit"} "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "rc=$r $name$([ $r -eq 124 ] && echo ' (timed out)')"
  tail -n 4 "$OUT/$name.log"
  [ $r -eq 0 ] || rc=1
}
start=$(date +%s)
step kernels 280 90 -m "not gpu" tests/kernels
step unit 240 90 -m "not gpu" tests/unit/test_loss_impls.py tests/unit/test_native_engine.py tests/unit/test_native_decode_attention.py \
  tests/unit/test_native_decode_linear.py tests/unit/test_native_prefill.py tests/unit/test_paged_kv_cache.py tests/unit/test_train_compile.py tests/unit/test_attention_backends.py
step gpu 200 120 -m gpu tests/gpu --ignore=tests/gpu/test_exact_mode_gpu.py  # the offload test is a whole RL run (~60 s)
step exact 180 120 tests/unit/test_exact_mode.py tests/unit/test_exact_rl.py tests/gpu/test_exact_mode_gpu.py
python3 - "$OUT" > "$OUT/summary.txt" <<'EOF'
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
for name in os.environ.get("STEPS", "kernels unit gpu exact").split():
    path = out / f"{name}.xml"
    if not path.is_file():
        print(f"{name}: no junit file (timed out?); see {name}.log")
        continue
    suite = ET.parse(path).getroot().find("testsuite")
    a = suite.attrib
    failed, errors, skipped = int(a["failures"]), int(a["errors"]), int(a["skipped"])
    passed = int(a["tests"]) - failed - errors - skipped
    print(f"{name}: {passed} passed, {failed} failed, {errors} errors, {skipped} skipped in {float(a['time']):.0f} s")
    for case in suite.iter("testcase"):
        for bad in (*case.iter("failure"), *case.iter("error")):
            message = " ".join((bad.attrib.get("message") or "").split())[:300]
            print(f"  {bad.tag.upper()} {case.attrib.get('classname', '')}::{case.attrib['name']}: {message}")
        for prop in case.iter("property"):
            print(f"  {case.attrib['name']}: {prop.attrib['name']} = {prop.attrib['value']}")
EOF
echo "total $(( $(date +%s) - start )) s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $rc
