#!/usr/bin/env bash
# The GPU test suite (docs/testing.md), on a machine with a CUDA GPU, in two steps with their own time limits:
#   1. device_aware: tests/kernels, tests/unit/test_loss_impls.py, tests/unit/test_native_engine.py, the same
#      files as on CPU, with their tensors on CUDA (the `device` fixture in tests/conftest.py): Triton kernels
#      compiled instead of interpreted, the native engine with compiled decode and CUDA graphs;
#   2. gpu: tests/gpu (-m gpu), real shapes in bf16 (LM head, loss-fused head, MoE experts).
#   bash scripts/test_gpu.sh [OUTDIR]     (default $OUT, else /tmp/test_gpu)
# Writes OUTDIR/{device_aware,gpu}.{log,xml} and OUTDIR/summary.txt (counts, times, the measured errors
# recorded by the tests as junit properties). Exits nonzero if a step fails or times out.
# Needs torch, triton, transformers; tyro and verifiers are not imported by these files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/test_gpu}}
mkdir -p "$OUT"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'scripts/test_gpu.sh needs a CUDA GPU')" || exit 1
unset TRITON_INTERPRET  # kernels compile for the GPU (tests/conftest.py sets it only without CUDA)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
rc=0
step() {  # name, time limit in s, pytest arguments; -v so the log keeps the results even after a timeout
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s, $(date +%T))"
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider -o addopts="" --strict-markers \
    --continue-on-collection-errors --durations=15 -rfEs --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "rc=$r $name$([ $r -eq 124 ] && echo ' (timed out)')"
  tail -n 4 "$OUT/$name.log"
  [ $r -eq 0 ] || rc=1
}
start=$(date +%s)
step device_aware 210 -m "not gpu" tests/kernels tests/unit/test_loss_impls.py tests/unit/test_native_engine.py
step gpu 120 -m gpu tests/gpu
python3 - "$OUT" > "$OUT/summary.txt" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
for name in ("device_aware", "gpu"):
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
        for prop in case.iter("property"):
            print(f"  {case.attrib['name']}: {prop.attrib['name']} = {prop.attrib['value']}")
EOF
echo "total $(( $(date +%s) - start )) s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $rc
