#!/usr/bin/env bash
# Train on one machine under the monitoring service (`pretrain launch`): every local GPU, or NPROC
# CPU processes when there is no GPU. The service restarts the job if it crashes or hangs.
#
#   launch/single_node.sh --config CONFIG [KEY=VALUE ...]
#   NPROC=2 launch/single_node.sh --config configs/train/tiny.yaml data.dir=runs/data train.steps=100
#
# Environment: NPROC (default: the GPU count, else 2), MASTER_PORT (default: a free port).
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: launch/single_node.sh --config CONFIG [KEY=VALUE ...]" >&2; exit 2; }
args=()
[[ -n "${NPROC:-}" ]] && args+=(--nproc "$NPROC")
[[ -n "${MASTER_PORT:-}" ]] && args+=(--master-port "$MASTER_PORT")
exec python -m pretrain launch "${args[@]}" "$@"
