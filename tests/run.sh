#!/usr/bin/env bash
# The project's test command (README "The two commands"; .ci/run calls it).
#
# Two pytest sessions, because TRITON_INTERPRET is read when @triton.jit runs,
# i.e. at import time, so the interpreter cannot be switched on mid-session:
#   1. everything not marked `interpret`: the plain-torch CPU path, the
#      planner, the reducer against torch DDP on gloo ranks, hooks (the
#      bench's tests: bench/tests, tools': tools/tests);
#   2. the tests marked `interpret` under TRITON_INTERPRET=1: the very Triton
#      kernel source, bit-exact against the reference, and the reducer with
#      the kernels in the loop.
# They run side by side, the default one as two pytest processes (whole test
# files dealt by recorded time, then claimed as each process gets to them:
# tests/conftest.py, FASTDDP_TESTS_SHARD, FASTDDP_TESTS_CLAIMS): its
# subprocess-heavy tests (torchrun, clients, builds) leave a core idle (on 2
# cores: 5m30s-5m55s, against 6m29s with the default session whole beside
# the interpreter one); the shards' and the interpreter's output follow.
# FASTDDP_TESTS_SERIAL=1: one session after the other, the default one whole
# (what --record-durations wants: times taken without a neighbour).
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

# one session's counts from its shards' logs: summed, except "deselected"
# (what -m/-k left out, the same in every shard), in pytest's order
counts_of() {
    for f in "$@"; do counts "$f"; echo; done | awk -F', ' '
        { for (i = 1; i <= NF; i++) if (split($i, w, " ") == 2 && w[1] ~ /^[0-9]+$/) {
              k = w[2]; sub(/s$/, "", k); if (k == "warning" || k == "error") k = k "s"
              if (k == "deselected") { if (w[1] > n[k]) n[k] = w[1] } else n[k] += w[1] } }
        END { out = ""
              split("failed passed skipped deselected xfailed xpassed warnings errors", order, " ")
              for (j = 1; j <= 8; j++) { k = order[j]; if (n[k] == "") continue
                  name = k; if (n[k] == 1 && (k == "warnings" || k == "errors")) sub(/s$/, "", name)
                  out = out (out == "" ? "" : ", ") n[k] " " name }
              if (n["failed"] + n["passed"] + n["skipped"] + n["errors"] + n["xfailed"] + n["xpassed"] == 0)
                  out = "no tests ran" (out == "" ? "" : ", " out)
              print out }'
}

# a session's status from its shards': a shard that selected nothing (5) is
# fine beside one that ran tests; 5 only where none did
rc_of() {
    local rc=5 r
    for r in "$@"; do
        if [ "$r" -ne 0 ] && [ "$r" -ne 5 ]; then echo "$r"; return; fi
        [ "$r" -eq 0 ] && rc=0
    done
    echo "$rc"
}

t0=$SECONDS
# Bytecode caches are written even where the environment turns them off
# (PYTHONDONTWRITEBYTECODE): without them each of the sessions, and each
# pytest and script run inside a test, compiles the repository's sources again
# and rewrites every test module's asserts (pytest caches that rewrite as
# bytecode), ~3 s of a core per pytest session. They go to __pycache__/,
# which git ignores.
unset PYTHONDONTWRITEBYTECODE
# the native modules (fastddp/_native.py: the readiness hooks;
# kernels/_fp8_native.py: the fp8 CPU loops): built once here (about a
# minute each on 2 cores, then cached), not inside a test's timeout; one
# interpreter for both (an interpreter with torch costs ~2 s of a core).
# FASTDDP_TESTS_NATIVE_READY: set below for what runs inside, so that run.sh
# run by a test (the run.sh self-tests) does not load them again
if [ "${FASTDDP_TESTS_NATIVE_READY:-0}" != "1" ]; then
    "$py" -c "import fastddp._native as n, fastddp.kernels._fp8_native as f; n.main(); f.main()"
    export FASTDDP_TESTS_NATIVE_READY=1
fi
default=(-m "not interpret and not gpu")
unset FASTDDP_TESTS_SHARD FASTDDP_TESTS_CLAIMS  # (run.sh run by a test inside a shard: its own sessions are whole)
if [ "${FASTDDP_TESTS_SERIAL:-0}" = "1" ]; then
    "$py" -m pytest ${TEST_PATHS:-tests} "${default[@]}" ${color[@]+"${color[@]}"} "$@" 2>&1 | tee "$logs/default"
    rc1=${PIPESTATUS[0]}
    TRITON_INTERPRET=1 "$py" -m pytest ${TEST_PATHS:-tests} -m "interpret" ${color[@]+"${color[@]}"} "$@" 2>&1 | tee "$logs/interpret"
    rc2=${PIPESTATUS[0]}
    default_logs=("$logs/default")
else
    TRITON_INTERPRET=1 "$py" -m pytest ${TEST_PATHS:-tests} -m "interpret" ${color[@]+"${color[@]}"} "$@" > "$logs/interpret" 2>&1 &
    ipid=$!
    claims="$logs/claims"  # the shards take whole files as they get to them (tests/conftest.py)
    mkdir -p "$claims"
    FASTDDP_TESTS_CLAIMS="$claims" FASTDDP_TESTS_SHARD=1/2 "$py" -m pytest ${TEST_PATHS:-tests} "${default[@]}" ${color[@]+"${color[@]}"} "$@" > "$logs/default-1" 2>&1 &
    spid=$!
    trap 'kill $ipid $spid 2>/dev/null; rm -rf "$logs"' EXIT
    FASTDDP_TESTS_CLAIMS="$claims" FASTDDP_TESTS_SHARD=0/2 "$py" -m pytest ${TEST_PATHS:-tests} "${default[@]}" ${color[@]+"${color[@]}"} "$@" 2>&1 | tee "$logs/default-0"
    r0=${PIPESTATUS[0]}
    wait $spid
    r1=$?
    wait $ipid
    rc2=$?
    trap 'rm -rf "$logs"' EXIT
    cat "$logs/default-1" "$logs/interpret"
    rc1=$(rc_of "$r0" "$r1")
    default_logs=("$logs/default-0" "$logs/default-1")
fi
took="$(( (SECONDS - t0) / 60 ))m$(( (SECONDS - t0) % 60 ))s"
what="${tier}default session: $(counts_of "${default_logs[@]}") (rc=$rc1); interpreter session: $(counts_of "$logs/interpret") (rc=$rc2); $took"
# pytest exits 5 when a session selects no test: that is a failure here too.
if [ "$rc1" -ne 0 ] || [ "$rc2" -ne 0 ]; then
    for log in "${default_logs[@]}" "$logs/interpret"; do
        session=default
        [ "$log" = "$logs/interpret" ] && session=interpret
        sed -E 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^(FAILED|ERROR) ' | sed "s/^/tests\/run.sh: $session session: /"
    done
    echo "tests/run.sh: FAILED ($what)"
    exit 1
fi
echo "tests/run.sh: passed ($what)"
