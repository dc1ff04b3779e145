#!/usr/bin/env bash
# The GPU check, for a short window on a single-GPU machine: ONE command,
# bounded by the sum of its stage budgets (printed at the start; under 8
# minutes on the GPU), every result in one folder.  torch (a CUDA build,
# which brings triton) must be installed; this script installs only fastddp.
#
#   bash bench/gpu_check.sh              # on the GPU machine
#   bash bench/gpu_check.sh --dry-run    # the same stages on a CPU machine, < 3 minutes typical
#   bash bench/gpu_check.sh [--dry-run] --budget   # print the budget line and exit
#
# PYTHON   the interpreter (default: python3)
# OUT      the results folder (default: reports/<gpu-slug>/; --dry-run: a new temp dir)
# KSHARDS  parallel pytest processes for the kernel suite (default 4; --dry-run 1)
# INSTALL  auto (default: pip -e when fastddp is not importable at all; the shim
#          when pip fails or another checkout's fastddp is installed) | shim
# STAGES   the stages to run after env (default: kernels reducer kernels-bw bench),
#          e.g. STAGES="reducer bench" to redo two in a second window
#
# Stages, in order of value, each under `timeout` (GPU budgets sum to 425 s),
# none stopping the next (no -x: a failed stage is reported and the rest
# still run).  Each stage must end by the sum of its budget and those before
# it, so a stage may use what earlier stages left unused and the whole script
# never runs past the sum:
#
#   stage       GPU budget  GPU                                 --dry-run (CPU twin; budget)
#   1 env          60 s     a C compiler and Python.h (Triton   the same (90 s)
#                           needs them at its first launch),
#                           versions, nvidia-smi (compute
#                           mode), tools; fastddp installed:
#                           pip -e --no-build-isolation
#                           --no-deps, else a symlink shim
#   2 kernels     105 s     tests/test_kernels{,_layout,_health} test_kernels.py alone under
#                           .py, test_lowprec_kernels.py        TRITON_INTERPRET=1 (150 s)
#                           -m "interpret or gpu": the
#                           suite compiled for the GPU + the
#                           gpu-marked tests, KSHARDS parallel
#                           pytest processes, 60 s per test,
#                           without native code (FASTDDP_NATIVE
#                           =0: these tests need none, so none
#                           waits for the build)
#   3 reducer     100 s     tests/test_gpu_reducer.py and       4 world-2 cases on gloo CPU, the
#                           test_gpu_cuda_path.py: NCCL
#                           world 1; world 2 on ONE GPU (gloo,  interpreted kernels in the loop
#                           CUDA tensors) vs torch DDP; slow    (FASTDDP_GPU_TESTS_ON_CPU=1; 120 s)
#                           comm stream; 150 s per test
#   4 kernels-bw   60 s     bench/gpu_kernels.py: GB/s vs the   --cpu-smoke: a tiny bucket,
#                           measured copy bandwidth (stops      interpreter (60 s)
#                           new cases 20 s before the budget);
#                           + fp8 quantize/dequantize and the
#                           fp8 / bf16 shard sums, bit-exact
#   5 bench        85 s     fastddp-bench --world 1 (NCCL):     --models tiny at world 1 (every
#                           small transformer mlp25m, 15        wrapper) and world 2 (5), on CPU
#                           steps, every fastddp row beside     (120 s)
#                           its torch row, + torch's FSDP2
#                           replicate (fp32, bf16 reduce),
#                           fastddp's bf16-fp32acc and fp8 rows
#                           (torch-batched: a
#                           labelled stand-in on torch 2.11)
#   summary        15 s     summary.md                          the same (15 s)
#
# The native readiness hooks build in the background (their own process
# group: stopping the builder stops its compiler too, and a build lock it
# leaves is removed) for the reducer and bench stages.  The fp8 CPU loops
# (FASTDDP_FP8_NATIVE) stay off: every stage here reduces CUDA tensors or
# the interpreter's, which never reach them.
# A GPU in Exclusive_Process compute mode takes one process at a time: the
# kernel suite runs as one shard and the two-ranks-on-one-GPU tests are
# skipped (the terminal says so).
#
# Files written into the folder (8, each capped at 15 MiB):
#   summary.md      stage table (status, seconds, budget) + the headline numbers
#   env.txt         stage 1: versions, GPU, tools, how fastddp was installed
#   tests.log       stages 2 + 3: pytest output
#   kernels.md, kernels.json   stage 4
#   bench.md, bench.json       stage 5 (world 1)
#   gpu_check.log   everything, in order
# The terminal shows one line per stage and ends with the summary.
# Exit status: 0 all stages ok; 1 a stage failed or timed out; 2 no CUDA
# device, no C compiler or Python.h (without --dry-run) or fastddp could not
# be installed.
set -uo pipefail
CALLER_DIR=$(pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
py=${PYTHON:-python3}
DRY=0
BUDGET_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --budget) BUDGET_ONLY=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "usage: bash bench/gpu_check.sh [--dry-run] [--budget]" >&2; exit 2 ;;
    esac
