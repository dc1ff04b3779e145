#!/usr/bin/env bash
# GPU check of the fused pack/unpack kernels, for a single-GPU machine, in
# under 8 minutes.  torch (a CUDA build, which brings triton) is expected to
# be installed already: this script never installs torch.
#
#   1. installs fastddp (editable, --no-deps) if it is not importable;
#   2. runs the tests marked `gpu` (all of tests/), then the whole kernel
#      suite tests/test_kernels.py on CUDA (without TRITON_INTERPRET every
#      kernel test runs the compiled kernels on the GPU);
#   3. runs bench/gpu_kernels.py: copy bandwidth, kernels' GB/s, launches per
#      call, host overhead, vs the torch ways; writes
#      reports/<gpu-name-slug>/kernels.md and kernels.json;
#   4. runs fastddp-bench on 1 NCCL rank (step time, launches per step,
#      wrappers side by side); writes reports/<gpu-name-slug>/<date>-gpu-1rank.*
#
# Usage: bash bench/gpu_check.sh [reports-dir]      (exit 0: all passed)
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
out_dir=${1:-reports}
unset TRITON_INTERPRET  # the compiled kernels, not the interpreter
start=$SECONDS
export PYTHONUNBUFFERED=1

"$py" - <<'PY' || { echo "gpu_check: needs torch with a visible CUDA device"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("gpu_check:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY

if ! "$py" -c "import fastddp.kernels" 2>/dev/null; then
    echo "gpu_check: installing fastddp (editable, no dependencies)"
    "$py" -m pip install -q --no-deps --no-build-isolation -e . \
        || "$py" -m pip install -q --no-deps -e . \
        || { echo "gpu_check: pip install failed"; exit 1; }
fi
"$py" -c "import fastddp.kernels as K, triton; print('gpu_check: fastddp.kernels backend on cuda:', K.backend('cuda'), '| triton', triton.__version__)" \
    || exit 1

rc=0
if "$py" -c "import pytest" 2>/dev/null; then
    timeout 180 "$py" -m pytest tests -m gpu -q -x -p no:cacheprovider || { echo "gpu_check: gpu-marked tests FAILED"; rc=1; }
    timeout 150 "$py" -m pytest tests/test_kernels.py -q -m "interpret or gpu" -p no:cacheprovider \
        || { echo "gpu_check: kernel suite on CUDA FAILED"; rc=1; }
else
    echo "gpu_check: pytest is not installed; tests skipped"
    rc=1
fi

timeout 240 "$py" bench/gpu_kernels.py --out "$out_dir" || { echo "gpu_check: gpu_kernels.py FAILED"; rc=1; }

# End to end on this GPU (1 NCCL rank: the wrappers' own work and launches;
# the collective itself is trivial at world size 1).
timeout 150 "$py" -m fastddp.bench --world 1 --models small transformer mlp25m \
    --wrappers local torch torch-batched fastddp fastddp-batched fastddp-fp16 fastddp-bf16 \
    --steps 20 --label gpu-1rank --out "$out_dir" --no-progress \
    || { echo "gpu_check: fastddp-bench FAILED"; rc=1; }

# Where the caller collects files from a folder named by $OUT, leave them there too.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$out_dir"/*/kernels.md "$out_dir"/*/kernels.json "$out_dir"/*/*gpu-1rank* "$OUT"/ 2>/dev/null || true
fi
echo "gpu_check: finished in $((SECONDS - start)) s, rc=$rc"
exit $rc
