#!/usr/bin/env bash
# Everything to run on a lent GPU machine, as one command of at most 9 minutes (docs/gpu.md):
#
#   scripts/gpu_check.sh [--cpu] [--parts NAME,...] [--budget SECONDS] [--work DIR] [OUT]
#
# Installs what the machine lacks (DeepSpeed, omegaconf, datasets and their needs) from the wheels
# in .whl/ of this checkout (the machine has no network), then runs scripts/gpu_check.py: the GPU
# tests, `pretrain bench train` for gpt3-125m/350m/1.3b at 2048 tokens, a one-GPU `pretrain launch`
# with a spike, a kill and a resume, and profiler captures, each part in its own time budget; and
# with --parts variants, the training step's variants (issue 55's levers) against its baseline.
# JSON and logs go to OUT (default: $OUT, the device tool's folder). `--cpu` runs the same
# sequence on a CPU with the tiny config, no wheels and no kernels (the integration tier runs it).
set -uo pipefail
export GPU_CHECK_STARTED=${GPU_CHECK_STARTED:-$(date +%s)}
cd "$(dirname "$0")/.."
repo=$PWD
python=${PYTHON:-python3}

cpu=0
for arg in "$@"; do
    [ "$arg" = "--cpu" ] && cpu=1
done

if [ "$cpu" = 0 ] && ! "$python" -c "import deepspeed, omegaconf, datasets" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: DeepSpeed is not installed here and .whl/ holds no wheels: copy them first" \
            "(docs/gpu.md: cp ../shared/gpu-wheels/*.whl .whl/) and carry .whl" >&2
        exit 2
    fi
    site=/tmp/gpu_check-site
    echo "gpu_check: installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site (--no-deps: the machine's torch stays)"
    # Python's own packages (torch, transformers, ...) are kept; only what is missing comes from .whl.
    if ! "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl; then
        echo "gpu_check: installing the wheels from .whl/ failed (above)" >&2
        exit 2
    fi
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=$site/bin:$PATH
fi

# torch's extension builds (DeepSpeed's fused Adam, compiled at first use) in a folder of the check's
# own, whose stale locks it can clear after a part it stopped (scripts/gpu_check.py).
if [ "$cpu" = 0 ]; then
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/gpu_check-extensions}
fi

# The checkout itself is the package: importable without an install.
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py "$@"