done
export PYTHONUNBUFFERED=1
export COLUMNS=${COLUMNS:-200}  # pytest: room for the reason on each FAILED line
unset TRITON_INTERPRET FASTDDP_GPU_TESTS_ON_CPU  # each stage says what it wants
export FASTDDP_FP8_NATIVE=${FASTDDP_FP8_NATIVE:-0}  # CPU-tensor loops: no stage here reaches them
START=$SECONDS
if [ "$DRY" = 1 ]; then
    # Generous: a CPU machine shared with other jobs must not turn slowness
    # into a failure (typical: about 2-3 minutes in all on 2 cores).
    KSHARDS=${KSHARDS:-1}
    B_ENV=90; B_KERN=150; B_RED=120; B_KBW=60; B_BENCH=120; B_SUM=15
else
    KSHARDS=${KSHARDS:-4}
    B_ENV=60; B_KERN=105; B_RED=100; B_KBW=60; B_BENCH=85; B_SUM=15
fi
# Each stage's deadline, in seconds from the start: the sum of its budget and
# those before it.  The script ends by TOTAL.
D_ENV=$B_ENV; D_KERN=$((D_ENV + B_KERN)); D_RED=$((D_KERN + B_RED)); D_KBW=$((D_RED + B_KBW))
D_BENCH=$((D_KBW + B_BENCH)); TOTAL=$((D_BENCH + B_SUM))
budget_line="budget ${TOTAL} s in all (env $B_ENV + kernels $B_KERN + reducer $B_RED + kernels-bw $B_KBW + bench $B_BENCH + summary $B_SUM)"
if [ "$BUDGET_ONLY" = 1 ]; then echo "[gpu_check] $budget_line"; exit 0; fi
left() { echo $(( $1 - (SECONDS - START) )); }  # seconds until deadline $1
work=$(mktemp -d "${TMPDIR:-/tmp}/fastddp-gpu-check.XXXXXX")
SHIM=()
NATIVE_PID=""
cleanup() {
    declare -F stop_native >/dev/null && stop_native
    for l in "${SHIM[@]}"; do [ -L "$l" ] && rm -f "$l"; done
    rm -rf "$work"
}
trap cleanup EXIT
CAP=$((15 * 1024 * 1024))
STAGES=" ${STAGES:-kernels reducer kernels-bw bench} "
wanted() { [[ "$STAGES" == *" $1 "* ]]; }

say() { echo "[gpu_check] $*"; }
say "$budget_line: done by $(date -u -d "@$(( $(date +%s) + TOTAL ))" +%H:%M:%S 2>/dev/null || echo "+${TOTAL} s") UTC"

