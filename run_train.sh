#!/usr/bin/env bash
# Train with torchrun. Environment (all optional):
#   CONFIG_FILE  TOML config            (default: train_configs/debug_model.toml)
#   NGPU         processes on this node (default: visible GPUs, else 2 CPU processes)
#   NNODES       nodes                  (default: 1 → torchrun --standalone)
#   NODE_RANK, MASTER_ADDR, MASTER_PORT rendezvous for NNODES > 1 (c10d backend)
# Extra arguments are config overrides: ./run_train.sh --training.steps 20
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh

CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "$QUADRA_PYTHON" -m engine.train --job.config_file "$CONFIG_FILE" --help
  fi
done

NNODES=${NNODES:-1}
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$QUADRA_PYTHON" -c "import torch; print(torch.cuda.device_count())")
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
# One intra-op thread per process unless told otherwise: processes share the cores.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
  export OMP_NUM_THREADS
fi

if [ "$NNODES" -eq 1 ]; then
  launch=(--standalone --nnodes=1 --nproc-per-node="$NGPU")
else
  : "${MASTER_ADDR:?MASTER_ADDR must name the rendezvous host when NNODES > 1}"
  launch=(--nnodes="$NNODES" --node-rank="${NODE_RANK:?NODE_RANK must be set when NNODES > 1}"
          --nproc-per-node="$NGPU" --rdzv-backend=c10d
          --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id="${RDZV_ID:-quadra}")
fi

# LOG_RANKS=0,1 shows only those local ranks' output (default: all; only rank 0 logs metrics).
filter=()
[ -n "${LOG_RANKS:-}" ] && filter=(--local-ranks-filter="$LOG_RANKS")
exec "$QUADRA_PYTHON" -m torch.distributed.run "${launch[@]}" "${filter[@]}" \
  -m engine.train --job.config_file "$CONFIG_FILE" "$@"
