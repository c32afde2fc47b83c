#!/usr/bin/env bash
# Build (or reuse) the project's virtual environment in .venv and print nothing but progress.
# CPU machines: torch==2.13.0 is pinned in the same pip command so that no CUDA build is pulled.
# Set PRIME_SPMD_TORCH to install another torch spec (e.g. on a GPU machine: PRIME_SPMD_TORCH=torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${PRIME_SPMD_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)" >&2
  $PY -m venv .venv
fi
STAMP=.venv/.prime_spmd_stamp
WANT="$(sha256sum pyproject.toml | cut -c1-16) $TORCH_SPEC"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing $TORCH_SPEC and prime-spmd[dev] into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2
  .venv/bin/python -m pip install -q "$TORCH_SPEC" -e ".[dev]" >&2
  echo "$WANT" > "$STAMP"
fi