# Results go to $OUT, else (dry run) a temp dir, else reports/<gpu-slug>/ once
# stage 1 knows the GPU; until then the files live in $work.
if [ -n "${OUT:-}" ]; then
    case "$OUT" in /*) dest=$OUT ;; *) dest=$CALLER_DIR/$OUT ;; esac
elif [ "$DRY" = 1 ]; then
    dest=$(mktemp -d "${TMPDIR:-/tmp}/fastddp-gpu-check-out.XXXXXX")
else
    dest=""
fi
stage_dir=${dest:-$work/out}
mkdir -p "$stage_dir"
LOG=$stage_dir/gpu_check.log
: > "$LOG"

NAMES=(); STATUS=(); SECS=(); BUDGETS=(); DETAIL=()
record() { NAMES+=("$1"); STATUS+=("$2"); SECS+=("$3"); BUDGETS+=("$4"); DETAIL+=("$5"); }

# run_stage NAME DEADLINE STAGE_LOG CMD...: the command under `timeout` until
# DEADLINE (seconds from the start: the sum of this stage's budget and those
# before it, so a stage may use what earlier stages left unused and the whole
# script never runs past the sum of the budgets), its output appended to
# STAGE_LOG (if not "-") and the combined log.  No time left: not started,
# recorded as a TIMEOUT.
run_stage() {
    local name=$1 budget slog=$3; budget=$(left "$2"); shift 3
    local t0=$SECONDS tmp="$work/$name.out" rc
    printf '\n===== [%s] %s  budget %ss: %s\n' "$name" "$(date -u +%H:%M:%S)" "$budget" "$*" >> "$LOG"
    [ "$slog" != "-" ] && printf '\n===== [%s] %s\n' "$name" "$*" >> "$slog"
    if [ "$budget" -ge 5 ]; then
        timeout -k 5 "$budget" "$@" > "$tmp" 2>&1
        rc=$?
    else
        echo "gpu_check: no time left for this stage (${budget} s before its deadline)" > "$tmp"
        rc=124
    fi
    cat "$tmp" >> "$LOG"
    [ "$slog" != "-" ] && cat "$tmp" >> "$slog"
    STAGE_RC=$rc
    STAGE_SECS=$((SECONDS - t0))
    STAGE_BUDGET=$budget
    printf '===== [%s] rc=%s after %ss\n' "$name" "$rc" "$STAGE_SECS" >> "$LOG"
}

status_of() {  # rc -> status word
    case "$1" in
        0) echo ok ;;
        124|137) echo TIMEOUT ;;
        5) echo "NO-TESTS" ;;
        *) echo "FAILED($1)" ;;
    esac
}

have_pytest_timeout() { grep -q "^pytest_timeout [0-9]" "$dest/env.txt"; }

# ---------------------------------------------------------------- 1 env
# One interpreter start prints the versions and tries fastddp from THIS
# checkout (probe.* lines are read back below); pip or the shim only when
# that import fails, then the probe runs once more.
env_probe() {
    (cd "$REPO" && timeout -k 5 60 "$py" - <<'PY'
import importlib, os, platform, sys
from importlib import metadata
import torch
import torch.distributed as dist
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | "
      f"cuda available {cuda} | devices {torch.cuda.device_count()}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
          f"{p.multi_processor_count} SMs")
    try:
        print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
    except Exception as e:  # noqa: BLE001
        print("nccl: n/a", e)
print(f"distributed: nccl {dist.is_nccl_available()}, gloo {dist.is_gloo_available()}")
for name, dist_name in (("triton", "triton"), ("numpy", "numpy"), ("pytest", "pytest"),
                        ("pytest_timeout", "pytest-timeout"), ("hypothesis", "hypothesis"),
                        ("matplotlib", "matplotlib"), ("tqdm", "tqdm"), ("setuptools", "setuptools")):
    try:
        importlib.import_module(name)
        print(f"{name} {metadata.version(dist_name)}")
    except Exception as e:  # noqa: BLE001
        print(f"{name}: NOT importable ({type(e).__name__}: {e})")
try:
    import triton; tv = triton.__version__
except Exception:  # noqa: BLE001
    tv = "n/a"
print(f"probe.cuda={int(cuda)}")
print(f"probe.gpu={torch.cuda.get_device_name(0) if cuda else ''}")
print(f"probe.versions=torch {torch.__version__} | triton {tv} | CUDA {torch.version.cuda} | "
      f"python {platform.python_version()}")
repo = os.path.realpath(os.getcwd()) + os.sep
try:
    import fastddp, fastddp.kernels as K, fastddp.bench.runner  # noqa: F401
    where = {m.__name__: os.path.realpath(m.__file__) for m in (fastddp, K, fastddp.bench)}
    bad = [f"{n} from {f}" for n, f in where.items() if not f.startswith(repo)]
    if bad:
        print(f"probe.import=not this checkout: {'; '.join(bad)}")
    else:
        print(f"fastddp {fastddp.__version__} from {where['fastddp']}; fastddp.kernels from {where['fastddp.kernels']}")
        print(f"fastddp.kernels backend: cpu {K.backend('cpu')}, cuda {K.backend('cuda')}")
        print("probe.import=ok")
except Exception as e:  # noqa: BLE001
    print(f"probe.import={type(e).__name__}: {e}")
PY
    )
}

# Triton compiles a small C launcher at its first launch: with the compiler
# it picks ($CC, else gcc, else clang) and this interpreter's Python.h.
# One line (probe.toolchain=ok or what is missing); the native hooks' C++
# compiler beside it (without one: the Python hooks).
toolchain_check() {
    timeout -k 2 20 "$py" - <<'PY' 2>&1 || echo "probe.toolchain=the check itself failed ($py)"
import os, shutil, sysconfig
cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
inc = sysconfig.get_paths(scheme=sysconfig.get_default_scheme())["include"]
header = os.path.join(inc, "Python.h")
cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
missing = ([] if cc else ["no C compiler ($CC, gcc or clang)"]) + \
          ([] if os.path.isfile(header) else [f"no Python.h in {inc} (the python3-dev package)"])
print(f"toolchain: C compiler {cc or 'MISSING'}, Python.h {header if os.path.isfile(header) else 'MISSING'}, "
      f"C++ compiler {cxx or 'MISSING (native hooks off: the Python hooks)'}")
print("probe.toolchain=" + ("ok" if not missing else "; ".join(missing)))
PY
}

stage_env() {
    toolchain_check
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')  host: $(hostname)  mode: $([ "$DRY" = 1 ] && echo dry-run || echo gpu)"
    echo "repo: $REPO  git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo n/a)"
    echo "python: $(command -v "$py") ($("$py" -V 2>&1))"
    if command -v nvidia-smi >/dev/null; then
        timeout -k 2 15 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,compute_mode \
            --format=csv 2>&1 || echo "nvidia-smi: no answer in 15 s"
        echo "probe.compute_mode=$(timeout -k 2 15 nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)"
    else
        echo "nvidia-smi: not found"
    fi
    for t in ncu compute-sanitizer nsys nvcc; do echo "$t: $(command -v $t || echo not found)"; done
    local out how=""
    out=$(env_probe 2>&1)
    echo "$out"
    if [ "${INSTALL:-auto}" != shim ] && echo "$out" | grep -qx 'probe.import=ok'; then
        how="already importable from this checkout"
    else
        if echo "$out" | grep -q '^probe.import=not this checkout'; then
            # Another checkout's fastddp is installed in this interpreter:
            # leave that install alone; the shim below takes precedence.
            echo "fastddp is installed from another checkout: not re-pointing it with pip"
        elif [ "${INSTALL:-auto}" != shim ]; then
            echo "pip install --no-build-isolation --no-deps -e . :"
            timeout -k 5 90 "$py" -m pip install -q --no-build-isolation --no-deps --no-index \
                --disable-pip-version-check -e "$REPO" 2>&1 | tail -20
            out=$(env_probe 2>&1)
            if echo "$out" | grep -qx 'probe.import=ok'; then
                how="pip install --no-build-isolation --no-deps -e ."
            fi
        fi
        if [ -z "$how" ]; then
            # fastddp.kernels / fastddp.bench are the top-level kernels/ and
            # bench/ folders (setuptools package-dir): symlinks inside fastddp/
            # give a plain `import` from the repository root the same layout.
            echo "no usable install: symlink shim"
            for sub in kernels bench; do
                if [ ! -e "$REPO/fastddp/$sub" ]; then
                    ln -s "../$sub" "$REPO/fastddp/$sub" && echo "shim: fastddp/$sub -> ../$sub"
                fi
            done
            out=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" env_probe 2>&1)
            if echo "$out" | grep -qx 'probe.import=ok'; then
                how="symlink shim (fastddp/kernels, fastddp/bench -> ../kernels, ../bench) + PYTHONPATH=$REPO"
            fi
        fi
        echo "$out" | grep -v '^probe\.\(cuda\|gpu\|versions\)=' | grep -E '^(fastddp|probe.import)'
    fi
    if [ -z "$how" ]; then
        echo "install: FAILED (neither pip nor the shim gives an importable fastddp; probe above)"
        return 3
    fi
    echo "install: $how"
}

env_out=$work/env.txt
printf '\n===== [env] %s\n' "$(date -u +%H:%M:%S)" >> "$LOG"
t0=$SECONDS
# under its budget like every stage (a hung driver, nvidia-smi or pip cannot
# stall the window): in a child shell that timeout can stop
export REPO py DRY
export -f toolchain_check env_probe stage_env
timeout -k 5 "$(left $D_ENV)" bash -c stage_env > "$env_out" 2>&1
env_rc=$?
[ $env_rc -eq 124 ] || [ $env_rc -eq 137 ] && echo "env: TIMEOUT after $((SECONDS - t0)) s" >> "$env_out"
# The shim's links, if made, are removed on exit; PYTHONPATH for scripts run
# from bench/ and for spawned ranks.
for pair in kernels bench; do [ -L "$REPO/fastddp/$pair" ] && SHIM+=("$REPO/fastddp/$pair"); done
[ ${#SHIM[@]} -gt 0 ] && export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
probe() { grep "^probe\.$1=" "$env_out" | tail -1 | cut -d= -f2-; }
cuda=$(probe cuda); cuda=${cuda:-0}
gpu_name=$(probe gpu)
versions=$(probe versions)
if [ -z "$dest" ]; then
    slug=$(echo "${gpu_name:-unknown-gpu}" | tr 'A-Z' 'a-z' | sed -E 's/\((r|tm|c)\)//g; s/[^a-z0-9]+/-/g; s/^-+|-+$//g')
    dest=$REPO/reports/${slug:-unknown-gpu}
    mkdir -p "$dest"
    cat "$LOG" > "$dest/gpu_check.log"
    LOG=$dest/gpu_check.log
fi
cp "$env_out" "$dest/env.txt"
cat "$env_out" >> "$LOG"
install_line=$(grep '^install: ' "$env_out" | tail -1 | cut -c10-)
env_detail="${gpu_name:-no GPU}; ${install_line:-install failed}"
if [ $env_rc -ne 0 ]; then
    record env "FAILED($env_rc)" $((SECONDS - t0)) $B_ENV "$env_detail"
elif [ "$DRY" = 0 ] && [ "$cuda" != 1 ]; then
    record env "NO-CUDA" $((SECONDS - t0)) $B_ENV "torch.cuda.is_available() is False"
else
    record env ok $((SECONDS - t0)) $B_ENV "$env_detail"
fi
toolchain=$(probe toolchain)
if [ "$toolchain" = ok ]; then
    say "toolchain: ok ($(grep '^toolchain: ' "$env_out" | tail -1 | cut -c12-))"
elif [ "$DRY" = 1 ]; then
    say "toolchain: ${toolchain:-not checked} (the interpreter needs none; a GPU run would stop here)"
else
    say "toolchain: ${toolchain:-not checked}: Triton cannot build its launcher, every GPU stage would fail; install them and rerun"
fi
compute_mode=$(probe compute_mode)
EXCLUSIVE=0
if [ "$DRY" = 0 ] && [ "$compute_mode" = Exclusive_Process ]; then
    EXCLUSIVE=1
    KSHARDS=1
    say "GPU in Exclusive_Process compute mode: one process at a time, so the kernel suite runs as 1 shard and the two-ranks-on-one-GPU tests are skipped"
fi
say "1/5 env        ${STATUS[0]}  $((SECONDS - t0)) s  | ${gpu_name:-no GPU} | $versions"
say "             install: ${install_line:-FAILED}"

TESTS_LOG=$dest/tests.log
: > "$TESTS_LOG"
skip_rest=""
[ $env_rc -ne 0 ] && skip_rest="fastddp is not importable (env.txt)"
[ "$DRY" = 0 ] && [ "$toolchain" != ok ] && [ -z "$skip_rest" ] &&
    skip_rest="${toolchain:-toolchain not checked}: Triton needs a C compiler and Python.h (env.txt)"
[ "$DRY" = 0 ] && [ "$cuda" != 1 ] && skip_rest="no CUDA device (run with --dry-run on a CPU machine)"

PT=(-q -rfE --tb=short --durations=5 -p no:cacheprovider)
PT_KERN=("${PT[@]}"); PT_RED=("${PT[@]}")
if have_pytest_timeout; then PT_KERN+=(--timeout=60); PT_RED+=(--timeout=150); fi

# The native readiness hooks (fastddp/_native.py): built in the background
# while the kernel stage runs (about a minute on one core; cached after), so
# the reducer and bench stages measure them.  Not ready when those start (no
# compiler, a slow build): they run on the Python hooks, and the log says so.
# The builder leads its own process group (setsid), so stopping it stops its
# ninja and compiler too; a build lock it made and left is removed, so the
# next run (a later STAGES list) does not wait on it.
NATIVE_T0=0
if [ -z "$skip_rest" ] && [ "${FASTDDP_NATIVE:-1}" != 0 ]; then
    NATIVE_T0=$(date +%s)
    setsid=(); command -v setsid >/dev/null && setsid=(setsid)
    (cd "$REPO" && exec ${setsid[@]+"${setsid[@]}"} "$py" -c "import fastddp._native as n; n.main()") \
        > "$work/native.out" 2>&1 &
    NATIVE_PID=$!
fi
stop_native() {  # the builder's process group: TERM (it releases torch's lock), then KILL
    [ -n "$NATIVE_PID" ] || return 0
    local t=0 d
    kill -TERM -- "-$NATIVE_PID" 2>/dev/null || kill -TERM "$NATIVE_PID" 2>/dev/null
    while kill -0 "$NATIVE_PID" 2>/dev/null && [ $t -lt 10 ]; do sleep 0.5; t=$((t + 1)); done
    kill -KILL -- "-$NATIVE_PID" 2>/dev/null || kill -KILL "$NATIVE_PID" 2>/dev/null
    wait "$NATIVE_PID" 2>/dev/null
    NATIVE_PID=""
    sed -n 's/^fastddp native build folder: //p' "$work/native.out" 2>/dev/null | while IFS= read -r d; do
        if [ -e "$d/lock" ] && [ "$(stat -c %Y "$d/lock" 2>/dev/null || echo 0)" -ge "$NATIVE_T0" ]; then
            rm -f "$d/lock" && say "removed the build lock the stopped builder left: $d/lock"
        fi
    done
}
native_ready() {  # wait up to $1 s for the build; else run on the Python hooks
    [ -n "$NATIVE_PID" ] || return 0
    local t=0 wait=$1
    while kill -0 "$NATIVE_PID" 2>/dev/null && [ $t -lt "$wait" ]; do sleep 1; t=$((t + 1)); done
    if kill -0 "$NATIVE_PID" 2>/dev/null; then
        stop_native; export FASTDDP_NATIVE=0
        say "native readiness hooks: still building after the wait; stopped, Python hooks from here"
    else
        wait "$NATIVE_PID" 2>/dev/null
        NATIVE_PID=""
        local said
        said=$(grep -E '^fastddp native readiness' "$work/native.out" | tail -1)
        say "${said:-native readiness hooks: the build failed (see the log); Python hooks from here}"
        grep -q "hooks: ready" "$work/native.out" || export FASTDDP_NATIVE=0
    fi
    cat "$work/native.out" >> "$LOG"
}

# ---------------------------------------------------------------- 2 kernels
if [ -n "$skip_rest" ]; then
    record kernels skipped 0 $B_KERN "$skip_rest"
elif ! wanted kernels; then
    record kernels skipped 0 $B_KERN "not in STAGES"
else
    # on the GPU every kernel file; the CPU twin keeps to the main suite (CI
    # runs the rest under the interpreter anyway)
    kfiles=(tests/test_kernels.py)
    if [ "$DRY" = 1 ]; then export TRITON_INTERPRET=1; else kfiles+=(tests/test_kernels_layout.py tests/test_kernels_health.py tests/test_lowprec_kernels.py); fi
    # no native code here (its tests need none): no shard waits for the build
    FASTDDP_NATIVE=0 run_stage kernels $D_KERN "$TESTS_LOG" \
        "$py" tools/pytest_shards.py --shards "$KSHARDS" --logdir "$work/kernels-shards" -- \
        "${kfiles[@]}" -m "interpret or gpu" "${PT_KERN[@]}"
    for f in "$work"/kernels-shards/shard-*.log; do
        [ -f "$f" ] || continue
        printf '\n----- %s\n' "$(basename "$f")" | tee -a "$TESTS_LOG" >> "$LOG"
        cat "$f" | tee -a "$TESTS_LOG" >> "$LOG"
    done
    unset TRITON_INTERPRET
    record kernels "$(status_of $STAGE_RC)" $STAGE_SECS $STAGE_BUDGET \
        "$(grep -E '^===== .* shards\) =====|^pytest_shards: shard' "$work/kernels.out" | tail -1 | sed 's/=//g; s/^ *//')"
