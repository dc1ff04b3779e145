"""Nothing lost after a caught error.

For every error the reducer raises, a rank that catches it and then runs a
well-formed iteration gets correctly averaged gradients (equal across ranks
and to the average of the local gradients, bit for bit at W=2), or the same
clear error again -- never an internal error.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._dist import fastddp_only, ddp_class, world2  # noqa: F401
from tests._models import loss_fn, make_batch, make_model

pytestmark = [pytest.mark.timeout(300), fastddp_only]


def _expected_grads(local: nn.Module, x, y, world: int) -> list[torch.Tensor]:
    """The average DDP must produce: sum over ranks of g * fp32(1/W)."""
    local.zero_grad(set_to_none=True)
    loss_fn(local(x), y).backward()
    out = []
    for p in local.parameters():
        if p.grad is None:  # the same on every rank (same graph)
            out.append(None)
            continue
        g = p.grad * (1.0 / world)
        dist.all_reduce(g)
        out.append(g)
    return out


def _good_step(ddp, m, local, rank, step, world, model="branch_always"):
    x, y = make_batch(model, rank, step)
    want = _expected_grads(local, x, y, world)
    for p in m.parameters():
        p.grad = None
    loss_fn(ddp(x), y).backward()
    got = [p.grad for p in m.parameters()]
    bad = [n for (n, _), g, w in zip(m.named_parameters(), got, want)
           if (g is None) != (w is None) or (g is not None and not torch.equal(g, w))]
    return bad


def _recover_body(rank, world_size, case):
    m = make_model("branch_always")
    local = copy.deepcopy(m)
    kwargs = {"static_graph": True} if case == "static_changed" else {}
    if case == "hook_type":
        kwargs = {}
    ddp = ddp_class()(m, **kwargs)
    if case == "hook_type":
        calls = {"n": 0}

        def hook(state, bucket):
            calls["n"] += 1
            if calls["n"] == 1:
                return bucket.buffer()  # not a Future: the reducer refuses it
            return (dist.all_reduce(bucket.buffer().div_(world_size), async_op=True)
                    .get_future().then(lambda f: f.value()[0]))
        ddp.register_comm_hook(None, hook)
    errors = []
    # the failing iteration(s)
    if case == "unfinished":
        m.schedule = "never"
        x, y = make_batch("branch_always", rank, 0)
        loss_fn(ddp(x), y).backward()            # branch gets no gradient: nothing reduced
        m.schedule = "always"
        try:
            ddp(x)                                 # torch: raises at the next forward
        except RuntimeError as e:
            errors.append(str(e))
    elif case == "static_changed":
        m.schedule = "never"
        x, y = make_batch("branch_always", rank, 0)
        loss_fn(ddp(x), y).backward()             # first iteration: branch unused
        for p in m.parameters():
            p.grad = None
        m.schedule = "always"
        try:
            loss_fn(ddp(x), y).backward()
        except RuntimeError as e:
            errors.append(str(e))
        # a static graph stays static: the well-formed iteration is the first one's graph
        m.schedule = "never"
        local.schedule = "never"
    elif case == "hook_type":
        x, y = make_batch("branch_always", rank, 0)
        try:
            loss_fn(ddp(x), y).backward()
        except TypeError as e:
            errors.append(str(e))
    for p in m.parameters():
        p.grad = None
    assert errors and "internal error" not in errors[0], errors
    results = []
    for step in range(1, 4):
        try:
            bad = _good_step(ddp, m, local, rank, step, world_size)
        except RuntimeError as e:
            results.append(("error", str(e)))
            break
        if case == "static_changed":
            # params unused in the first iteration keep no gradient
            bad = [n for n in bad if not n.startswith("branch.")]
        results.append(("ok", bad))
    return errors[0], results


@pytest.mark.parametrize("case", ["unfinished", "static_changed", "hook_type"])
def test_training_recovers_after_a_caught_error(world2, case):
    for rank, (err, results) in enumerate(world2.run(_recover_body, case)):
        for kind, detail in results:
            assert kind == "ok", f"rank {rank}: after {err[:60]!r}: {detail}"
            assert "internal error" not in str(detail)
            assert detail == [], f"rank {rank}: wrong gradients after recovering: {detail}"


def _twice_recover_body(rank, world_size):
    from tests.test_dropin import _TwiceNet

    torch.manual_seed(0)
    m = _TwiceNet()
    ddp = ddp_class()(m)
    msgs = []
    for _ in range(2):
        try:
            ddp(torch.randn(4, 8)).sum().backward()
            msgs.append("ok")
        except RuntimeError as e:
            msgs.append(str(e))
        for p in m.parameters():
            p.grad = None
    return msgs


def test_marked_twice_raises_the_same_error_again(world2):
    """An error that the next iteration would hit again is raised again, the
    same way -- not an internal error, not a hang."""
    for msgs in world2.run(_twice_recover_body):
        assert len(msgs) == 2
        for msg in msgs:
            assert msg.startswith("Expected to mark a variable ready only once."), msgs


def _finalize_error_body(rank, world_size, case):
    """Errors raised at the end of backward (a hook's result of the wrong
    size) or by a sparse bucket (no sparse gradient): caught, the next
    iteration trains normally."""
    from tests.test_dropin import _bag_batch

    if case == "hook_size":
        m = make_model("branch_always")
        ddp = ddp_class()(m)
        calls = {"n": 0}

        def hook(state, bucket):
            calls["n"] += 1
            out = bucket.buffer().div_(world_size)
            fut = dist.all_reduce(out, async_op=True).get_future()
            if calls["n"] == 1:
                return fut.then(lambda f: f.value()[0][:3])  # wrong numel, once
            return fut.then(lambda f: f.value()[0])
        ddp.register_comm_hook(None, hook)
        x, y = make_batch("branch_always", rank, 0)
        try:
            loss_fn(ddp(x), y).backward()
            err = "no error"
        except ValueError as e:
            err = str(e)
        local = copy.deepcopy(m)
        results = [_good_step(ddp, m, local, rank, s, world_size) for s in (1, 2)]
        return err, results
    # sparse, find_unused_parameters: the embeddings are left out of one
    # forward, so their sparse buckets are reduced without a sparse gradient
    # (torch: "Expected sparse gradient to be defined.")
    m = _MaybeSparse()
    ddp = ddp_class()(m, find_unused_parameters=True)
    idx, y = _bag_batch(rank, 0)
    try:
        loss_fn(ddp(idx, use_emb=False), y).backward()
        err = "no error"
    except RuntimeError as e:
        err = str(e)
    for p in m.parameters():
        p.grad = None
    oks = []
    for step in (1, 2):
        idx, y = _bag_batch(rank, step)
        try:
            loss_fn(ddp(idx), y).backward()
            oks.append(all(p.grad is not None for p in m.parameters()))
        except RuntimeError as e:
            oks.append(str(e))
        for p in m.parameters():
            p.grad = None
    return err, oks


class _MaybeSparse(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(30, 6, sparse=True)
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, idx, use_emb=True):
        h = self.emb(idx).mean(1) if use_emb else torch.ones(idx.shape[0], 6)
        return self.fc(h)


def test_recovers_after_a_hook_result_of_the_wrong_size(world2):
    for err, results in world2.run(_finalize_error_body, "hook_size"):
        assert "numel" in err, err
        assert results == [[], []], results


def test_recovers_after_a_missing_sparse_gradient(world2):
    for err, oks in world2.run(_finalize_error_body, "sparse"):
        assert err.startswith("Expected sparse gradient to be defined.") and "'emb.weight'" in err, err
        assert oks == [True, True], (err, oks)


# ------------------------------------------------ streams after a caught error
@pytest.mark.parametrize("where", ["issue", "finalize"])
def test_a_caught_error_joins_the_compute_stream(tmp_path, monkeypatch, where):
    """An error raised inside an iteration (a hook raising at issue, a hook's
    Future of the wrong size at finalize) still makes the compute stream wait
    for the comm stream before the error reaches the user: on CUDA the packs
    already queued read gradients that the user may free right after catching
    it (``zero_grad(set_to_none=True)``), and without the join their blocks
    return to the compute stream's pool while the comm stream still reads
    them.  On the CPU the join is a no-op; counted here."""
    from fastddp import DistributedDataParallel as F, comm
    from tests._dist import single_rank_group

    joins = []
    real = comm.Comm.join_compute_stream
    monkeypatch.setattr(comm.Comm, "join_compute_stream", lambda self, *a: (joins.append(1), real(self, *a))[1])

    def bad_hook(state, bucket):
        if where == "issue":
            raise RuntimeError("hook failed")
        fut = torch.futures.Future()
        fut.set_result(torch.zeros(1))  # not the bucket's numel
        return fut

    with single_rank_group(tmp_path):
        m = F(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        m.register_comm_hook(None, bad_hook)
        with pytest.raises((RuntimeError, ValueError)):
            m(torch.randn(4, 8)).sum().backward()
        assert joins, "the compute stream never waited for the comm stream after the error"
