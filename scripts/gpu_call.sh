#!/usr/bin/env bash
# One device call of the GPU suite over a committed tree (the device tool copies the working tree; results must name
# the commit they ran on). Here, before the call:
#   bash scripts/gpu_wheels.sh                      # once: .whl/ (wheels, the Qwen3 tokenizer)
#   mkdir -p .gpu && git archive HEAD -o .gpu/head.tar && git rev-parse --short HEAD > .gpu/COMMIT
# then the device call, carrying [".whl", ".gpu"] (both git-ignored through .git/info/exclude), e.g.
#   SIDES=ours1 RL_LIMIT_S=380 bash scripts/gpu_call.sh "rl_e2e number_list" 585
# It unpacks .gpu/head.tar into /tmp/w, runs `benchmarks/gpu_suite.sh PART /tmp/o VARIANT` there under LIMIT_S
# (default 585) with PRIME_SPMD_COMMIT set (benchmarks/common.py source_commit), and tars /tmp/o into
# $OUT/results_PART[_VARIANT].tar.gz (spaces as _) every 20 s and at the end, so a call cut by its limit or the
# session's budget keeps what it wrote, and several parts run one after another in one call keep theirs apart:
#   bash scripts/gpu_call.sh startup 330; bash scripts/gpu_call.sh "fp8 tests" 230
# Environment variables (SIDES, SFT_REUSE, ...) pass through to gpu_suite.sh. /tmp persists between calls on one warm
# machine (gpu_suite's SFT_KEEP relies on it); /tmp/o and /tmp/w do not (GPU_CALL_TMP moves both: tests).
set -u
read -r PART VARIANT <<< "$1"
LIMIT=${2:-585}
[ -f .gpu/head.tar ] && [ -f .gpu/COMMIT ] || { echo "no .gpu/head.tar or .gpu/COMMIT (see the header)"; exit 2; }
T=${GPU_CALL_TMP:-/tmp}
W=$T/w
O=$T/o
rm -rf "$W" "$O"
mkdir -p "$W" "$O"
tar xf .gpu/head.tar -C "$W"
cp -r .whl "$W/"
cp .gpu/COMMIT "$O/COMMIT"
PRIME_SPMD_COMMIT=$(cat "$O/COMMIT")
export PRIME_SPMD_COMMIT
cd "$W" || exit 2
NAME=results_${PART}${VARIANT:+_${VARIANT// /_}}.tar.gz
snap() { tar czf "$T/results.tar.gz" -C "$T" o 2> /dev/null && cp "$T/results.tar.gz" "${OUT:-$T}/$NAME"; }
(while true; do sleep 20; snap; done) > /dev/null 2>&1 &
ticker=$!
echo "commit $PRIME_SPMD_COMMIT part $PART variant ${VARIANT:-} limit $LIMIT start $(date +%T)"
timeout "$LIMIT" bash benchmarks/gpu_suite.sh "$PART" "$O" ${VARIANT:+"$VARIANT"} > "$O/suite.log" 2>&1
echo "rc=$? end $(date +%T)"
kill "$ticker" 2> /dev/null
snap
tail -n 80 "$O/suite.log"
