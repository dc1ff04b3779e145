"""Parity with torch's DDP with the Triton kernels in the reducer's loop.

The same checks as tests/test_parity.py (bit for bit at W=2, every backward),
run in the interpreter session (tests/run.sh sets TRITON_INTERPRET=1): the
reducer's pack/unpack are then the very Triton kernel source that runs
compiled on CUDA, not the plain-torch twin.
"""

from __future__ import annotations

import pytest

from tests._dist import STAND_IN, world2  # noqa: F401
from tests.test_parity import CASES_W2, parity_run

pytestmark = [pytest.mark.interpret, pytest.mark.timeout(600),
              pytest.mark.skipif(STAND_IN, reason="fastddp's kernels")]

CASES = ["default_deep", "tiny_buckets", "bucket_view_zero", "batched_tiny", "static_graph_tiny",
         "find_unused_per_rank", "no_sync_deep_tiny", "tied_tiny_batched", "mixed_dtype_tiny_batched",
         "view_batched"]


def _case(rank, world_size, name):
    import fastddp.kernels as K

    assert K.backend("cpu") == "interpret", K.backend("cpu")
    model, kwargs, run_kwargs = CASES_W2[name]
    K.reset_launch_count()
    checks = parity_run(rank, world_size, model, kwargs, **run_kwargs)
    return checks, K.launch_count(), K.stats()["reference_calls"]


@pytest.mark.parametrize("case", CASES)
def test_parity_w2_triton_in_the_loop(world2, case):
    for checks, launches, ref_calls in world2.run(_case, case):
        assert checks > 0
        assert launches > 0  # the Triton kernels really ran


def _health_interpret(rank, world_size, path):
    import fastddp.kernels as K
    from tests.test_health import _health_body

    assert K.backend("cpu") == "interpret", K.backend("cpu")
    K.reset_launch_count()
    events = _health_body(rank, world_size, path, "fc2.weight", "raise")
    return events, K.launch_count()


@pytest.mark.parametrize("path", ["default", "fused_fp16", "error_feedback"])
def test_health_flag_from_the_triton_pack(world2, path):
    """check_finite with the interpreted kernels setting the flag in the pack launch."""
    for rank, (events, launches) in enumerate(world2.run(_health_interpret, path)):
        assert launches > 0
        assert [e[0] for e in events] == ["ok", "ok", "raised", "ok"], (rank, events)
        msg = events[2][1]
        assert ("'fc2.weight'" in msg) if rank == 1 else ("because of rank(s) [1]" in msg), msg
