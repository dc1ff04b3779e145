#!/usr/bin/env bash
# Profile fastddp with Nsight Systems (timeline) and Nsight Compute (kernels).
#
#   bash bench/profile_nsys.sh [OUT_DIR] [-- extra fastddp-bench args]
#
# Needs a CUDA machine with nsys (and ncu for the kernel pass) on PATH.
# What to look for in the timeline (README "Profiling"):
#   NVTX  fastddp/pack[b]       one Triton launch per bucket on the comm stream
#         fastddp/allreduce[b]  the NCCL kernel, overlapping backward's kernels
#         fastddp/wait[b] + fastddp/unpack[b] at the end of backward
#         fastddp/finalize      short when communication was hidden
set -euo pipefail
OUT=${1:-/tmp/fastddp-nsys}
shift || true
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT"
command -v nsys >/dev/null || { echo "nsys not found: install Nsight Systems" >&2; exit 2; }
export FASTDDP_NVTX=1
nsys profile -t cuda,nvtx,osrt -s none --force-overwrite true -o "$OUT/fastddp" \
    python -m fastddp.bench --models small transformer --wrappers fastddp fastddp-fp16 torch \
    --steps 10 --warmup 3 --out "$OUT/reports" --no-progress "$@"
nsys stats --report nvtx_sum,cuda_gpu_kern_sum "$OUT/fastddp.nsys-rep" | tee "$OUT/summary.txt"
if command -v ncu >/dev/null; then
    ncu --kernel-name regex:"_pack_kernel|_unpack_kernel" --launch-count 8 --set full \
        -o "$OUT/kernels" --force-overwrite \
        python -m fastddp.bench --models small --wrappers fastddp --steps 2 --warmup 1 \
        --out "$OUT/reports-ncu" --no-progress
fi
echo "timeline: $OUT/fastddp.nsys-rep (open in Nsight Systems); summary: $OUT/summary.txt"
