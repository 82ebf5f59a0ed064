#!/usr/bin/env bash
# Train with torchrun. Environment (all optional):
#   CONFIG_FILE  TOML config            (default: train_configs/debug_model.toml)
#   NGPU         processes on this node (default: visible GPUs, else 2 CPU processes)
#   NNODES       nodes                  (default: 1 → torchrun --standalone)
#   NODE_RANK, MASTER_ADDR, MASTER_PORT rendezvous for NNODES > 1 (c10d backend)
# Extra arguments are config overrides: ./run_train.sh --training.steps 20
# SIGTERM or SIGUSR1 to this script (kill, SLURM preemption) is passed to the training ranks, which
# finish the current step, save a checkpoint and exit 0; the script then exits 0 too.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh

CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "$QUADRA_PYTHON" -m engine.train --job.config_file "$CONFIG_FILE" --help
  fi
done
if [ ! -f "$CONFIG_FILE" ]; then
  echo "config error: CONFIG_FILE=$CONFIG_FILE does not exist; point CONFIG_FILE at a TOML file (see train_configs/)" >&2
  exit 2
fi
# Reject a bad config once, in about a second, before any rank starts (exit status 2).
"$QUADRA_PYTHON" -m engine.check_config --job.config_file "$CONFIG_FILE" "$@" || exit $?

NNODES=${NNODES:-1}
if [ -z "${NGPU:-}" ]; then
  NGPU=0
  # Importing torch costs seconds: ask it for the GPU count only where a GPU driver is present.
  if command -v nvidia-smi >/dev/null 2>&1; then
    NGPU=$("$QUADRA_PYTHON" -c "import torch; print(torch.cuda.device_count())")
  fi
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
# torchrun turns a signal it receives into a failure of the whole job: it re-sends it to the ranks
# and exits 1 with a traceback. So signals sent to this script go straight to the ranks (torchrun's
# children) instead, and torchrun exits 0 when they do. Signals that reach torchrun itself (a signal
# to the whole process group) still get the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to save.
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}
"$QUADRA_PYTHON" -m torch.distributed.run "${launch[@]}" "${filter[@]}" \
  -m engine.train --job.config_file "$CONFIG_FILE" "$@" &
launcher=$!
forward() { pkill "-$1" -P "$launcher" 2>/dev/null || kill "-$1" "$launcher" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
set +e
while :; do
  wait "$launcher"; status=$?
  kill -0 "$launcher" 2>/dev/null || break   # wait also returns when a trapped signal arrives
done
exit "$status"
