"""Bad input fails fast and clearly (DESIGN.md "Contracts" 6).

Single-process tests use a 1-rank gloo group created in the test
(:class:`tests._dist.single_rank_group`); tests where ranks interact run in
the W=2 harness.  Assertions are on what a user needs from the message (which
parameter / option / rank, what to do), never on exact wording.  Where torch
itself is weaker than the contract (e.g. it does not name parameters), the
stand-in run checks torch's weaker message and the fastddp run the contract.
"""

from __future__ import annotations

import copy
import datetime
import warnings

import pytest
import torch
from torch import nn

from tests._dist import (STAND_IN, ddp_class, single_rank_group,  # noqa: F401
                         torch_ddp_accepts, torch_ddp_class, world2)
from tests._models import loss_fn, make_batch, make_model
from tests._compare import compare_grads
from tests._parity import side_by_side

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def pg1(tmp_path):
    with single_rank_group(tmp_path) as pg:
        yield pg


# --------------------------------------------------------------------------
# construction
# --------------------------------------------------------------------------

def test_no_process_group():
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises((RuntimeError, ValueError)) as ei:
        ddp_class()(make_model("mlp"))
    msg = str(ei.value)
    assert "process group" in msg.lower(), msg
    assert "init_process_group" in msg, f"the message should say what to call: {msg}"


def test_no_param_requires_grad(pg1):
    with pytest.raises(RuntimeError) as ei:
        ddp_class()(make_model("nograd"))
    msg = str(ei.value).lower()
    assert "grad" in msg and "parameter" in msg, msg


def test_uninitialized_parameters(pg1):
    with pytest.raises(RuntimeError) as ei:
        ddp_class()(nn.Sequential(nn.LazyLinear(4)))
    msg = str(ei.value).lower()
    assert "uninitialized" in msg and "forward" in msg, msg


@pytest.mark.parametrize("kwargs", [dict(device_ids=[0]), dict(device_ids=[0, 1]),
                                    dict(output_device=1)],
                         ids=["device_ids", "two_device_ids", "output_device"])
def test_device_ids_for_cpu_module(pg1, kwargs):
    with pytest.raises(ValueError) as ei_ref:
        torch_ddp_class()(make_model("mlp"), **kwargs)
    with pytest.raises(ValueError) as ei:
        ddp_class()(make_model("mlp"), **kwargs)
    msg = str(ei.value)
    opt = next(iter(kwargs))
    assert opt in msg, f"the message should name {opt!r}: {msg}"
    assert opt in str(ei_ref.value)


def test_broadcast_buffers_and_forward_sync_buffers_both_given(pg1):
    """torch 2.13 WARNS (FutureWarning) and lets forward_sync_buffers win; a
    drop-in must not turn that into an error (user scripts would break)."""
    # a torch without forward_sync_buffers (2.11) has nothing to compare here
    classes = ([torch_ddp_class()] if torch_ddp_accepts("forward_sync_buffers") else []) + [ddp_class()]
    for fsb in (False, True):
        for cls in classes:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                ddp = cls(make_model("bn"), broadcast_buffers=not fsb, forward_sync_buffers=fsb)
            msgs = [str(w.message) for w in rec if issubclass(w.category, FutureWarning)]
            assert any("broadcast_buffers" in m and "forward_sync_buffers" in m for m in msgs), \
                f"{cls.__module__}: expected a FutureWarning naming both options, got {msgs}"
            assert ddp.forward_sync_buffers is fsb and ddp.broadcast_buffers is fsb


def test_broadcast_buffers_alone_is_deprecated(pg1):
    """Deprecated since torch 2.13 (for forward_sync_buffers, which fastddp
    takes on every torch); torch 2.11 takes it without a warning."""
    for cls in (torch_ddp_class(), ddp_class()):
        if cls is torch_ddp_class() and not torch_ddp_accepts("forward_sync_buffers"):
            ddp = cls(make_model("bn"), broadcast_buffers=False)
        else:
            with pytest.warns(FutureWarning, match="forward_sync_buffers"):
                ddp = cls(make_model("bn"), broadcast_buffers=False)
        assert ddp.broadcast_buffers is False


