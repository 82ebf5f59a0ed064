#!/usr/bin/env bash
# Train with torchrun. Environment (all optional):
#   CONFIG_FILE  TOML config            (default: train_configs/debug_model.toml)
#   NGPU         processes on this node (default: visible GPUs, else 2 CPU processes)
#   NNODES       nodes                  (default: 1 → torchrun --standalone; MIN:MAX: an elastic range on the
#                c10d rendezvous at MASTER_ADDR:MASTER_PORT, RDZV_ID, RDZV_CONF; the group shrinks to the nodes left)
#   MAX_RESTARTS restarts after a failed rank, each from the newest verified checkpoint (default: 0)
#   NODE_RANK, MASTER_ADDR, MASTER_PORT rendezvous for NNODES > 1 (static: node NODE_RANK holds
#                ranks NODE_RANK*NGPU .. NODE_RANK*NGPU+NGPU-1)
#   LOG_RANKS    local ranks whose output is shown, e.g. 0 (default: all)
# Extra arguments are config overrides: ./run_train.sh --training.steps 20
# The launcher (engine/launch/launcher.py) checks the config against NGPU × NNODES before any rank starts,
# prints one line per failure, and turns SIGTERM / SIGUSR1 / a first Ctrl-C, sent to this script, its
# process group or the ranks, into a checkpoint and exit 0 (a second Ctrl-C stops at once).
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
exec "$QUADRA_PYTHON" -m engine.launch --job.config_file "$CONFIG_FILE" "$@"