fi
say "2/5 kernels    ${STATUS[-1]}  ${SECS[-1]} s / ${BUDGETS[-1]} s  | ${DETAIL[-1]}"

# ---------------------------------------------------------------- 3 reducer
# at most 30 s, and never more than leaves the reducer tests 60 s
nwait=$(( $(left $D_RED) - 60 )); [ $nwait -gt 30 ] && nwait=30; [ $nwait -lt 0 ] && nwait=0
native_ready $nwait
if [ -n "$skip_rest" ]; then
    record reducer skipped 0 $B_RED "$skip_rest"
elif ! wanted reducer; then
    record reducer skipped 0 $B_RED "not in STAGES"
else
    if [ "$DRY" = 1 ]; then
        # CPU twin: the world-2 bodies on gloo CPU with the interpreted kernels
        # in the loop (a subset: the interpreter costs ~1 ms per program).
        sel=(tests/test_gpu_reducer.py::test_w2_one_device_grads_equal_torch_ddp\[{default,batched,view,fp16}\])
        TRITON_INTERPRET=1 FASTDDP_GPU_TESTS_ON_CPU=1 \
            run_stage reducer $D_RED "$TESTS_LOG" "$py" -m pytest "${sel[@]}" "${PT_RED[@]}"
    else
        # Exclusive_Process: the world-2-on-one-GPU tests cannot open a second context
        only_one=(); [ "$EXCLUSIVE" = 1 ] && only_one=(-k "not w2_one_device")
        run_stage reducer $D_RED "$TESTS_LOG" "$py" -m pytest tests/test_gpu_reducer.py \
            tests/test_gpu_cuda_path.py -m gpu ${only_one[@]+"${only_one[@]}"} "${PT_RED[@]}"
    fi
    record reducer "$(status_of $STAGE_RC)" $STAGE_SECS $STAGE_BUDGET \
        "$(timeout -k 2 10 "$py" tools/check_summary.py pytest "$work/reducer.out" | head -1 | sed 's/^ *//')$([ "$EXCLUSIVE" = 1 ] && echo '; two-ranks-on-one-GPU tests skipped (Exclusive_Process)')"