def _not_impl_kwargs(name, model):
    if name == "delay_all_reduce_named_params":
        return dict(delay_all_reduce_named_params=list(model.named_parameters())[:2],
                    param_to_hook_all_reduce=model.fc3.weight)
    if name == "mixed_precision":
        from torch.nn.parallel.distributed import _MixedPrecision
        return dict(mixed_precision=_MixedPrecision(param_dtype=torch.float16))
    if name == "device_mesh":
        from torch.distributed.device_mesh import init_device_mesh
        return dict(device_mesh=init_device_mesh("cpu", (1,)))
    raise KeyError(name)


def _one_step_grads(ddp, model):
    x, y = make_batch("mlp", 0, 0)
    loss_fn(ddp(x), y).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("option", ["delay_all_reduce_named_params", "mixed_precision", "device_mesh"])
def test_later_options_refused_clearly_or_work(pg1, option):
    """Options fastddp may not complete: either a NotImplementedError that
    names the option, or they work like torch's (one step, same grads)."""
    model = make_model("mlp")
    kwargs = _not_impl_kwargs(option, model)
    try:
        ddp = ddp_class()(model, **kwargs)
    except NotImplementedError as e:
        msg = str(e)
        assert any(k in msg for k in kwargs), f"the message should name the option: {msg}"
        return
    # accepted: it must then behave like torch's DDP with the same option
    ref_model = make_model("mlp")
    ref_kwargs = _not_impl_kwargs(option, ref_model)
    try:  # a CUDA build of torch without a driver fails already here (mixed_precision makes a Stream)
        ref = torch_ddp_class()(ref_model, **ref_kwargs)
        g_ref = _one_step_grads(ref, ref_model)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch's DDP itself cannot run {option} here: {e}")
    g_test = _one_step_grads(ddp, model)
    assert list(g_ref) == list(g_test)
    for n in g_ref:
        a, b = g_ref[n], g_test[n]
        assert (a is None) == (b is None), f"{n}: grad None-ness differs with {option}"
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{n}: grad differs with {option}"
    if option == "device_mesh":
        assert ddp.process_group == kwargs["device_mesh"].get_group(mesh_dim=0)


def test_param_to_hook_all_reduce_alone(pg1):
    model = make_model("mlp")
    with pytest.raises(ValueError) as ei_ref:
        torch_ddp_class()(model, param_to_hook_all_reduce=model.fc3.weight)
    with pytest.raises((NotImplementedError, ValueError)) as ei:
        ddp_class()(model, param_to_hook_all_reduce=model.fc3.weight)
    assert "param_to_hook_all_reduce" in str(ei.value) or \
        "delay_all_reduce_named_params" in str(ei.value)
    assert "delay_all_reduce_named_params" in str(ei_ref.value)


# --------------------------------------------------------------------------
# parameters that differ across ranks (init_sync=True)
# --------------------------------------------------------------------------

MISMATCH = {
    # kind: (mutation on rank 1, name fastddp must report, torch's rank-1 substring)
    "shape": ("fc3 = Linear(32, 9)", "fc3.weight", "sizes"),
    "stride": ("fc2.weight transposed-contiguous", "fc2.weight", "strides"),
    "dtype": ("fc3 in float64", "fc3.weight", None),
    "count": ("extra Linear(2, 2)", None, "params"),
}


def _mismatch_body(rank, world_size, kind):
    import torch.distributed as dist
    # a private group with a short timeout: a rank left waiting on a peer that
    # already raised (torch's behaviour for shape/stride) fails in seconds
    pg = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=5),
                        backend="gloo")
    m = make_model("mlp")
    if rank == 1:
        if kind == "shape":
            m.fc3 = nn.Linear(32, 9)
        elif kind == "stride":
            m.fc2.weight = nn.Parameter(m.fc2.weight.detach().t().contiguous().t())
        elif kind == "dtype":
            m.fc3.double()
        elif kind == "count":
            m.extra = nn.Linear(2, 2)
    try:
        ddp_class()(m, process_group=pg)
        result = ("no error", "")
    except Exception as e:  # noqa: BLE001 - reported to the driver
        result = (type(e).__name__, str(e))
    finally:
        dist.destroy_process_group(pg)
    return result


