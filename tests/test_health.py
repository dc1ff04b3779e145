"""check_finite: a non-finite gradient on one rank is named -- rank and
parameter -- before the optimizer sees the poisoned average, on every path.

A NaN (or a value the 16-bit wire cannot hold) is planted in one parameter's
gradient on one rank by a tensor hook, so the pack reads it as autograd made
it.  Both ranks must raise (or warn): the bad rank names the parameter, the
other says whose gradient made the average non-finite; the next clean
iteration trains normally.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests._dist import ddp_class, fastddp_only, world2  # noqa: F401
from tests._models import loss_fn, make_batch, make_model

pytestmark = [pytest.mark.timeout(300), fastddp_only]

PATHS = {
    "default": ({}, None),
    "batched": ({"batched_grad_copy": True}, None),
    "view": ({"gradient_as_bucket_view": True}, None),
    "tiny": ({"bucket_cap_mb": 0.0005}, None),
    "fused_fp16": ({}, "fp16"),
    "fused_bf16": ({}, "bf16"),
    "error_feedback": ({}, "ef"),
    "torch_fp16_hook": ({}, "torch_fp16"),
    "torch_allreduce_hook": ({}, "torch_allreduce"),
}


def _register(ddp, hook):
    import fastddp.hooks as fh
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    if hook == "fp16":
        ddp.register_comm_hook(None, fh.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, fh.bf16_compress_hook)
    elif hook == "ef":
        ddp.register_comm_hook(fh.CompressionState(error_feedback=True), fh.bf16_compress_hook)
    elif hook == "torch_fp16":
        ddp.register_comm_hook(None, dh.fp16_compress_hook)
    elif hook == "torch_allreduce":
        ddp.register_comm_hook(None, dh.allreduce_hook)


def _health_body(rank, world_size, path, plant, mode, bad_rank=1, bad_step=2, kind="nan"):
    kwargs, hook = PATHS[path]
    m = make_model("mlp")
    ddp = ddp_class()(m, check_finite=mode, **kwargs)
    _register(ddp, hook)
    events = []
    for step in range(4):
        handle = None
        if rank == bad_rank and step == bad_step:
            p = getattr(m, plant.split(".")[0]).weight
            handle = p.register_hook((lambda g: g * float("nan")) if kind == "nan"
                                     else (lambda g: torch.full_like(g, 1e6)))
        x, y = make_batch("mlp", rank, step)
        for p in m.parameters():
            p.grad = None
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                loss_fn(ddp(x), y).backward()
                finite = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
                # the same averaged gradient on every rank
                g = torch.cat([p.grad.flatten() for p in m.parameters()])
                other = g.clone()
                dist.broadcast(other, 0)
                events.append(("ok", finite, bool(torch.equal(g, other) or not finite),
                               [str(x.message) for x in w if "check_finite" in str(x.message)]))
            except FloatingPointError as e:
                events.append(("raised", str(e)))
        if handle is not None:
            handle.remove()
    return events


@pytest.mark.parametrize("path", list(PATHS))
def test_nan_on_one_rank_is_named_on_every_path(world2, path):
    res = world2.run(_health_body, path, "fc2.weight", "raise")
    for rank, events in enumerate(res):
        assert [e[0] for e in events] == ["ok", "ok", "raised", "ok"], (rank, events)
        msg = events[2][1]
        if rank == 1:
            assert "'fc2.weight'" in msg and "rank 1" in msg, msg
        else:
            assert "because of rank(s) [1]" in msg and "rank 0" in msg, msg
        for e in (events[0], events[1], events[3]):
            assert e[1] and e[2], (rank, e)  # finite and equal across ranks: training recovered


def test_fp16_overflow_named_as_the_cast(world2):
    res = world2.run(_health_body, "fused_fp16", "fc1.weight", "raise", 0, 1, "big")
    for rank, events in enumerate(res):
        assert events[1][0] == "raised", (rank, events)
        msg = events[1][1]
        if rank == 0:
            assert "float16 cast overflowed on rank 0" in msg, msg
        else:
            assert "because of rank(s) [0]" in msg, msg
        assert events[3][0] == "ok" and events[3][1], events  # clean steps afterwards


def test_warn_mode_warns_and_goes_on(world2):
    res = world2.run(_health_body, "default", "fc3.weight", "warn")
    for rank, events in enumerate(res):
        assert [e[0] for e in events] == ["ok"] * 4, events
        assert events[2][3] and not events[2][1], events[2]  # warned; the grads are not finite
        assert not events[1][3] and not events[3][3], events


def _configure_body(rank, world_size, how):
    import os

    import fastddp
    from fastddp import settings

    if how == "configure":
        fastddp.configure(check_finite="raise")
    else:
        os.environ["FASTDDP_CHECK_FINITE"] = "raise"
        settings.reload()  # read once: re-read after the change
    try:
        m = make_model("mlp")
        ddp = ddp_class()(m)  # torch's signature: no check_finite argument
        if rank == 0:
            m.fc1.weight.register_hook(lambda g: g * float("inf"))
        x, y = make_batch("mlp", rank, 0)
        try:
            loss_fn(ddp(x), y).backward()
            return "no error", ddp.stats()["check_finite"]
        except FloatingPointError as e:
            return str(e), ddp.stats()["check_finite"]
    finally:
        fastddp.configure(check_finite=None)
        os.environ.pop("FASTDDP_CHECK_FINITE", None)
        settings.reload()


@pytest.mark.parametrize("how", ["configure", "env"])
def test_check_finite_without_the_constructor_argument(world2, how):
    for msg, mode in world2.run(_configure_body, how):
        assert mode == "raise" and "check_finite" in msg, msg


def _off_body(rank, world_size):
    import fastddp.kernels as K

    m = make_model("deep")
    ddp = ddp_class()(m, bucket_cap_mb=0.001)
    x, y = make_batch("deep", rank, 0)
    loss_fn(ddp(x), y).backward()
    m.zero_grad()
    s0 = K.stats()["pack_calls"]
    loss_fn(ddp(x), y).backward()
    return ddp.stats()["check_finite"], K.stats()["pack_calls"] - s0, ddp.reducer.num_buckets


def test_check_off_by_default(world2):
    for mode, packs, nb in world2.run(_off_body):
        assert mode is None
        assert packs == nb  # one pack per bucket, nothing added


def _ef_recovers_body(rank, world_size):
    """Error feedback: an overflowing step no longer poisons the residual."""
    import fastddp.hooks as fh

    m = make_model("mlp")
    ddp = ddp_class()(m, check_finite="warn")
    ddp.register_comm_hook(fh.CompressionState(error_feedback=True), fh.fp16_compress_hook)
    out = []
    for step in range(4):
        h = m.fc2.weight.register_hook(lambda g: torch.full_like(g, 1e9)) if step == 1 else None
        for p in m.parameters():
            p.grad = None
        x, y = make_batch("mlp", rank, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(ddp(x), y).backward()
        out.append(all(bool(torch.isfinite(p.grad).all()) for p in m.parameters()))
        if h is not None:
            h.remove()
    return out


def test_error_feedback_residual_recovers_after_an_overflow(world2):
    for out in world2.run(_ef_recovers_body):
        assert out[0] and not out[1] and out[2] and out[3], out


def _join_body(rank, world_size):
    """Uneven inputs with check_finite: the joined rank takes part in the
    flags' all-gather (no collective mismatch)."""
    m = make_model("mlp")
    ddp = ddp_class()(m, check_finite="raise")
    steps = 3 if rank == 0 else 1
    with ddp.join():
        for step in range(steps):
            x, y = make_batch("mlp", rank, step)
            loss_fn(ddp(x), y).backward()
    return all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())


