#!/usr/bin/env bash
# Train on several machines under the monitoring service (`pretrain launch`), which starts the
# DeepSpeed launcher and restarts the job if it crashes or hangs.
#
# With ssh (pdsh reaches every host in the hostfile; run once, on the first host):
#   HOSTFILE=launch/hostfile.example launch/multi_node.sh --config CONFIG [KEY=VALUE ...]
#
# Without ssh (run on every node, each with its own NODE_RANK; MASTER_ADDR is node 0, which also
# runs the monitoring service; the run directory must be on a shared file system):
#   NO_SSH=1 NODE_RANK=0 MASTER_ADDR=10.0.0.1 HOSTFILE=hosts launch/multi_node.sh --config CONFIG ...
#   NO_SSH=1 NODE_RANK=1 MASTER_ADDR=10.0.0.1 HOSTFILE=hosts launch/multi_node.sh --config CONFIG ...
#
# Environment: HOSTFILE (required; "host slots=N" per line), MASTER_ADDR (default: the first
# host), MASTER_PORT (default 29500), NO_SSH=1 with NODE_RANK for the no-ssh mode.
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: launch/multi_node.sh --config CONFIG [KEY=VALUE ...]" >&2; exit 2; }
: "${HOSTFILE:?set HOSTFILE to a DeepSpeed hostfile (see launch/hostfile.example)}"
args=(--hostfile "$HOSTFILE" --master-port "${MASTER_PORT:-29500}")
[[ -n "${MASTER_ADDR:-}" ]] && args+=(--master-addr "$MASTER_ADDR")
if [[ "${NO_SSH:-0}" == 1 ]]; then
  args+=(--no-ssh --node-rank "${NODE_RANK:?NO_SSH=1 needs NODE_RANK}")
fi
exec python -m pretrain launch "${args[@]}" "$@"
