#!/bin/bash
# prime-spmd on several machines without a scheduler: run this once on every node (ssh, pdsh, a
# Kubernetes pod); the agents meet through c10d rendezvous on HEAD_ADDR.
#
#   NNODES=2 HEAD_ADDR=node0 bash launch/torchrun_multinode.sh configs/reverse_text/rl.toml --trainer.max_steps 100
#
# Parameters (environment):
#   NNODES               number of nodes (required)
#   HEAD_ADDR            host (name or IP) of the node that hosts the rendezvous store (required);
#                        the agent that runs there hosts it
#   GPUS_PER_NODE        ranks per node = torchrun --nproc-per-node (default 8)
#   INFERENCE_NODES      nodes that run inference engines, the last in rendezvous order (default 1; 0 = colocated)
#   NUM_INFERENCE_RANKS  overrides INFERENCE_NODES * GPUS_PER_NODE (e.g. 2 of 8 ranks on one node)
#   SUBCOMMAND           rl (default), sft or eval
#   RDZV_PORT            rendezvous port (default 29500); RDZV_ID: job id shared by all nodes (default prime-spmd)
#   DRY_RUN=1            print the torchrun command and exit
# Arguments: the config TOML, then any prime_spmd flags (they override the config).
#
# c10d rendezvous orders nodes by host name (then agent pid), not by any --node-rank, so the nodes
# whose names sort first train. When a rank dies its agent exits non-zero (--max-restarts 0); the
# others follow through connection errors, --topology.timeout_s, or the loss of the head's store.
set -euo pipefail

CONFIG=${1:?usage: NNODES=N HEAD_ADDR=HOST bash launch/torchrun_multinode.sh CONFIG.toml [prime_spmd flags...]}
shift
NNODES=${NNODES:?set NNODES (number of nodes)}
HEAD_ADDR=${HEAD_ADDR:?set HEAD_ADDR (host of the rendezvous)}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
INFERENCE_NODES=${INFERENCE_NODES:-1}
NUM_INFERENCE_RANKS=${NUM_INFERENCE_RANKS:-$((INFERENCE_NODES * GPUS_PER_NODE))}
SUBCOMMAND=${SUBCOMMAND:-rl}

# NVLink multicast (NVLS) off: it reserves memory and fails on some fabrics and partitioned GPUs.
export NCCL_NVLS_ENABLE=0
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

CMD=(
    torchrun
    --nnodes "$NNODES"
    --nproc-per-node "$GPUS_PER_NODE"
    --rdzv-backend c10d
    --rdzv-endpoint "$HEAD_ADDR:${RDZV_PORT:-29500}"
    --rdzv-id "${RDZV_ID:-prime-spmd}"
    --max-restarts 0
    -m prime_spmd "$SUBCOMMAND"
    --config "$CONFIG"
    --topology.num_inference_ranks "$NUM_INFERENCE_RANKS"
    "$@"
)
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
exec "${CMD[@]}"