def test_check_finite_with_join(world2):
    assert world2.run(_join_body, timeout=120) == [True, True]


# ------------------------------------------- each value flagged once; gather buffers made once
def _flag_reads(hook, view, steps=4):
    """One rank: per step, how many gradient elements the calls that set a
    check_finite flag read (a value read by two of them counts twice), and
    how many gradient elements the model has."""
    import fastddp.hooks as fh
    import fastddp.kernels as K
    from fastddp import DistributedDataParallel as F
    from fastddp.reduction import datapath

    m = make_model("mlp")
    ddp = F(m, check_finite="raise", gradient_as_bucket_view=view)
    if hook == "fp16":
        ddp.register_comm_hook(None, fh.fp16_compress_hook)
    elif hook == "fp8":
        ddp.register_comm_hook(None, fh.fp8_compress_hook)
    reads = [0]
    pack, quantize, flag = K.pack, K.quantize_fp8, datapath.flag_nonfinite

    def counted_pack(srcs, dst, *a, health=None, **k):
        if health is not None:
            reads[0] += sum(s.numel() for s in srcs)
        return pack(srcs, dst, *a, health=health, **k)

    def counted_quantize(x, *a, health=None, **k):
        if health is not None:  # the stage's gradient values in the range quantized (the rest are zeros)
            wires = [d for b in ddp.reducer.buckets for d in b.reduction.engine.wires.values()
                     if d.stage.data_ptr() <= x.data_ptr() < d.stage.data_ptr() + 4 * d.stage.numel()]
            lo = x.storage_offset() - wires[0].stage.storage_offset()
            hi = lo + x.numel()
            lay = wires[0].lay8
            reads[0] += sum(max(0, min(hi, o + n) - max(lo, o)) for o, n in zip(lay.offsets, lay.numels))
        return quantize(x, *a, health=health, **k)

    def counted_flag(health, t, bit):
        reads[0] += t.numel()
        return flag(health, t, bit)

    K.pack, K.quantize_fp8, datapath.flag_nonfinite = counted_pack, counted_quantize, counted_flag
    try:
        per_step = []
        for step in range(steps):
            m.zero_grad(set_to_none=not view)  # view: the grads stay bucket views (no pack reads them)
            reads[0] = 0
            x, y = make_batch("mlp", 0, step)
            loss_fn(ddp(x), y).backward()
            per_step.append(reads[0])
    finally:
        K.pack, K.quantize_fp8, datapath.flag_nonfinite = pack, quantize, flag
    return per_step, sum(p.numel() for p in m.parameters())