fi
say "3/5 reducer    ${STATUS[-1]}  ${SECS[-1]} s / ${BUDGETS[-1]} s  | ${DETAIL[-1]}"

# ---------------------------------------------------------------- 4 kernels-bw
if [ -n "$skip_rest" ]; then
    record kernels-bw skipped 0 $B_KBW "$skip_rest"
elif ! wanted kernels-bw; then
    record kernels-bw skipped 0 $B_KBW "not in STAGES"
else
    if [ "$DRY" = 1 ]; then
        TRITON_INTERPRET=1 run_stage kernels-bw $D_KBW - \
            "$py" bench/gpu_kernels.py --cpu-smoke --dest "$dest" --time-budget $(( $(left $D_KBW) - 20 ))
    else
        run_stage kernels-bw $D_KBW - "$py" bench/gpu_kernels.py --dest "$dest" --time-budget $(( $(left $D_KBW) - 20 ))
    fi
    record kernels-bw "$(status_of $STAGE_RC)" $STAGE_SECS $STAGE_BUDGET \
        "$(grep -o 'copy bandwidth .*' "$work/kernels-bw.out" | head -1)"
fi
say "4/5 kernels-bw ${STATUS[-1]}  ${SECS[-1]} s / ${BUDGETS[-1]} s  | ${DETAIL[-1]}"

