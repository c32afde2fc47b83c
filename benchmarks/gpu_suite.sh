#!/usr/bin/env bash
# The GPU runs behind the figures in docs/benchmarks.md, in parts of at most 10 minutes (one device call each).
#   bash scripts/gpu_wheels.sh          # once, on a machine with network: wheels and the Qwen3 tokenizer in .whl/
#   bash benchmarks/gpu_suite.sh PART OUTDIR [VARIANT]
# PART: tests ["kernels unit" | "gpu exact"] | engine | prefill | loss | moe | train_step | weight_sync | env_bridge
#       | rl_e2e [reverse_text | number_list] | sft_probe ["a b c" | name:steps:batch:lr:min_items:max_items]
#       | scale [small | large | lora | moe | h200 | anchor | master | anchor_master] | startup [RUNS] | fp8 [ops] | exact [train] | vlm [rl]
# Each step has its own time limit, so that one slow step does not lose the others' results.
set -uo pipefail
PART=$1; OUT=${2:-/tmp/gpu_out}; VARIANT=${3:-}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# tyro, verifiers and their dependencies from .whl/ (the GPU machine has no network); the repository on the path
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $name"; tail -n 25 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
git rev-parse --short HEAD 2> /dev/null
E06="--device cuda --model-shape qwen3-0.6b --prompt-len 128 --new-tokens 256"
case $PART in
  tests)  # docs/testing.md; its summary.txt has counts and errors. VARIANT: the test_gpu.sh steps (default
    # "kernels unit"; "gpu exact" the other half: the whole suite is longer than one device call)
    run tests_gpu 570 env STEPS="${VARIANT:-kernels unit}" bash scripts/test_gpu.sh "$OUT/tests" ;;
  engine)  # engine rows at the defaults (0.6B, 8B), transformers baselines, mismatch KL, batch-1 profile; ~9 min
    run engine 150 python3 benchmarks/engine.py $E06 --batch-sizes 1,16,64,256 --engine native --out "$OUT/engine.json"
    run engine_8b 120 python3 benchmarks/engine.py $E06 --model-shape qwen3-8b --batch-sizes 1,64 --engine native --out "$OUT/engine_8b.json"
    run engine_hf 120 python3 benchmarks/engine.py $E06 --batch-sizes 1,64 --engine hf,hf-static --out "$OUT/engine_hf.json"
    run mismatch 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --out "$OUT/mismatch.json"
    run mismatch_one_row 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --requests 1 --new-tokens 2048 --out "$OUT/mismatch_one_row.json"
    mkdir -p "$OUT/profile"
    run profile 60 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1 --out-dir "$OUT/profile" ;;
  prefill)  # prefill sharing for GRPO groups with the slot and the paged KV cache, and engine rows slot vs paged; ~5 min
    mkdir -p "$OUT/prefill"
    run prefill 150 python3 benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes "" --groups 8 --group-size 8 --group-prompt-len 1024 --group-new-tokens 16 --kv-cache slot,paged --out-dir "$OUT/prefill"
    run engine_paged 150 python3 benchmarks/engine.py $E06 --batch-sizes 1,64,256 --engine native --kv-cache slot,paged --out "$OUT/engine_paged.json" ;;
  loss)
    run loss 420 python3 benchmarks/loss_kernel.py --out "$OUT/loss_kernel.json" ;;
  moe)  # first use (fresh Triton cache, then the same cache again), then warm speed at the default launch table
    cache=$(mktemp -d)
    run moe_first_call_cold 150 env TRITON_CACHE_DIR="$cache" python3 benchmarks/moe.py --first_call --tokens 4096 --out "$OUT/moe_first_call_cold.json"
    run moe_first_call_cached 90 env TRITON_CACHE_DIR="$cache" python3 benchmarks/moe.py --first_call --tokens 4096 --out "$OUT/moe_first_call_cached.json"
    run moe 300 python3 benchmarks/moe.py --impls grouped_mm,triton --out "$OUT/moe.json" ;;
  train_step)  # the trainer's step: RL-shaped batches (compiled, cuDNN SDPA allowed, eager), then one packed 16k row, full and LoRA; ~6 min
    TS="python3 benchmarks/train_step.py --device cuda --shape qwen3-0.6b --tokenizer-files .whl/qwen3-tokenizer"
    run train_step 240 $TS --completion-max 14 --steps 8 --warmup 3 --profile-steps 1 \
      --variants "compiled:;compiled_cudnn:sdpa_cudnn=1;eager:compile=off" --out "$OUT/train_step"
    run train_step_16k 240 $TS --prompts 1 --group-size 1 --prompt-len 0 --completion-min 16384 --completion-max 16384 \
      --micro-batch-tokens 16384 --steps 5 --warmup 2 --profile-steps 0 --variants "full:;lora16:lora_rank=16" --out "$OUT/train_step_16k" ;;
  weight_sync)  # colocated on one GPU, full weights and LoRA r=16
    for r in 0 16; do
      run "ws_colocated_r$r" 180 torchrun --standalone --nproc-per-node 1 benchmarks/weight_sync.py --shape qwen3-0.6b --trainer-ranks 1 --lora-rank "$r" --iters 10 --out "$OUT/ws_colocated_r$r.json"
    done ;;
  env_bridge)  # model build, graph capture, then 4 settings x 2 sides (direct, bridge) x 6 runs; ~2 min
    run env_bridge 300 python3 benchmarks/env_bridge.py --device cuda --preset qwen3-0.6b --max-tokens 32,128 --lengths fixed,varied --repeats 5 --out "$OUT/env_bridge.json" ;;
  rl_e2e)
    if [ "${VARIANT:-reverse_text}" = number_list ]; then
      # the learning benchmark: number_list at the 0.6B shape (real tokenizer): SFT from scratch, then RL sides with
      # held-out evals every 6 steps against wall-clock time; the task counts between two 3-digit integers 50-160
      # apart (~250-800 answer tokens), up to 1000 new tokens; both sides train a completion cut at 1000 tokens on
      # reward TRUNCATED_REWARD (0; the evals report the task's reward: at 4b65079, with 50-200 items and no such
      # rule, ours learned never to stop). SIDES (ours0,ours1) picks the sides of a call, each RL_LIMIT_S (190 s):
      # a cold side spends 80-110 s before its first step (090adcf H200, 4b65079 H100). One side a call:
      # `SIDES=ours1 RL_LIMIT_S=380` (24 steps in 270 s at 090adcf) or `SIDES=trl RL_LIMIT_S=400` (7 steps: 34 s a
      # step, 61 s its first eval).
      # `SEEDS=1` for the spread. SFT: SFT_STEPS (100: held-out start 0.39-0.50 at 0c4ade1, 50-200 items) / SFT_LR /
      # SFT_MIN_ITEMS; SFT_FLAG one `sft` flag, by default --trainer.compile=off (eager: ~0.7 s a step). OURS_FLAG:
      # flags of our RL sides, space-separated, each one word (e.g. "--inference.native.warmup=on
      # --trainer.compile_warmup": every compile and capture up front). RL_STEPS (24) / BUDGET_S (the whole run's) /
      # RL_LR (5e-5). SFT_REUSE=1: RL from the SFT model an earlier call kept on this machine (below). A plan for one
      # warm machine: `SIDES=ours1 RL_LIMIT_S=380` (SFT, kept), `SFT_REUSE=1 SIDES=trl RL_LIMIT_S=540`,
      # `SFT_REUSE=1 SIDES=ours1 RL_STEPS=100 RL_LIMIT_S=560` (090adcf, H200: 33 s to the first step with a warm
      # compile cache, 4.9 s a step; 85 steps in a 470 s limit; TRL 34 s a step). 16,384-token
      # micro-batches (32,768 ran out of memory at 002d098). TORCH_LOGS=recompiles: the logs name every recompile's
      # guard. TRL_CB=1: TRL generates with transformers' continuous batching (not yet run on a GPU). importtime.log:
      # `python -X importtime` of our RL entry modules, run beside the SFT (imports took 14-21 s here at 0c4ade1).
      (python3 -X importtime -c "import prime_spmd.rl.loop, prime_spmd.inference.factory, prime_spmd.trainer.build" \
        2> "$OUT/importtime.log" > /dev/null &)
      ours_flags=(); for f in ${OURS_FLAG:-}; do ours_flags+=("--ours-flag=$f"); done
      # the SFT model is kept in SFT_KEEP after every SFT; SFT_REUSE=1 starts RL from it with no SFT (a later call on
      # the same warm machine: every side then starts from one SFT checkpoint, and a call holds ~2 min more RL)
      SFT_KEEP=${SFT_KEEP:-/tmp/learning_sft}; sft_from=()
      if [ "${SFT_REUSE:-0}" = 1 ]; then
        [ -f "$SFT_KEEP/config.json" ] || { echo "SFT_REUSE=1: no SFT model in $SFT_KEEP (run once without it)"; exit 2; }
        sft_from=(--sft-model "$SFT_KEEP")
      fi
      R=/tmp/learning_out; rm -rf "$R"; mkdir -p "$R" "$OUT/learning"
      (while true; do cp "$R/results.json" "$R"/*.log "$OUT/learning/" 2> /dev/null; sleep 5; done) & copier=$!
      run learning $(( ${BUDGET_S:-550} + 15 )) env TORCH_LOGS=recompiles python3 benchmarks/rl_e2e.py --device cuda --task number_list --shape qwen3-0.6b --out "$R" \
        --trl-python python3 ${TRL_CB:+--trl-continuous-batching} --sides "${SIDES:-ours0,ours1}" --seeds "${SEEDS:-0}" --tokenizer-files .whl/qwen3-tokenizer \
        --sft-steps "${SFT_STEPS:-100}" --sft-batch 32 --sft-lr "${SFT_LR:-1e-3}" --sft-warmup-steps 20 --sft-limit-s 150 \
        --sft-task-arg "min_items=${SFT_MIN_ITEMS:-8}" --sft-flag="${SFT_FLAG:---trainer.compile=off}" "${sft_from[@]}" \
        --steps "${RL_STEPS:-24}" --warmup 3 --prompts 16 --group-size 8 --max-tokens 1000 --lr "${RL_LR:-5e-5}" --micro-batch-tokens 16384 \
        --ours-flag=--rollout.std_normalize "${ours_flags[@]}" --eval-interval 6 --eval-examples 32 --eval-samples 2 --no-eval --truncated-reward "${TRUNCATED_REWARD:-0}" \
        --rl-limit-s "${RL_LIMIT_S:-190}" --budget-s "${BUDGET_S:-550}" --compile-cache /tmp/rl_e2e_compile_cache
      kill "$copier" 2> /dev/null
      cp "$R/results.json" "$R"/*.png "$R"/*.log "$OUT/learning/" 2> /dev/null
      for d in "$R"/ours_k*_r*; do cp "$d/metrics.jsonl" "$OUT/learning/$(basename "$d")_metrics.jsonl" 2> /dev/null; done
      if [ ${#sft_from[@]} = 0 ] && [ -f "$R/sft/hf/config.json" ]; then
        rm -rf "$SFT_KEEP"; cp -r "$R/sft/hf" "$SFT_KEEP"; echo "SFT model kept in $SFT_KEEP (SFT_REUSE=1)"
      fi
      exit 0
    fi
    # reverse_text: SFT a Qwen3-0.6B shape from scratch (real tokenizer), then RL: prime-spmd k=0/1 vs TRL, evals; <= 9 min
    # --micro-batch-tokens 16384: one forward/backward a step, as TRL's side; --rollout.std_normalize: advantages
    # divided by the group's reward std, as TRL's GRPO. --budget-s cuts each phase's limit to what is left. One
    # compile cache serves every subprocess of both sides. Written under /tmp (many files); results.json is copied to
    # OUTDIR every 5 s while it runs, then the plots and our per-step metrics.
    R=/tmp/rl_e2e_out; mkdir -p "$R" "$OUT/rl_e2e"
    (while true; do cp "$R/results.json" "$OUT/rl_e2e/" 2> /dev/null; sleep 5; done) & copier=$!
    run rl_e2e 560 python3 benchmarks/rl_e2e.py --device cuda --shape qwen3-0.6b --out "$R" --trl-python python3 \
      --tokenizer-files .whl/qwen3-tokenizer --sft-steps 100 --sft-batch 128 --sft-warmup-steps 20 --sft-limit-s 110 \
      --steps 30 --warmup 3 --prompts 16 --group-size 8 --max-tokens 20 --lr 1e-5 --micro-batch-tokens 16384 \
      --ours-flag=--rollout.std_normalize --rl-limit-s 100 --eval-limit-s 60 --budget-s 540 --compile-cache /tmp/rl_e2e_compile_cache
    kill "$copier" 2> /dev/null
    cp "$R/results.json" "$R"/*.png "$OUT/rl_e2e/" 2> /dev/null
    for d in "$R"/ours_k*_r0; do cp "$d/metrics.jsonl" "$OUT/rl_e2e/$(basename "$d")_metrics.jsonl" 2> /dev/null; done ;;
  startup)  # issue 38's start-up at the learning benchmark's settings (0.6B, number_list, 16 x 8 samples, max_async 1)
    # from a random model (--no-sft; speed_advantages: every step trains; 512 new tokens, which a random model always
    # reaches), 2 steps a run: the defaults (each decode bucket captured and each block-input kind compiled by the
    # first step that meets it) with an empty compile cache (cold), the defaults again (warm cache); eager_cold (not
    # run by default): everything up front (--inference.native.warmup=on --trainer.compile_warmup) from an empty cache
    # of its own. results.json's `startup` per run. VARIANT: the runs (default "cold warm warm_sampled", ~4 min);
    # warm_sampled is warm again with its threads' stacks sampled for its first 60 s (benchmarks/stack_sampler.py:
    # `startup.profile_to_first_step`, seconds per function before the first step; a run of its own, so the sampler
    # does not touch the warm figure). At 667582b (H100), when up front was the default: cold 73.0 s to the first step,
    # warm 27.1 s, lazy from a cold cache 32.0 s; at 8dd7cf1 (lazy default) cold 29.1 s, warm 18.0 s
    for v in ${VARIANT:-cold warm warm_sampled}; do
      flags=(); lim=190; C=/tmp/startup_cache_default
      case $v in
        cold) rm -rf "$C" ;;
        warm | warm_sampled) lim=110 ;;  # the cold run's cache
        eager_cold) C=/tmp/startup_cache_eager; rm -rf "$C"
          flags=(--ours-flag=--inference.native.warmup=on --ours-flag=--trainer.compile_warmup) ;;
      esac
      run "startup_$v" $((lim + 20)) env PRIME_BENCH_SAMPLE_S=$([ "$v" = warm_sampled ] && echo 60 || echo 0) python3 benchmarks/rl_e2e.py --device cuda --task number_list --shape qwen3-0.6b --no-sft \
        --sides ours1 --no-eval --tokenizer-files .whl/qwen3-tokenizer --steps 2 --warmup 1 --prompts 16 --group-size 8 \
        --max-tokens 512 --lr 1e-6 --micro-batch-tokens 16384 --ours-flag=--rollout.advantage \
        --ours-flag=benchmarks/speed_advantages.py:alternating "${flags[@]}" --rl-limit-s $lim --budget-s $((lim + 10)) \
        --compile-cache "$C" --out "/tmp/startup_$v"
      cp "/tmp/startup_$v/results.json" "$OUT/startup_$v.json" 2> /dev/null
      # the raw samples (warm_sampled): `python benchmarks/stack_sampler.py FILE END_S 0 FUNCTION` splits a function
      cp /tmp/startup_"$v"/ours_k1_r0/startup_stacks.json "$OUT/startup_${v}_stacks.json" 2> /dev/null
      for f in /tmp/startup_"$v"/*.log; do cp "$f" "$OUT/startup_${v}_$(basename "$f")" 2> /dev/null; done
    done ;;
  sft_probe)  # candidate SFT recipes for the learning benchmark (rl_e2e number_list), back to back at the 0.6B shape:
    # each SFTs a fresh random model from scratch (its own limit; the loss curve lands in results.json even when the
    # limit cuts it) and scores it on 16 held-out prompts x 4 samples (configs/number_list/eval.toml) of the
    # benchmark's distribution (counting 50-200 items), so one device call shows which recipe starts RL at a 0.3-0.6
    # reward. VARIANT: the candidates (default "a b c"; name:steps:batch:lr:min_items:max_items for another). a: the
    # number_list branch's recipe; b: lr 2e-3; c: short counts only (8-64 items: ~0.2 s steps, twice the steps; does
    # counting learned there hold at 200?). ~3 min a candidate (model build, SFT <= 120 s, eval). Reversal (128-480
    # words) failed all three on the H100 at 4604e6e: loss 3.16 nats, the words' entropy.
    for cand in ${VARIANT:-a b c}; do
      case $cand in
        a) cand=a:150:32:1e-3:8:200 ;;
        b) cand=b:150:32:2e-3:8:200 ;;
        c) cand=c:300:64:1e-3:8:64 ;;
      esac
      IFS=: read -r name steps batch lr lo hi <<< "$cand"
      R=/tmp/sft_probe_$name; rm -rf "$R"; mkdir -p "$R" "$OUT/sft_probe_$name"
      run "sft_probe_$name" 175 env TORCH_LOGS=recompiles python3 benchmarks/rl_e2e.py --device cuda --task number_list --shape qwen3-0.6b \
        --out "$R" --sides none --tokenizer-files .whl/qwen3-tokenizer --sft-steps "$steps" --sft-batch "$batch" \
        --sft-lr "$lr" --sft-warmup-steps 20 --sft-limit-s 120 --sft-task-arg "min_items=$lo" --sft-task-arg "max_items=$hi" \
        --max-tokens 1000 --eval-examples 16 --eval-sft-limit-s 90 --budget-s 170 \
        --compile-cache /tmp/rl_e2e_compile_cache
      cp "$R/results.json" "$R"/*.log "$OUT/sft_probe_$name/" 2> /dev/null
      cp "$R/eval_sft/summary.json" "$OUT/sft_probe_$name/eval_sft_summary.json" 2> /dev/null
    done ;;
  scale)  # colocated RL at real shapes from random bf16 weights (speed and memory; rewards mean nothing), one device call
    # a variant: small: 0.6B, 1.7B (+ the memory tests); large: 4B with offload, 4B without offload (the memory plan
    # refuses it on 80 GB); lora: 8B LoRA; moe: 30B-A3B LoRA; h200: 8B full fine-tuning with offload (a 141 GB card);
    # master: 8B full fine-tuning with the masters on the host (any card); anchor / anchor_master: 4,000-token samples.
    # 8 prompts x 8 samples, 256 new tokens a sample (a random model never stops early), 6 steps, rates from step 2;
    # random weights score 0: benchmarks/speed_advantages.py gives every group nonzero advantages, so every step runs
    # the whole backward and optimizer update
    # (TORCH_LOGS=recompiles: a recompile after step 0 shows in the run's log with its guard). The defaults compile and
    # capture nothing up front: these runs meet one row bucket and one block-input kind
    scale() {  # name, rl_e2e flags; the run's limit: SCALE_LIMIT_S (240 s unless the variant or the caller sets it)
      local name=$1 lim=${SCALE_LIMIT_S:-240}; shift
      run "$name" $((lim + 30)) env TORCH_LOGS=recompiles python3 benchmarks/rl_e2e.py --device cuda --no-sft --sides ours0 --no-eval \
        --tokenizer-files .whl/qwen3-tokenizer --steps 6 --warmup 2 --prompts 8 --group-size 8 --max-tokens 256 --lr 1e-6 \
        --rl-limit-s "$lim" --budget-s $((lim + 20)) --ours-flag=--rollout.advantage \
        --ours-flag=benchmarks/speed_advantages.py:alternating --out "/tmp/$name" "$@"
      cp "/tmp/$name/results.json" "$OUT/$name.json" 2> /dev/null
      for d in /tmp/"$name"/ours_k*_r0; do cp "$d/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2> /dev/null; done
      for f in /tmp/"$name"/*.log; do cp "$f" "$OUT/${name}_$(basename "$f")" 2> /dev/null; done; rm -rf "/tmp/$name"; }
    # the anchor's workload (anchor, anchor_master): 4 prompts x 8 samples of 4,000 new tokens, max_async 1
    anchor=(--shape qwen3-8b --sides ours1 --prompts 4 --max-tokens 4000 --micro-batch-tokens 8192
            --ours-flag=--trainer.activation_checkpointing --ours-flag=--inference.native.release_kv_cache)
    master_tests() {  # the CUDA tests of --trainer.offload master (the optimizer, the weight sharing, a CUDA RL run);
      # SCALE_TESTS=0: none (they passed at 759f10e, 85 s)
      [ "${SCALE_TESTS:-1}" = 0 ] || run tests_master 150 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" \
        -m "gpu or not gpu" tests/unit/test_offload_optimizer.py tests/unit/test_shared_weights.py \
        tests/gpu/test_offload_gpu.py -k "master or trained_in_place"; }
    case "${VARIANT:-small}" in
      small)
        run tests_memory 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/gpu/test_offload_gpu.py \
          tests/unit/test_offload_optimizer.py tests/unit/test_memory_plan.py tests/unit/test_shared_weights.py \
          tests/unit/test_native_engine.py -k "offload or plan or shared or released or memory"
        scale scale_0.6b --shape qwen3-0.6b --micro-batch-tokens 8192
        scale scale_1.7b --shape qwen3-1.7b --micro-batch-tokens 8192 ;;
      large)  # ~5 min on an H100 (667582b: the 4B run's 6 steps in 210 s, 4.8 s a steady step, then the refusal)
        SCALE_LIMIT_S=${SCALE_LIMIT_S:-400}
        # SCALE_TESTS=0: no CUDA tests first (a call short of device time)
        [ "${SCALE_TESTS:-1}" = 0 ] || run tests_one_rank 90 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" -m gpu \
          tests/gpu/test_one_rank_reduce_gpu.py tests/gpu/test_offload_gpu.py -k "one_rank or registered"
        # 2,048-token micro-batches: the plan (one rank: compute weights + the gradient reduce) says 63.6 GiB (measured
        # 58.7 at 667582b), 77.7 at 4,096 (over an H100's 72.8 usable)
        b4=(--shape qwen3-4b --micro-batch-tokens 2048 --ours-flag=--trainer.offload --ours-flag=optimizer)
        scale scale_4b_offload "${b4[@]}"
        # out of memory with the allocator's default segments (our phase error, or torch's own outside a phase): the same
        # run once more with expandable segments (our error names the bytes reserved but free: prime_spmd/memory.py
        # fragmentation_hint)
        if grep -qsE "out of device memory|CUDA out of memory|OutOfMemoryError" "$OUT"/scale_4b_offload*.log; then
          PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True SCALE_LIMIT_S=${SCALE_RETRY_S:-240} scale scale_4b_offload_expandable "${b4[@]}"
        fi
        SCALE_LIMIT_S=30 scale scale_4b_no_offload --shape qwen3-4b --micro-batch-tokens 4096 ;;
      lora)  # 8B LoRA r=16 alone (667582b, H100: 6 steps in 206 s, step 0 99 s, 4.7 s a steady step)
        SCALE_LIMIT_S=${SCALE_LIMIT_S:-540}
        scale scale_8b_lora --shape qwen3-8b --micro-batch-tokens 4096 --ours-flag=--model.lora.rank --ours-flag=16 ;;
      moe)  # weights drawn at load (--model.random_init: 61 GB of bf16 fit no disk twice; 92 s on the H100 at 8dd7cf1,
        # whose 6 steps then ran in 177 s: 27 s a step generating eagerly); activation checkpointing: the plan says
        # ~81 GiB without it (of 72.8 usable), 66.3 GiB with it (67.8 measured at 8dd7cf1); the experts backward computes
        # no gradients for the frozen expert weights (kernels/moe/op.py), so it has no per-layer transient to add.
        # First the CUDA test of the engine's MoE decode graphs (SCALE_TESTS=0: none)
        [ "${SCALE_TESTS:-1}" = 0 ] || run tests_moe_graphs 90 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" -m gpu \
          tests/gpu/test_moe_engine_graphs_gpu.py
        SCALE_LIMIT_S=${SCALE_LIMIT_S:-480}
        scale scale_30b_a3b_lora --shape qwen3-30b-a3b --random-init --micro-batch-tokens 4096 --ours-flag=--model.lora.rank \
          --ours-flag=16 --ours-flag=--trainer.activation_checkpointing ;;
      h200)
        if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
          echo "scale h200: 8B full fine-tuning needs a 141 GB card (the memory plan would refuse it here)"; exit 2
        fi
        SCALE_LIMIT_S=${SCALE_LIMIT_S:-480}
        run tests_one_rank 90 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_one_rank_reduce_gpu.py
        # 2,048-token micro-batches: plan 113.5 GiB (131.4 at 4,096, which the plan now refuses: it ran out of memory at 090adcf before the
        # one-rank reduce buffer; 21 GiB of the H200 were cached but free then)
        scale scale_8b_offload --shape qwen3-8b --micro-batch-tokens 2048 --ours-flag=--trainer.offload --ours-flag=optimizer ;;
      anchor)  # beside NeMo-RL's anchor (2,478 trained tokens/s per H100, Llama-3.1-8B full fine-tuning, 4k sequences,
        # 1-step off-policy): Qwen3-8B full fine-tuning, 4 prompts x 8 samples of 4,000 new tokens (~4.1k sequences),
        # max_async 1, the optimizer offloaded, activation checkpointing, the KV cache released while the trainer
        # steps. The plan says 107.3 GiB (a 141 GB card); ~55 s a step expected on an H200 (not yet run)
        if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
          echo "scale anchor: 8B full fine-tuning needs a 141 GB card (the memory plan would refuse it here)"; exit 2
        fi
        SCALE_LIMIT_S=${SCALE_LIMIT_S:-480}
        scale scale_8b_anchor "${anchor[@]}" --steps 5 --ours-flag=--trainer.offload --ours-flag=optimizer ;;
      master)  # 8B full fine-tuning with --trainer.offload master at the other rows' settings (weights drawn at load),
        # after the CUDA tests of the path (master_tests); ~5 min
        master_tests
        SCALE_LIMIT_S=${SCALE_LIMIT_S:-300}
        scale scale_8b_master --shape qwen3-8b --random-init --micro-batch-tokens 4096 --ours-flag=--trainer.offload \
          --ours-flag=master ;;
      anchor_master)  # the anchor's run with --trainer.offload master (fp32 masters and moments in host memory, the
        # engine reads the trainer's bf16 weights in place): plan 57.2 GiB, so one H100 holds it; first master_tests.
        # 4 steps, rates from step 1: ~75 s a step expected on an H100 (generation ~45 s, train ~25 s), so a 10-minute
        # call holds `SCALE_TESTS=0 SCALE_LIMIT_S=500`
        master_tests
        SCALE_LIMIT_S=${SCALE_LIMIT_S:-480}
        scale scale_8b_anchor_master "${anchor[@]}" --steps 4 --warmup 1 --ours-flag=--trainer.offload --ours-flag=master ;;
      *) echo "scale: unknown variant ${VARIANT} (small, large, lora, moe, h200, anchor, master, anchor_master)" >&2; exit 2 ;;
    esac ;;
  fp8)  # --inference.quantization fp8 beside bf16 (0.6B, 8B; batch 1, 64; decode steps past the FP8 GEMV on the Triton
    # tile kernel and on torch._scaled_mm: --fp8-tile-rows), the quantize time, mismatch KL, the FP8 KV cache (8B), CUDA
    # tests; ~10 min. VARIANT ops: benchmarks/fp8_linear.py, each linear alone on every FP8 path (GEMV config grid at one
    # row, tile kernel, _scaled_mm, _scaled_mm swapped) beside bf16, 8B and 0.6B; ~5 min. VARIANT tests: the CUDA
    # tests alone (109 s warm at 4b65079; the cold first try ran past 120 s)
    FP8_TESTS="tests/gpu/test_fp8_real_shapes.py tests/kernels/test_fp8.py tests/unit/test_fp8_engine.py tests/unit/test_fp8_kv_cache.py tests/kernels/test_decode_attention_fp8.py"
    if [ "$VARIANT" = tests ]; then
      run tests_fp8 240 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" $FP8_TESTS
      exit 0
    fi
    if [ "$VARIANT" = ops ]; then
      run fp8_linear_8b 240 python3 benchmarks/fp8_linear.py --model-shape qwen3-8b --rows 1,16,64 --gemv --out "$OUT/fp8_linear_8b.json"
      run fp8_linear_06b 180 python3 benchmarks/fp8_linear.py --model-shape qwen3-0.6b --rows 1,16,64 --gemv --out "$OUT/fp8_linear_06b.json"
      exit 0
    fi
    F="python3 benchmarks/engine.py $E06 --engine native --batch-sizes 1,64 --quantization none,fp8 --fp8-tile-rows triton,scaled_mm"
    run fp8_engine 180 $F --out "$OUT/fp8_engine.json"
    run fp8_engine_8b 210 $F --model-shape qwen3-8b --out "$OUT/fp8_engine_8b.json"
    run fp8_kv_engine_8b 150 python3 benchmarks/engine.py $E06 --engine native --batch-sizes 1,64 --model-shape qwen3-8b --kv-cache-dtype auto,fp8 --out "$OUT/fp8_kv_engine_8b.json"
    for q in none fp8; do
      run "mismatch_$q" 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --quantization "$q" --out "$OUT/mismatch_$q.json"
    done
    run tests_fp8 240 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" $FP8_TESTS ;;
  exact)  # --model.exact: bit-exactness on CUDA first, then its cost (engine tokens/s, trainer step) and mismatch KL; ~6 min
    train_exact() { run train_step_exact 150 python3 benchmarks/train_step.py --device cuda --shape qwen3-0.6b \
      --tokenizer-files .whl/qwen3-tokenizer --variants "${EXACT_VARIANTS:-default:;exact:exact=1}" --out "$OUT/train_step_exact"; }
    # the trainer step alone (default beside exact), ~2 min; EXACT_VARIANTS="exact:exact=1": exact only (its stacks)
    if [ "${VARIANT:-}" = train ]; then train_exact; exit 0; fi
    run tests_exact 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_exact_mode_gpu.py
    run engine_exact 120 python3 benchmarks/engine.py $E06 --batch-sizes 1,64 --engine native-custom --exact off,on --out "$OUT/engine_exact.json"
    train_exact
    run mismatch_exact 60 python3 benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --exact --out "$OUT/mismatch_exact.json" ;;
  vlm)  # Qwen3-VL 2B shape, random weights: engine prefill / decode tokens/s with one 448x448 image a prompt beside
    # text-only, the encoder's ms a prompt, a bare trainer step's time and memory, then 6 RL steps (prime_spmd rl,
    # visual env, 448x448 images, colocated): time split, memory, mismatch KL; ~6 min. vlm.json holds the engine's
    # numbers before the RL run starts.
    # First the CUDA test of the VL fast decode (graphs, slot and paged, against the trainer); last the eager decode
    # (--no-cuda-graphs) beside it, engine rows only, if the call has time left (~9 min in all).
    # VARIANT rl: only the RL steps (one engine row with one image before them; ~4 min)
    if [ "$VARIANT" = rl ]; then
      run vlm_rl 300 python3 benchmarks/vlm.py --device cuda --shape qwen3-vl-2b --images 1 --rl-steps 6 --rl-limit-s 240 \
        --tokenizer-files .whl/qwen3-tokenizer --out "$OUT/vlm_rl.json"
      exit 0
    fi
    run tests_vlm 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_vlm_gpu.py
    run vlm 420 python3 benchmarks/vlm.py --device cuda --shape qwen3-vl-2b --images 0,1 --train \
      --rl-steps 6 --rl-limit-s 210 --tokenizer-files .whl/qwen3-tokenizer --out "$OUT/vlm.json"
    run vlm_eager 90 python3 benchmarks/vlm.py --device cuda --shape qwen3-vl-2b --images 0,1 --no-cuda-graphs \
      --tokenizer-files .whl/qwen3-tokenizer --out "$OUT/vlm_eager.json" ;;
  *) echo "unknown part $PART (see the header)" >&2; exit 2 ;;
esac