FLAG_CASES = [(h, v) for h in (None, "fp16", "fp8") for v in (False, True)]


@pytest.mark.parametrize("hook,view", FLAG_CASES)
def test_each_gradient_value_is_flagged_once(hook, view):
    """A bucket is flagged by exactly one launch per value: the compressed
    paths' cast and fp8's quantize do not re-check what an earlier pack (or
    fill_flat) already flagged."""
    from tests._dist import single_rank_group

    with single_rank_group():
        per_step, n = _flag_reads(hook, view)
    assert per_step[1:] == [n] * (len(per_step) - 1), (per_step, n)


def _gather_body(rank, world_size, steps=4):
    """The flags' all-gather writes into one buffer made once, step after step."""
    from fastddp import groups

    m = make_model("mlp")
    ddp = ddp_class()(m, check_finite="raise")
    outs, lists = [], []
    into, listed = groups.all_gather_into_tensor, groups.all_gather

    def rec_into(out, t, pg):
        if t.dtype == torch.int32:
            outs.append(out)
        return into(out, t, pg)

    def rec_list(out, t, pg):
        lists.append(out)
        return listed(out, t, pg)

    groups.all_gather_into_tensor, groups.all_gather = rec_into, rec_list
    try:
        for step in range(steps):
            m.zero_grad()
            x, y = make_batch("mlp", rank, step)
            loss_fn(ddp(x), y).backward()
            if step == 0:
                outs.clear()  # the first iteration rebuilds the buckets (new flags, new buffers)
                lists.clear()  # (and checks the ranks' settings once: fastddp.agree)
    finally:
        groups.all_gather_into_tensor, groups.all_gather = into, listed
    return len(outs), all(o is outs[0] for o in outs), len(lists)


def test_flags_gather_allocates_nothing_per_step(world2):
    for calls, same, listed in world2.run(_gather_body):
        assert calls == 3 and same and listed == 0, (calls, same, listed)
