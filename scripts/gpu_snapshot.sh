#!/usr/bin/env bash
# The committed tree (git archive HEAD) in outputs/snap, stamped with its commit in outputs/snap/COMMIT, for
# the GPU machine: carry "outputs/snap" and run from there (benchmarks record COMMIT as their commit;
# git on that machine may see another HEAD). Uncommitted changes are not in it: commit first.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf outputs/snap && mkdir -p outputs/snap
git archive HEAD | tar -x -C outputs/snap
git rev-parse --short HEAD > outputs/snap/COMMIT
echo "outputs/snap at $(cat outputs/snap/COMMIT)"