# ---------------------------------------------------------------- 5 bench
WRAPPERS=(local torch torch-batched torch-view torch-fp16 torch-bf16
          fastddp fastddp-batched fastddp-view fastddp-fp16 fastddp-bf16 fastddp-bf16acc fastddp-fp8
          replicate replicate-bf16)
copy_bench() {  # the newest report under $1 -> $dest/bench.md/json
    local md js
    md=$(ls -t "$1"/*/*.md 2>/dev/null | head -1)
    js=$(ls -t "$1"/*/*.json 2>/dev/null | head -1)
    [ -n "$md" ] && cp "$md" "$dest/bench.md"
    [ -n "$js" ] && cp "$js" "$dest/bench.json"
}
if [ -n "$skip_rest" ]; then
    record bench skipped 0 $B_BENCH "$skip_rest"
elif ! wanted bench; then
    record bench skipped 0 $B_BENCH "not in STAGES"
else
    if [ "$DRY" = 1 ]; then
        # CPU twin: the tiny model at world 1 (what the GPU run does) and 2 (gloo), interpreter in the loop.
        t_b=$SECONDS; b0=$(left $D_BENCH)
        TRITON_INTERPRET=1 run_stage bench-w1 $((D_KBW + B_BENCH / 2)) - "$py" -m fastddp.bench --world 1 --cpu \
            --models tiny --wrappers "${WRAPPERS[@]}" --steps 2 --warmup 1 --label dry-run-1rank \
            --out "$work/bench1" --no-progress --no-charts
        rc1=$STAGE_RC
        copy_bench "$work/bench1"
        TRITON_INTERPRET=1 run_stage bench-w2 $D_BENCH - "$py" -m fastddp.bench --world 2 --cpu \
            --models tiny --wrappers local torch fastddp torch-fp16 fastddp-fp16 replicate \
            --steps 2 --warmup 1 --label dry-run-2rank --out "$work/bench2" --no-progress --no-charts
        rc2=$STAGE_RC
        STAGE_RC=$(( rc1 != 0 ? rc1 : rc2 )); STAGE_SECS=$((SECONDS - t_b)); STAGE_BUDGET=$b0
        detail="world 1 rc=$rc1, world 2 rc=$rc2"
    else
        run_stage bench $D_BENCH - "$py" -m fastddp.bench --world 1 --models small transformer mlp25m \
            --wrappers "${WRAPPERS[@]}" --steps 15 --warmup 3 --label gpu-1rank --out "$work/bench" --no-progress \
            --no-charts
        copy_bench "$work/bench"
        detail="world 1 (NCCL), 3 models, ${#WRAPPERS[@]} wrappers, 15 steps"
    fi
    record bench "$(status_of $STAGE_RC)" $STAGE_SECS $STAGE_BUDGET "$detail"
