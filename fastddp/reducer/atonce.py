"""The two iterations whose buckets are issued all at once, at the end of
backward, instead of each as it completes: static_graph's first backward
(the unused parameters are learnt from it, then every bucket is reduced)
and debug mode's (every rank checks that the ranks agree on which
parameters are ready before any bucket is issued).  Functions of the
reducer, which calls them."""

from __future__ import annotations

__all__ = ["delay_all_reduce", "debug_check"]


def delay_all_reduce(r) -> None:
    """static_graph's first backward: learn the unused, reduce every bucket."""
    with r._lock:
        r.ready.learn_static_unused()
        for b in r.plans.buckets:
            r._pack(b)
            b.pending = 0
        r._launch_ready()
        r._all_buckets_issued()
        r.ready.expect_hooks = True
    r._finalize()


def debug_check(r) -> None:
    """Debug mode, queued at the first hook of a reduced backward: the ranks
    agree on the ready parameters (else a clear error), then every bucket
    (packed as it completed, not issued) is issued and reduced."""
    if not r.ready.expect_hooks or r.ready.static_first_iteration:
        return
    try:
        r.ready.check_agreement()
    except RuntimeError:
        r.abort_iteration()
        raise
    if all(b.pending == 0 for b in r.plans.buckets):
        r._launch_ready()
        r._all_buckets_issued()
        r._finalize()