@pytest.mark.parametrize("kind", list(MISMATCH))
def test_param_mismatch_across_ranks(world2, kind):
    _, name, torch_substr = MISMATCH[kind]
    if STAND_IN and kind == "dtype":
        pytest.skip("torch DDP does not check dtypes: gloo aborts the process (SIGABRT)")
    res = world2.run(_mismatch_body, kind, timeout=60)
    if STAND_IN:
        # torch: the mismatching rank raises (count: every rank); it names an index
        etype, msg = res[1]
        assert etype == "RuntimeError" and torch_substr in msg, res
        return
    for rank, (etype, msg) in enumerate(res):
        assert etype != "no error", f"rank {rank} accepted a model that differs across ranks"
        assert "rank" in msg.lower(), f"rank {rank}: the message should name the ranks: {msg}"
        if name is not None:
            assert name in msg, f"rank {rank}: the message should name {name!r}: {msg}"


# --------------------------------------------------------------------------
# a parameter that gets no gradient, find_unused_parameters=False
# --------------------------------------------------------------------------

def _unfinished_reduction_body(rank, world_size, kwargs):
    m = make_model("branch_never")  # branch.weight / branch.bias never used
    ddp = ddp_class()(m, **kwargs)
    events = []
    for step in range(3):
        x, y = make_batch("branch_never", rank, step)
        try:
            out = ddp(x)
        except RuntimeError as e:
            events.append((step, "forward", str(e)))
            break
        try:
            loss_fn(out, y).backward()
        except RuntimeError as e:
            events.append((step, "backward", str(e)))
            break
        events.append((step, "ok", ""))
        for p in m.parameters():
            p.grad = None
    return events


@pytest.mark.parametrize("kwargs", [{}, dict(batched_grad_copy=True),
                                    dict(gradient_as_bucket_view=True), dict(bucket_cap_mb=0.001)],
                         ids=["default", "batched", "view", "tiny_buckets"])
def test_unused_param_without_find_unused(world2, kwargs):
    res = world2.run(_unfinished_reduction_body, kwargs)
    for rank, events in enumerate(res):
        step, where, msg = events[-1]
        assert where != "ok", f"rank {rank}: no error after {len(events)} steps: {events}"
        # torch raises at the NEXT iteration's forward; raising already at the
        # end of the first backward is allowed (better: no silent step)
        assert step <= 1, f"rank {rank}: error only at step {step}: {events}"
        assert "find_unused_parameters" in msg, f"rank {rank}: the message should give the hint: {msg}"
        if STAND_IN:
            assert "2 3" in msg, msg  # torch names indices (names need TORCH_DISTRIBUTED_DEBUG)
        else:
            for name in ("branch.weight", "branch.bias"):
                assert name in msg, f"rank {rank}: the message should name {name!r}: {msg}"


def _unused_after_rebuild_body(rank, world_size, kwargs):
    """The branch is used for three steps (the ready order is learnt and the
    buckets rebuilt, so readiness takes the lean per-parameter path), then
    left out: the same error as when it is never used."""
    m = make_model("branch_always")
    ddp = ddp_class()(m, **kwargs)
    events = []
    for step in range(6):
        x, y = make_batch("branch_always", rank, step)
        m.schedule = "always" if step < 3 else "never"
        try:
            out = ddp(x)
            loss_fn(out, y).backward()
        except RuntimeError as e:
            events.append((step, str(e)))
            break
        events.append((step, "ok"))
        for p in m.parameters():
            p.grad = None
    return events


@pytest.mark.parametrize("kwargs", [{}, dict(batched_grad_copy=True), dict(bucket_cap_mb=0.001)],
                         ids=["default", "batched", "tiny_buckets"])