fi
say "5/5 bench      ${STATUS[-1]}  ${SECS[-1]} s / ${BUDGETS[-1]} s  | ${DETAIL[-1]}"

# ---------------------------------------------------------------- summary
summ() {  # tools/check_summary.py, within what is left of the whole budget
    local t; t=$(left $TOTAL); [ "$t" -lt 1 ] && t=1
    timeout -k 1 "$t" "$py" tools/check_summary.py "$@"
}
rc=0
for i in "${!STATUS[@]}"; do
    [ "${STATUS[$i]}" = ok ] || [ "${DETAIL[$i]}" = "not in STAGES" ] || rc=1
done
[ -n "$skip_rest" ] && rc=2
total=$((SECONDS - START))
{
    echo "# gpu_check $([ "$DRY" = 1 ] && echo '--dry-run (CPU twin; no GPU figures)') on ${gpu_name:-$(uname -n)}"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC') | $versions | git $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo n/a)"
    echo
    echo '```'
    printf '%-11s %-11s %6s %7s  %s\n' stage status time budget detail
    for i in "${!NAMES[@]}"; do
        printf '%-11s %-11s %5ss %6ss  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${BUDGETS[$i]}" "${DETAIL[$i]}"
    done
    echo "total ${total} s of ${TOTAL} s, exit ${rc}"
    echo
    for part in kernels reducer; do
        if [ -f "$work/$part.out" ]; then
            echo "$part tests:"
            if [ "$part" = kernels ]; then
                cat "$work"/kernels-shards/shard-*.log 2>/dev/null > "$work/kernels-all.log"
                summ pytest "$work/kernels-all.log" | grep -v ' in [0-9.]*s' 
                grep -E '^===== .* =====$' "$work/kernels.out" | sed 's/^/  /'
            else
                summ pytest "$work/$part.out"
            fi
        fi
    done
    if [ -f "$dest/kernels.json" ]; then echo "kernels:"; summ kernels "$dest/kernels.json" | sed 's/^/  /'; fi
    if [ -f "$dest/bench.json" ]; then echo "bench:"; summ bench "$dest/bench.json" | sed 's/^/  /'; fi
    if [ "$DRY" = 1 ] && [ -f "$(ls -t "$work"/bench2/*/*.json 2>/dev/null | head -1)" ]; then
        echo "bench, world 2:"; summ bench "$(ls -t "$work"/bench2/*/*.json | head -1)" | sed 's/^/  /'
    fi
    echo '```'
    echo
    echo "Files: $(cd "$dest" && ls | tr '\n' ' ')"
} > "$dest/summary.md" 2>&1

# Keep every file under the transfer limit (head and tail of anything larger).
for f in "$dest"/*; do
    [ -f "$f" ] || continue
    size=$(stat -c %s "$f")
    if [ "$size" -gt "$CAP" ]; then
        { head -c $((CAP / 3)) "$f"; printf '\n\n[... %s bytes cut by gpu_check.sh ...]\n\n' "$((size - CAP + 4096))"; \
          tail -c $((CAP * 2 / 3 - 4096)) "$f"; } > "$work/cap" && mv "$work/cap" "$f"
    fi
done
cat "$dest/summary.md" >> "$LOG"
echo
sed -n '/^```$/,/^```$/p' "$dest/summary.md" | sed '1d;$d'
echo "results: $dest/ ($(ls "$dest" | wc -l) files; summary.md first)"
exit $rc
