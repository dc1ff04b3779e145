#!/usr/bin/env bash
# The project's test command (README "The two commands"; .ci/run calls it).
#
# Two pytest sessions, run side by side (FASTDDP_TESTS_SERIAL=1: one after the
# other), because TRITON_INTERPRET is read when @triton.jit runs, i.e. at
# import time, so the interpreter cannot be switched on mid-session:
#   1. everything not marked `interpret`: the plain-torch CPU path, the
#      planner, the reducer against torch DDP on gloo ranks, hooks (the
#      bench's tests: bench/tests, tools': tools/tests);
#   2. the tests marked `interpret` under TRITON_INTERPRET=1: the very Triton
#      kernel source, bit-exact against the reference, and the reducer with
#      the kernels in the loop.
# `--fast` is the fast tier (tests/conftest.py selects it): every test file's
# quick cases by their recorded time (tests/durations.json), not the tests
# marked `slow` or `rig`; under 2 minutes on 2 cores. The full command is what
# CI runs. tests/README.md maps each library module to the files that test it.
# Extra arguments go to both sessions (e.g. -x, -k pattern); TEST_PATHS (default
# tests) is what both collect (the run.sh self-tests name two small files). The last line says
# passed or FAILED with both sessions' counts and the time taken; above a
# FAILED line, every failed test's id (pytest's short summary, both sessions),
# so that `bash tests/run.sh | tail` still names what failed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
tier=""
if [ "${1:-}" = "--fast" ]; then
    tier="fast tier: "
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# pytest's output goes through tee (for the last line below): keep its colours on a terminal
color=()
[ -t 1 ] && color=(--color=yes)

# pytest's last line without colours, rules and the time: "1062 passed, 12 skipped"
counts() {
    sed -E 's/\x1b\[[0-9;]*m//g' "$1" | grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected|no tests ran)|no tests ran' | tail -n 1 |
        sed -E 's/=+//g; s/ in [0-9.]+s.*$//; s/^ +//; s/ +$//'
}

t0=$SECONDS
# the native modules (fastddp/_native.py: the readiness hooks;
# kernels/_fp8_native.py: the fp8 CPU loops): built once here (about a
# minute each on 2 cores, then cached), not inside a test's timeout
"$py" -c "import fastddp._native as n; n.main()"
"$py" -c "import fastddp.kernels._fp8_native as f; f.main()"
# The interpreter session (one process, numpy on one core) runs beside the
# default one, whose ranks leave a core idle about half the time; its output
# follows the default session's.  FASTDDP_TESTS_SERIAL=1: one after the other.
if [ "${FASTDDP_TESTS_SERIAL:-0}" = "1" ]; then
    "$py" -m pytest ${TEST_PATHS:-tests} -m "not interpret and not gpu" ${color[@]+"${color[@]}"} "$@" 2>&1 | tee "$logs/default"
    rc1=${PIPESTATUS[0]}
    TRITON_INTERPRET=1 "$py" -m pytest ${TEST_PATHS:-tests} -m "interpret" ${color[@]+"${color[@]}"} "$@" 2>&1 | tee "$logs/interpret"
    rc2=${PIPESTATUS[0]}
else
    TRITON_INTERPRET=1 "$py" -m pytest ${TEST_PATHS:-tests} -m "interpret" ${color[@]+"${color[@]}"} "$@" > "$logs/interpret" 2>&1 &
    ipid=$!
    trap 'kill $ipid 2>/dev/null; rm -rf "$logs"' EXIT
    "$py" -m pytest ${TEST_PATHS:-tests} -m "not interpret and not gpu" ${color[@]+"${color[@]}"} "$@" 2>&1 | tee "$logs/default"
    rc1=${PIPESTATUS[0]}
    wait $ipid
    rc2=$?
    trap 'rm -rf "$logs"' EXIT
    cat "$logs/interpret"
fi
took="$(( (SECONDS - t0) / 60 ))m$(( (SECONDS - t0) % 60 ))s"
what="${tier}default session: $(counts "$logs/default") (rc=$rc1); interpreter session: $(counts "$logs/interpret") (rc=$rc2); $took"
# pytest exits 5 when a session selects no test: that is a failure here too.
if [ "$rc1" -ne 0 ] || [ "$rc2" -ne 0 ]; then
    for session in default interpret; do
        sed -E 's/\x1b\[[0-9;]*m//g' "$logs/$session" | grep -E '^(FAILED|ERROR) ' | sed "s/^/tests\/run.sh: $session session: /"
    done
    echo "tests/run.sh: FAILED ($what)"
    exit 1
fi
echo "tests/run.sh: passed ($what)"