def test_unused_param_after_the_rebuild(world2, kwargs):
    res = world2.run(_unused_after_rebuild_body, kwargs)
    for rank, events in enumerate(res):
        step, msg = events[-1]
        assert msg != "ok", f"rank {rank}: no error in {len(events)} steps: {events}"
        assert step in (3, 4), f"rank {rank}: error at step {step}, expected 3 or 4: {events}"
        assert "find_unused_parameters" in msg, msg
        if not STAND_IN:
            for name in ("branch.weight", "branch.bias"):
                assert name in msg, f"rank {rank}: the message should name {name!r}: {msg}"


class _ReuseNet(nn.Module):
    """``block`` runs once per forward, or, with ``twice``, twice under
    reentrant checkpointing: its AccumulateGrad then fires once per
    checkpointed segment, i.e. twice in one backward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = nn.Linear(8, 8)
        self.twice = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        if not self.twice:
            return self.block(h)
        h = checkpoint(self.block, h, use_reentrant=True)
        return checkpoint(self.block, h, use_reentrant=True)


def _marked_twice_body(rank, world_size):
    torch.manual_seed(0)
    m = _ReuseNet()
    ddp = ddp_class()(m)
    for step in range(4):
        m.twice = step == 3  # after the rebuild: the lean readiness path
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        try:
            ddp(x).sum().backward()
        except RuntimeError as e:
            return step, str(e)
        for p in m.parameters():
            p.grad = None
    return 4, "no error"


def test_param_marked_ready_twice_after_the_rebuild(world2):
    res = world2.run(_marked_twice_body)
    for rank, (step, msg) in enumerate(res):
        assert step == 3, f"rank {rank}: expected the error at step 3, got step {step}: {msg}"
        if STAND_IN:
            assert "only once" in msg, msg
        else:
            assert "twice" in msg and ("block.weight" in msg or "block.bias" in msg), msg
            assert "static_graph" in msg, f"rank {rank}: give the way out: {msg}"


def _static_graph_unused_body(rank, world_size):
    """static_graph tolerates a parameter that never gets a gradient (torch)."""
    def step_fn(ddp, x, y, step, is_ref):
        loss = loss_fn(ddp(x, step=step, rank=rank), y)
        loss.backward()
        assert ddp.module.branch.weight.grad is None
        return loss

    return side_by_side(rank, world_size, "branch_never", kwargs=dict(static_graph=True), steps=3,
                        step_fn=step_fn, optim=None).checks == 3


def test_static_graph_with_never_used_param(world2):
    assert world2.run(_static_graph_unused_body) == [True, True]


# --------------------------------------------------------------------------
# sparse gradients: work like torch, or refuse clearly; never silently wrong
# --------------------------------------------------------------------------

def _sparse_body(rank, world_size):
    m_ref = make_model("sparse_emb")
    m_test = copy.deepcopy(m_ref)
    ref = torch_ddp_class()(m_ref)
    try:
        test = ddp_class()(m_test)
    except Exception as e:  # noqa: BLE001
        return ("refused at construction", type(e).__name__, str(e))
    for step in range(2):
        x, y = make_batch("sparse_emb", rank, step)
        loss_fn(ref(x), y).backward()
        try:
            loss_fn(test(x), y).backward()
        except Exception as e:  # noqa: BLE001
            return ("refused at backward", type(e).__name__, str(e))
        compare_grads(ref, test, f"rank {rank} step {step} (sparse)", tol=dict(rtol=1e-6, atol=1e-7))
        assert m_test.emb.weight.grad.is_sparse, "torch gives a sparse gradient here"
        for p in list(m_ref.parameters()) + list(m_test.parameters()):
            p.grad = None
    return ("works",)


def test_sparse_gradients(world2):
    res = world2.run(_sparse_body)
    outcomes = {r[0] for r in res}
    assert len(outcomes) == 1, f"ranks disagree: {res}"
    if res[0][0] == "works":
        return
    for r in res:
        msg = r[2]
        assert "sparse" in msg.lower(), f"say why: {msg}"
        assert "emb" in msg or "Embedding" in msg, f"name the module/parameter: {msg}"
