#!/usr/bin/env bash
# Train on one machine: every local GPU, or NPROC CPU processes when there is no GPU.
#
#   launch/single_node.sh --config CONFIG [KEY=VALUE ...]
#   NPROC=2 launch/single_node.sh --config configs/train/tiny.yaml data.dir=runs/data train.steps=100
#
# Environment: NPROC (default: the GPU count, else 2), MASTER_PORT (default 29500).
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: launch/single_node.sh --config CONFIG [KEY=VALUE ...]" >&2; exit 2; }
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
exec deepspeed --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29500}" \
  --module pretrain.train "$@"
