#!/usr/bin/env bash
# Run Lightning's own DDP strategy tests with torch's DDP class replaced by
# fastddp's (at torch.nn.parallel and where torch defines it), in every
# interpreter the tests start (spawned and popen'd ranks too: sitecustomize).
#
#   bash tests/run_lightning_ddp_tests.sh LIGHTNING_CHECKOUT [fastddp|torch] [pytest args...]
#
# LIGHTNING_CHECKOUT: a checkout of github.com/Lightning-AI/pytorch-lightning
# at the tag of the installed Lightning (its tests are not in the wheel).
# "torch" runs the same tests unswapped, for the side-by-side count.
# PYTHON selects the interpreter (default: python).
set -euo pipefail
if [[ $# -lt 1 || ! -d "$1/tests/tests_pytorch/strategies" ]]; then
    echo "usage: $0 LIGHTNING_CHECKOUT [fastddp|torch] [pytest args...]" >&2
    echo "  (LIGHTNING_CHECKOUT/tests/tests_pytorch/strategies must exist)" >&2
    exit 2
fi
src=$(cd "$1" && pwd); shift
impl=${1:-fastddp}; [[ $# -gt 0 ]] && shift
case "$impl" in fastddp|torch) ;; *) echo "impl must be fastddp or torch, got '$impl'" >&2; exit 2;; esac
py=${PYTHON:-python}
repo=$(cd "$(dirname "$0")/.." && pwd)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if [[ "$impl" == fastddp ]]; then
    cat > "$site/sitecustomize.py" <<'PY'
import torch
import torch.nn.parallel.distributed
import fastddp
torch.nn.parallel.DistributedDataParallel = fastddp.DistributedDataParallel
torch.nn.parallel.distributed.DistributedDataParallel = fastddp.DistributedDataParallel
PY
fi
cd "$src/tests"
export PYTHONPATH="$site:$repo:$src/tests${PYTHONPATH:+:$PYTHONPATH}"
# Say which class the tests will build (a sitecustomize elsewhere would win silently).
"$py" -c "import torch.nn.parallel.distributed as d, lightning.pytorch.strategies.ddp as s
c = d.DistributedDataParallel; print('DDP class in the tests:', c.__module__ + '.' + c.__qualname__)
assert s.DistributedDataParallel is c and (c.__module__.startswith('fastddp') == ('$impl' == 'fastddp')), c"
"$py" -m pytest tests_pytorch/strategies/test_ddp*.py -p no:cacheprovider -q "$@"
