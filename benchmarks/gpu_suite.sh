#!/usr/bin/env bash
# GPU runs recorded in docs/benchmarks.md, in parts that fit one device call each.
#   bash benchmarks/gpu_suite.sh PART OUTDIR     PART: tests | engine | engine_profile | issue17 | issue17b | issue17c | issue17d | issue17e | attn_splits | chain_key | chain_tests | best_tests | mismatch_check | head_rows | kl_same_machine | resolve | resolve_tests | steps_final | steps_check | rows_h200 | steps_one | steps | steps_b | chain | gemv_pdl_tests | gemv_pdl | pdl_prefetch | sampler | paged | fused_attn | decode_attn | decode_linear_sweep | decode_linear_splitk | decode_linear_engine | loss | moe | trainer | train_step | lora | env_bridge | engine_warmup | rl_e2e | sample_parity | rl
# Each step has its own time limit so that one slow step does not lose the others' results. Parts run at the defaults
# of their day: since the steps part, PDL, the fused prefill, the preloaded attention tile,
# the glue kernels and 4 decode steps a launch are the CUDA defaults.
set -uo pipefail
PART=$1; OUT=${2:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $name"; tail -n 25 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
case $PART in
  tests)
    run tests_gpu 570 bash scripts/test_gpu.sh "$OUT/tests" ;;  # docs/testing.md; its summary.txt has counts and errors
  engine)
    run engine 300 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --prompt-len 128 --new-tokens 256 --engine native,hf --out "$OUT/engine.json"
    run mismatch 120 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch.json" ;;
  engine_profile)  # issue 17: where a decode step's time goes (batch 1 / 64, default kernels), then the engine rows at 1 / 64 / 256; ~5 min
    mkdir -p "$OUT/engine_profile"
    run engine_profile 200 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --out-dir "$OUT/engine_profile"
    run engine_rows 240 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_rows.json" ;;
  sampler)  # issue 17: the split-vocabulary Triton sampler and its LM-head-fused form (kernels/gumbel_sample): CUDA tests, engine rows torch / triton / fused, mismatch KL of fused; ~6 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run sampler_tests 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_gumbel_sample.py
    run sampler_engine 300 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton --decode-linear auto --sampler torch,triton,fused --out "$OUT/engine_sampler.json"
    run mismatch_sampler 90 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --sampler fused --out "$OUT/mismatch_sampler_fused.json" ;;
  decode_attn)  # issue 17: the Triton decode attention on CUDA (tests), alone (sweep), in the engine vs bmm
    run decode_attn_tests 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_attention.py tests/unit/test_native_decode_attention.py
    run decode_attn_kernel 100 python3 benchmarks/decode_attention.py --batch-sizes 1,64,256 --out "$OUT/decode_attention.json"
    run decode_attn_engine 270 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 256 --engine native --decode-attention bmm,triton --out "$OUT/engine_decode_attn.json" ;;
  issue17)  # issue 17, the untimed levers in one call: CUDA tests of their kernels and engine, then one engine process (recompile limit raised) with attention triton / fused x sampler torch / fused at batch 1 / 64 / 256, mismatch KL of the fused pair; ~9 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run issue17_tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_attention.py tests/kernels/test_gumbel_sample.py tests/unit/test_native_decode_attention.py tests/unit/test_paged_kv_cache.py
    run issue17_engine 280 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton,fused --sampler torch,fused --out "$OUT/engine_issue17.json"
    run issue17_profile 100 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --decode-attention fused --sampler fused --out-dir "$OUT"
    run issue17_mismatch 80 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --decode-attention fused --sampler fused --out "$OUT/mismatch_issue17.json" ;;
  issue17b)  # issue 17, after issue17 (whose engine rows ran the torch decode linears): the levers on the default fused decode linears, CUDA tests with room to compile, --pdl rows, profile of triton attention + fused sampler; ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run issue17b_tests 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_attention.py tests/kernels/test_gumbel_sample.py tests/unit/test_native_decode_attention.py tests/unit/test_paged_kv_cache.py
    run issue17b_engine 200 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton,fused --decode-linear triton --sampler torch,fused --out "$OUT/engine_issue17b.json"
    run issue17b_engine_pdl 120 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton,fused --decode-linear triton --sampler fused --pdl --out "$OUT/engine_issue17b_pdl.json"
    mkdir -p "$OUT/profile_triton"
    run issue17b_profile 90 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --decode-attention triton --sampler fused --out-dir "$OUT/profile_triton"
    run issue17b_mismatch 80 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --decode-attention triton --sampler fused --out "$OUT/mismatch_issue17b.json" ;;
  issue17c)  # issue 17, after fused attention + fused sampler became the CUDA defaults: CUDA tests of what changed, the 0.6B rows at the defaults, the 8B shape with attention triton / fused x sampler torch / fused; ~7 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run issue17c_tests 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_attention.py tests/unit/test_native_decode_attention.py tests/unit/test_paged_kv_cache.py
    run issue17c_engine 100 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_issue17c.json"
    run issue17c_engine_8b 170 python3 benchmarks/engine.py --device cuda --model-shape qwen3-8b --batch-sizes 1,64 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton,fused --sampler torch,fused --out "$OUT/engine_issue17c_8b.json" ;;
  pdl_prefetch)  # issue 17, batch 1: PDL with the decode linears prefetching their weight rows into L2 before they wait, vs its minimal form and no PDL (default engine otherwise), each its own process (PDL is process-wide); CUDA tests first; ~4 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run pdl_tests 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_linear.py tests/unit/test_native_decode_attention.py -k "pdl or prefetch or decode_linear"
    for form in off minimal prefetch; do
      flags=""; [ $form = minimal ] && flags="--pdl --no-pdl-prefetch"; [ $form = prefetch ] && flags="--pdl"
      run "pdl_engine_$form" 90 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64 --prompt-len 128 --new-tokens 256 --engine native $flags --out "$OUT/engine_pdl_$form.json"
    done
    mkdir -p "$OUT/profile_pdl"
    run pdl_profile 90 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --pdl --out-dir "$OUT/profile_pdl" ;;
  issue17d)  # issue 17, batch 1: the one-row GEMV decode-linear kernel and CUDA-graph prefill: CUDA tests, the decode linears alone (GEMV grid, tile kernel with split K), engine rows GEMV on / off / on with PDL (minimal form), profile; ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run d_tests 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_linear.py tests/unit/test_native_engine.py tests/unit/test_native_decode_linear.py
    run d_linears 240 python3 benchmarks/decode_linear.py --model-shape qwen3-0.6b --rows 1 --sweep default --split-k 1,2,4,8 --gemv --out "$OUT/decode_linear_gemv.json"
    run d_engine_gemv 120 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_gemv.json"
    run d_engine_tiles 90 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --no-decode-gemv --out "$OUT/engine_tiles.json"
    run d_engine_gemv_pdl 90 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --pdl --no-pdl-prefetch --out "$OUT/engine_gemv_pdl.json"
    mkdir -p "$OUT/profile_gemv"
    run d_profile 90 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --out-dir "$OUT/profile_gemv" ;;
  issue17e)  # issue 17, after issue17d: the GEMV kernel's default tiles from its sweep (2 columns a program): the 0.6B rows at the defaults, its CUDA tests, mismatch KL at one row (the GEMV's) and at 64 rows; ~4.5 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run e_engine 120 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    run e_tests 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_linear.py
    run e_mismatch_1row 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    run e_mismatch 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json"
    [ "${WITH_SPLITS:-0}" = 1 ] && for t in 2 4; do  # what time is left: attention split tiles at batch 1
      run "e_attn_split_tiles_$t" 45 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --attention-split-tiles $t --out "$OUT/engine_attn_split_tiles_$t.json"
    done ;;
  chain_key)  # issue 17, when only one call may run: the chain's CUDA tests, then batch 1 with the chain (with / without the fused prefill), the defaults at 1 / 16 / 64 / 256, the chain's mismatch KL at one row; ~9 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    B1="--device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native"
    run k_chain_tests 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_chain.py tests/unit/test_native_decode_chain.py
    run k_chain 110 python3 benchmarks/engine.py $B1 --decode-chain on --fused-prefill off,on --out "$OUT/engine_chain.json"
    run k_engine 110 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    run k_chain_mismatch 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --decode-chain --out "$OUT/mismatch_chain_one_row.json"
    mkdir -p "$OUT/profile_chain"
    run k_chain_profile 70 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --decode-chain --out-dir "$OUT/profile_chain" ;;
  chain_tests)  # issue 17, first call of the next session: the decode chain's CUDA tests (its own step: a hang there loses nothing else), then gemv_pdl_tests' set (GEMV, preloaded attention tile, compiled step glue, graph prefill, PDL tokens); ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run c_chain_tests 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_chain.py tests/unit/test_native_decode_chain.py
    run c_tests 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_linear.py tests/kernels/test_decode_attention.py tests/unit/test_native_engine.py tests/unit/test_native_decode_attention.py ;;
  mismatch_check)  # issue 17, first call of the next session: mismatch KL at the defaults (64 rows, one row) with the fused prefill on and off, after 394ec3e's rounding fix (compile_exact); batch 1 with the fused prefill off / on in one process, then with the LM-head sampler at one program an SM; the step-helper test (bf16 compiled norm bit-equal on CUDA), the 8B rows at 1 / 64 (PDL on by default since); ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    for fp in on off; do
      run "m_mismatch_fp_$fp" 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --fused-prefill $fp --out "$OUT/mismatch_defaults_fp_$fp.json"
      run "m_mismatch_1row_fp_$fp" 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --fused-prefill $fp --out "$OUT/mismatch_one_row_fp_$fp.json"
    done
    run m_engine_b1 70 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --fused-prefill off,on --out "$OUT/engine_b1_fp.json"
    run m_engine_b1_head1 50 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --lm-head-programs-per-sm 1 --out "$OUT/engine_b1_head1.json"
    run m_tests 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_native_engine.py -k "step_helpers or multi_step"
    run m_engine_8b 150 python3 benchmarks/engine.py --device cuda --model-shape qwen3-8b --batch-sizes 1,64 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_8b.json" ;;
  kl_same_machine)  # issue 17 on any Hopper: mismatch KL (64 rows) at HEAD with the fused prefill off / on (at 9715fa2 also on with one GEMM per projection: no better, removed), and at ../snap_base (2cb9112, the KL the issue compares to) on the same machine; batch 1 at HEAD with the fused prefill off / on, and at ../snap_adb (adb9e5d, whose H200 rows met the speed goals); ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run k_mismatch_fp_off 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_fp_off.json"
    if [ -d ../snap_base ]; then
      (cd ../snap_base && PYTHONPATH=/tmp/site:$PWD run k_base_mismatch 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_base.json")
    fi
    run k_mismatch_fp_on 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --fused-prefill on --out "$OUT/mismatch_fp_on.json"
    run k_engine_b1 60 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --fused-prefill off,on --out "$OUT/engine_b1_fp.json"
    if [ -d ../snap_adb ]; then
      (cd ../snap_adb && PYTHONPATH=/tmp/site:$PWD run k_adb_b1 55 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_adb_b1.json")
    fi ;;
  head_rows)  # issue 17, HEAD's defaults in ~2 min: the 0.6B rows at 1 / 16 / 64 / 256 and the mismatch KL at 64 rows
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run h_engine 130 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    run h_mismatch 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json" ;;
  resolve)  # issue 17 at HEAD's defaults (fused prefill off since 1a15249, compile_exact): mismatch KL at 64 rows and one row, the 0.6B rows at 1 / 16 / 64 / 256, batch 1 with the fused prefill on, the 8B rows at 1 / 64; ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run r_mismatch 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json"
    run r_engine 130 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    run r_mismatch_1row 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    run r_engine_8b 150 python3 benchmarks/engine.py --device cuda --model-shape qwen3-8b --batch-sizes 1,64 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_8b.json"
    run r_engine_b1_fp 60 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --fused-prefill off,on --out "$OUT/engine_b1_fp.json" ;;
  resolve_tests)  # issue 17, after resolve: the CUDA tests of the engine's paths at HEAD, mismatch KL with the fused prefill on, batch 1 with the LM-head sampler at one program an SM; ~6 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run t_tests 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_glue.py tests/unit/test_native_engine.py tests/unit/test_native_decode_linear.py
    run t_mismatch_fp_on 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --fused-prefill on --out "$OUT/mismatch_fp_on.json"
    run t_engine_b1_head1 50 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --lm-head-programs-per-sm 1 --out "$OUT/engine_b1_head1.json" ;;
  steps_final)  # issue 17, the new defaults in one call of ~8 min: the 0.6B rows at 1 / 16 / 64 / 256 (4 decode steps a launch at <= 16 rows), batch 1 of ../snap_base's best flags (same machine), mismatch KL at one row and at 64, the CUDA tests of the new paths
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run f_engine 130 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    if [ -d ../snap_base ]; then
      (cd ../snap_base && PYTHONPATH=/tmp/site:$PWD run f_base_b1 55 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --pdl --fused-prefill on --attention-preload-tile --out "$OUT/engine_base_b1.json")
    fi
    run f_mismatch_1row 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    run f_mismatch 50 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json"
    run f_tests 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_glue.py tests/unit/test_native_engine.py tests/unit/test_native_decode_linear.py ;;
  steps_check)  # issue 17, the new defaults' check on any Hopper (when the H200 does not come): batch 1 with 1 and 4 decode steps a launch, ../snap_base's best flags (same machine), the LM head at one program an SM, then the CUDA tests of the new paths; ~6 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run c_engine_b1 70 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --decode-steps 1,4 --out "$OUT/engine_b1.json"
    if [ -d ../snap_base ]; then
      (cd ../snap_base && PYTHONPATH=/tmp/site:$PWD run c_base_b1 55 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --pdl --fused-prefill on --attention-preload-tile --out "$OUT/engine_base_b1.json")
    fi
    run c_engine_b1_head1 45 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --lm-head-programs-per-sm 1 --out "$OUT/engine_b1_head1.json"
    run c_tests 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_glue.py tests/unit/test_native_engine.py tests/unit/test_native_decode_linear.py ;;
  rows_h200)  # issue 17, after steps_check: the 0.6B rows at 1 / 16 / 64 / 256 (defaults: 4 decode steps a launch at <= 16 rows), mismatch KL at one row and at 64; ~4.5 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run r_engine 130 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    run r_mismatch_1row 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    run r_mismatch 50 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json" ;;
  steps_one)  # issue 17, steps and steps_b in one call when only one may run: the 0.6B rows at 1 / 16 / 64 / 256 with 1 and 4 decode steps a launch, batch 1 of ../snap_base's best flags, batch 1 with the LM head at one program an SM, mismatch KL at one row and at 64, then the CUDA tests of the new paths; ~9.8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run s_engine 170 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --decode-steps 1,4 --out "$OUT/engine_defaults.json"
    if [ -d ../snap_base ]; then
      (cd ../snap_base && PYTHONPATH=/tmp/site:$PWD run s_base_b1 55 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --pdl --fused-prefill on --attention-preload-tile --out "$OUT/engine_base_b1.json")
    fi
    run t_engine_b1_head1 45 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --lm-head-programs-per-sm 1 --out "$OUT/engine_b1_head1.json"
    run t_mismatch_1row 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    run t_mismatch 50 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json"
    run s_tests 195 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_glue.py tests/unit/test_native_engine.py tests/unit/test_native_decode_linear.py ;;
  steps)  # issue 17, the new CUDA defaults (PDL, fused prefill, preloaded attention tile, glue kernels, 4 decode steps a launch): the 0.6B rows at 1 / 16 / 64 / 256 with 1 and 4 steps a launch in one process, batch 1 of the previous commit's best flags from ../snap_base when carried (same machine), then the CUDA tests; ~9.5 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run s_engine 180 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --decode-steps 1,4 --out "$OUT/engine_defaults.json"
    if [ -d ../snap_base ]; then
      (cd ../snap_base && PYTHONPATH=/tmp/site:$PWD run s_base_b1 60 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --pdl --fused-prefill on --attention-preload-tile --out "$OUT/engine_base_b1.json")
    fi
    run s_tests 270 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_glue.py tests/unit/test_native_engine.py tests/unit/test_native_decode_linear.py tests/unit/test_native_decode_attention.py ;;
  steps_b)  # issue 17, after steps: batch 1 at the defaults again (its own process), then with the LM-head sampler at one program an SM (one full wave), the profile at batch 1 and 64 with its one-launch kernel timeline, mismatch KL at one row (2,048 tokens) and at the default 64 rows; ~5 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run t_engine_b1 50 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_b1_rerun.json"
    run t_engine_b1_head1 50 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --lm-head-programs-per-sm 1 --out "$OUT/engine_b1_head1.json"
    mkdir -p "$OUT/profile"
    run t_profile 90 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --out-dir "$OUT/profile"
    run t_mismatch_1row 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    run t_mismatch 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json" ;;
  best_tests)  # issue 17, batch 1: the CUDA tests of what the 39.6% ran on (GEMV + PDL preload, preloaded attention tile, compiled glue, graph prefill), then the profile of that configuration with its one-step kernel timeline (launch gaps) and its engine row again; ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run b_tests 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_linear.py tests/kernels/test_decode_attention.py tests/unit/test_native_engine.py tests/unit/test_native_decode_attention.py
    mkdir -p "$OUT/profile_best"
    run b_profile 90 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --pdl --fused-prefill on --attention-preload-tile --out-dir "$OUT/profile_best"
    run b_engine 60 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --pdl --fused-prefill on --attention-preload-tile --out "$OUT/engine_best.json" ;;
  chain)  # issue 17, after chain_tests: batch 1 with the decode chain (its default first, with and without the fused prefill, then 16 / 32 KB items x 4 / 8 warps in one process), the 0.6B rows at the defaults, mismatch KL of the chain at one row, its profile, the chain with the preloaded attention tile, PDL + GEMV preload; each step its own process; ~9 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    B1="--device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native"
    run c_chain 100 python3 benchmarks/engine.py $B1 --decode-chain on --fused-prefill off,on --out "$OUT/engine_chain.json"
    run c_engine 100 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    run c_chain_mismatch 55 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --decode-chain --out "$OUT/mismatch_chain_one_row.json"
    mkdir -p "$OUT/profile_chain"
    run c_chain_profile 75 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --decode-chain --out-dir "$OUT/profile_chain"
    run c_chain_sweep 110 python3 benchmarks/engine.py $B1 --decode-chain on --chain-slab-bytes 32768,8192 --chain-warps 4,8 --out "$OUT/engine_chain_sweep.json"
    run c_chain_preload_tile 60 python3 benchmarks/engine.py $B1 --decode-chain on --attention-preload-tile --out "$OUT/engine_chain_preload_tile.json"
    run c_pdl_preload 50 python3 benchmarks/engine.py $B1 --pdl --out "$OUT/engine_pdl_preload.json" ;;
  gemv_pdl_tests)  # issue 17, before gemv_pdl: the CUDA tests of this session's untimed changes (GEMV, preloaded attention tile, compiled step glue, graph prefill, PDL tokens); ~5 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run g_tests 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_linear.py tests/kernels/test_decode_attention.py tests/unit/test_native_engine.py tests/unit/test_native_decode_attention.py ;;
  gemv_pdl)  # issue 17, after gemv_pdl_tests: the 0.6B rows at the defaults, batch 1 with PDL minimal / PDL + the GEMV's weight preload, attention split tiles 2 / 4 and the preloaded tile, mismatch KL at one row and at 64, profile; ~7 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run g_engine 120 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 256 --engine native --out "$OUT/engine_defaults.json"
    for form in minimal preload; do
      flags="--pdl --no-pdl-prefetch"; [ $form = preload ] && flags="--pdl"
      run "g_engine_pdl_$form" 60 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native $flags --out "$OUT/engine_pdl_$form.json"
    done
    for t in 2 4; do
      run "g_attn_split_tiles_$t" 45 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --attention-split-tiles $t --out "$OUT/engine_attn_split_tiles_$t.json"
    done
    run g_attn_preload 45 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --prompt-len 128 --new-tokens 256 --engine native --attention-preload-tile --out "$OUT/engine_attn_preload_tile.json"
    run g_mismatch_1row 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    run g_mismatch 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch_defaults.json"
    mkdir -p "$OUT/profile"
    run g_profile 90 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --out-dir "$OUT/profile" ;;
  attn_splits)  # issue 17, batch 1: the decode attention with each length split spanning >= 1 / 2 / 4 / 8 K/V tiles (fewer partials to combine, more tiles a program), engine rows at batch 1 / 16, each its own process; ~3 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    for t in 1 2 4 8; do
      run "attn_split_tiles_$t" 60 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16 --prompt-len 128 --new-tokens 256 --engine native --attention-split-tiles $t --out "$OUT/engine_attn_split_tiles_$t.json"
    done ;;
  paged)  # issue 17: the paged KV cache on CUDA: tests, the paged decode attention alone vs slot, engine rows slot vs paged, group KV memory; ~6 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run paged_tests 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_attention.py tests/unit/test_paged_kv_cache.py tests/unit/test_native_decode_attention.py
    run paged_kernel 90 python3 benchmarks/decode_attention.py --batch-sizes 1,64,256 --block-size 16 --sweep default --out "$OUT/decode_attention_paged.json"
    run paged_engine 240 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 256 --engine native --kv-cache slot,paged --out "$OUT/engine_paged.json"
    mkdir -p "$OUT/paged_groups"
    run paged_groups 120 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes "" --groups 8 --group-size 8 --group-prompt-len 1024 --group-new-tokens 16 --kv-cache slot,paged --out-dir "$OUT/paged_groups" ;;
  fused_attn)  # issue 17: --inference.decode_attention fused (q/k norm, RoPE, cache write inside the attention kernel) vs triton, then with --inference.pdl: CUDA tests, engine rows, mismatch KL; ~8 min
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run fused_attn_tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_decode_attention.py tests/unit/test_native_decode_attention.py
    run fused_attn_engine 180 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton,fused --out "$OUT/engine_fused_attn.json"
    run fused_attn_engine_pdl 150 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64 --prompt-len 128 --new-tokens 256 --engine native --decode-attention fused --pdl --out "$OUT/engine_fused_attn_pdl.json"
    run mismatch_fused_attn 90 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --decode-attention fused --out "$OUT/mismatch_fused_attn.json" ;;
  decode_linear_sweep)  # issue 17: the fused decode linears alone (sweep, 0.6B layer shapes, 1 and 64 rows); ~2.5 min
    run decode_linear_kernel_06b 240 python3 benchmarks/decode_linear.py --model-shape qwen3-0.6b --rows 1,64 --out "$OUT/decode_linear_06b.json"
    run decode_linear_kernel_8b 240 python3 benchmarks/decode_linear.py --model-shape qwen3-8b --rows 1,64 --out "$OUT/decode_linear_8b.json" ;;
  decode_linear_splitk)  # issue 17: the fused decode linears with K split over 2 / 4 / 8 programs (0.6B layer shapes, 1 / 16 / 64 rows); ~1.5 min
    run decode_linear_splitk 150 python3 benchmarks/decode_linear.py --model-shape qwen3-0.6b --rows 1,16,64 --sweep default --split-k 1,2,4,8 --out "$OUT/decode_linear_splitk.json" ;;
  decode_linear_engine)  # issue 17: the engine with torch vs fused decode linears (0.6B, 8B), mismatch KL of each; ~6.5 min
    # logprob_mismatch.py imports prime_spmd.config (tyro): install .whl (bash scripts/gpu_wheels.sh; carry .whl) first
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    run decode_linear_engine 190 python3 benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,16,64 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton --decode-linear torch,triton --out "$OUT/engine_decode_linear.json"
    for lin in torch triton; do
      run "mismatch_$lin" 90 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --decode-linear "$lin" --out "$OUT/mismatch_$lin.json"
    done
    run decode_linear_engine_8b 170 python3 benchmarks/engine.py --device cuda --model-shape qwen3-8b --batch-sizes 1,64 --prompt-len 128 --new-tokens 256 --engine native --decode-attention triton --decode-linear torch,triton --out "$OUT/engine_decode_linear_8b.json" ;;
  loss)
    run loss 420 python3 benchmarks/loss_kernel.py --out "$OUT/loss_kernel.json" ;;
  moe)  # first use (fresh Triton cache, then the same cache again), then warm speed: default table vs full autotune
    cache=$(mktemp -d)
    run moe_first_call_cold 150 env TRITON_CACHE_DIR="$cache" python3 benchmarks/moe.py --first_call --tokens 4096 --out "$OUT/moe_first_call_cold.json"
    run moe_first_call_cached 90 env TRITON_CACHE_DIR="$cache" python3 benchmarks/moe.py --first_call --tokens 4096 --out "$OUT/moe_first_call_cached.json"
    run moe 420 env TRITON_CACHE_DIR="$(mktemp -d)" TRITON_PRINT_AUTOTUNING=1 python3 benchmarks/moe.py --impls grouped_mm,triton --configs heuristic,autotune --out "$OUT/moe.json" ;;
  trainer)
    run trainer_dense 240 python3 benchmarks/trainer.py --flavor qwen3-0.6b --impls custom,hf --out "$OUT/trainer_dense.json"
    run trainer_moe 240 python3 benchmarks/trainer.py --flavor qwen3-moe-8l --impls custom --out "$OUT/trainer_moe.json" ;;
  train_step)  # the trainer's RL step at the 0.6B shape (issue 18): compiled vs cuDNN SDPA allowed vs eager; ~2 min
    run train_step 240 python3 benchmarks/train_step.py --device cuda --shape qwen3-0.6b --tokenizer-files .whl/qwen3-tokenizer --completion-max 14 \
      --steps 8 --warmup 3 --profile-steps 1 --variants "compiled:;compiled_cudnn:sdpa_cudnn=1;eager:compile=off" --out "$OUT/train_step" ;;
  lora)
    run trainer_lora 300 python3 benchmarks/trainer.py --flavor qwen3-0.6b --impls custom,hf --lora_rank 0,16 --out "$OUT/trainer_lora.json"
    for r in 0 16; do
      run "ws_colocated_r$r" 180 torchrun --standalone --nproc-per-node 1 benchmarks/weight_sync.py --shape qwen3-0.6b --trainer-ranks 1 --lora-rank "$r" --iters 10 --out "$OUT/ws_colocated_r$r.json"
    done ;;
  env_bridge)
    # verifiers 0.3.1 and its deps from .whl/ (bash scripts/gpu_wheels.sh; carry .whl). ~2 min: model build,
    # graph capture, then 4 settings x 3 sides (direct, bridge = single-turn fast path, bridge-general) x 6 runs.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    run env_bridge 300 env PYTHONPATH=/tmp/site:$PWD python3 benchmarks/env_bridge.py --device cuda --preset qwen3-0.6b --max-tokens 32,128 --lengths fixed,varied --repeats 5 --out "$OUT/env_bridge_h200.json" ;;
  engine_warmup)  # issue 18: first-use costs of the engine (init, prefill, each decode bucket) and trainer, cold vs warm caches; <= 2.7 min
    run engine_warmup 160 python3 benchmarks/engine_warmup.py --device cuda --shape qwen3-0.6b --parts engine:custom,trainer,engine:hf \
      --worker-limit-s 60 --budget-s 150 --out "$OUT/engine_warmup/engine_warmup.json" ;;  # engine:hf last: skipped if the budget is spent
  rl_e2e)  # SFT a Qwen3-0.6B shape from scratch (real tokenizer), then RL: prime-spmd k=0/1 vs TRL, evals; <= 9 min
    # --micro-batch-tokens 16384: ours trains a step's 128 samples in one forward/backward, as TRL's side does;
    # --rollout.std_normalize: ours divides advantages by the group's reward std, as TRL's GRPO does (scale_rewards="group")
    # --budget-s cuts each phase's limit to what is left, so the script writes results.json and plots before the
    # outer timeout; one compile cache (/tmp/rl_e2e_compile_cache, empty on a fresh machine) serves every subprocess of both sides
    # Written under /tmp (its subprocess dirs hold many files; the device call returns a limited number from
    # OUTDIR): results.json is copied to OUTDIR every 5 s while it runs, then the plots and our per-step metrics.
    R=/tmp/rl_e2e_out; mkdir -p "$R" "$OUT/rl_e2e"
    (while true; do cp "$R/results.json" "$OUT/rl_e2e/" 2> /dev/null; sleep 5; done) & copier=$!
    run rl_e2e 560 python3 benchmarks/rl_e2e.py --device cuda --shape qwen3-0.6b --out "$R" --trl-python python3 \
      --tokenizer-files .whl/qwen3-tokenizer --sft-steps 100 --sft-batch 128 --sft-warmup-steps 20 --sft-limit-s 110 \
      --steps 30 --warmup 3 --prompts 16 --group-size 8 --max-tokens 20 --lr 1e-5 --micro-batch-tokens 16384 --ours-flag=--rollout.std_normalize --rl-limit-s 100 --eval-limit-s 60 --budget-s 540 \
      --compile-cache /tmp/rl_e2e_compile_cache --eval-sft-fp32
    kill "$copier" 2> /dev/null
    cp "$R/results.json" "$R"/*.png "$OUT/rl_e2e/" 2> /dev/null
    for d in "$R"/ours_k*_r0; do cp "$d/metrics.jsonl" "$OUT/rl_e2e/$(basename "$d")_metrics.jsonl" 2> /dev/null; done ;;
  sample_parity)  # after rl_e2e in the same machine session: our engine's samples vs transformers generate on its SFT model
    run sample_parity 120 python3 benchmarks/sample_parity.py --model /tmp/rl_e2e_out/sft/hf --device cuda --dtype bfloat16 \
      --max-tokens 20 --env-args alphabet 0123456789 min_chars 8 max_chars 16 --out "$OUT/sample_parity.json" ;;
  rl)
    run rl_colocated 300 python3 -m prime_spmd rl --config configs/reverse_text/rl.toml --output_dir "$OUT/rl" --model.path /tmp/rlmodel --model.init_tiny qwen3-1m --trainer.max_steps 20 --log.no_progress ;;
esac
