#!/usr/bin/env bash
# The project's test command (README "Run the tests"; .ci/run calls it).
#
# Two pytest sessions, because TRITON_INTERPRET is read when @triton.jit runs,
# i.e. at import time, so the interpreter cannot be switched on mid-session:
#   1. everything not marked `interpret`: the plain-torch CPU path, the
#      planner, the reducer against torch DDP on gloo ranks, hooks, bench;
#   2. the tests marked `interpret` under TRITON_INTERPRET=1: the very Triton
#      kernel source, bit-exact against the reference, and the reducer with
#      the kernels in the loop.
# Extra arguments go to both sessions (e.g. -x, -k pattern).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
"$py" -m pytest tests -m "not interpret and not gpu" "$@"
rc1=$?
TRITON_INTERPRET=1 "$py" -m pytest tests -m "interpret" "$@"
rc2=$?
# pytest exits 5 when a session selects no test: that is a failure here too.
if [ $rc1 -ne 0 ] || [ $rc2 -ne 0 ]; then
    echo "tests/run.sh: FAILED (default session rc=$rc1, interpreter session rc=$rc2)"
    exit 1
fi
