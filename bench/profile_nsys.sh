#!/usr/bin/env bash
# Profile fastddp on a GPU: Nsight Systems timeline (nsys) and Nsight Compute
# on the pack/unpack kernels (ncu).  Each pass runs when its tool is on PATH
# (a machine with ncu but no nsys still gets the kernel pass); neither: exit 2.
#
#   bash bench/profile_nsys.sh [DIR] [-- extra fastddp-bench args for the nsys pass]
#
# DIR defaults to $OUT, else /tmp/fastddp-nsys.  PYTHON defaults to python3.
# Files:  fastddp.nsys-rep + nsys-summary.txt   (nsys pass)
#         kernels.ncu-rep + ncu-summary.txt + ncu-details.txt   (ncu pass)
#
# What to look for in the timeline (docs/profiling.md):
#   NVTX  fastddp/pack[b]       one Triton launch per bucket on the comm stream
#         fastddp/allreduce[b]  the NCCL kernel, overlapping backward's kernels
#         fastddp/wait[b] + fastddp/unpack[b] at the end of backward
#         fastddp/finalize      short when communication was hidden
# In ncu-details.txt: DRAM throughput (% of peak) and duration of each
# _pack_kernel / _unpack_kernel launch; ERR_NVGPUCTRPERM means the GPU's
# performance counters are not open to this user (an admin setting).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
dir=${1:-${OUT:-/tmp/fastddp-nsys}}
shift || true
[ "${1:-}" = "--" ] && shift
mkdir -p "$dir"
have_nsys=0; have_ncu=0
command -v nsys >/dev/null && have_nsys=1
command -v ncu >/dev/null && have_ncu=1
if [ $have_nsys = 0 ] && [ $have_ncu = 0 ]; then
    echo "profile_nsys.sh: neither nsys nor ncu is on PATH (install Nsight Systems / Nsight Compute)" >&2
    exit 2
fi
export FASTDDP_NVTX=1
rc=0

if [ $have_nsys = 1 ]; then
    nsys profile -t cuda,nvtx,osrt -s none --force-overwrite true -o "$dir/fastddp" \
        "$py" -m fastddp.bench --world 1 --models small transformer --wrappers fastddp fastddp-fp16 torch \
        --steps 10 --warmup 3 --out "$dir/reports" --no-progress --no-charts "$@" || rc=1
    nsys stats --report nvtx_sum,cuda_gpu_kern_sum "$dir/fastddp.nsys-rep" > "$dir/nsys-summary.txt" 2>&1 || rc=1
    echo "timeline: $dir/fastddp.nsys-rep (open in Nsight Systems); summary: $dir/nsys-summary.txt"
else
    echo "nsys not found: timeline pass skipped (the ncu kernel pass runs)"
fi

if [ $have_ncu = 1 ]; then
    # 8 launches of the fused kernels in steady state (default, then bf16 wire),
    # every child process (the bench spawns its rank).
    ncu --target-processes all --kernel-name "regex:_pack_kernel|_unpack_kernel" --launch-skip 4 \
        --launch-count 8 --set full -o "$dir/kernels" -f \
        "$py" -m fastddp.bench --world 1 --models small --wrappers fastddp fastddp-bf16 --steps 2 --warmup 1 \
        --out "$dir/reports-ncu" --no-progress --no-charts || rc=1
    if [ -f "$dir/kernels.ncu-rep" ]; then
        ncu --import "$dir/kernels.ncu-rep" --print-summary per-kernel > "$dir/ncu-summary.txt" 2>&1 || rc=1
        ncu --import "$dir/kernels.ncu-rep" --page details > "$dir/ncu-details.txt" 2>&1 || rc=1
        echo "kernels: $dir/kernels.ncu-rep; $dir/ncu-summary.txt, $dir/ncu-details.txt"
    else
        echo "ncu wrote no report (see its output above; ERR_NVGPUCTRPERM: counters not permitted)"
        rc=1
    fi
else
    echo "ncu not found: kernel pass skipped"
fi
exit $rc
