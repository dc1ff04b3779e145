"""The bench's ``replicate`` peer: torch's FSDP2-based replicate against the
class under test, gradient for gradient.

Inside every rank of ONE gloo process group (W=2, fp32) the same model is
built twice; one copy is wrapped exactly as the bench's ``replicate`` row
wraps it (``bench.wrappers.build_wrapper``: replicate per block, then on the
root), the other in the class under test.  Both see the same per-rank data
(different on each rank), steps interleaved.  After every backward each
gradient is compared bit for bit: replicate's gradients are DTensors with a
``Replicate()`` placement, so their local tensor is the whole gradient.

Why bit for bit holds at W=2: fastddp (like torch's DDP) multiplies each
gradient by fp32(1/2) and SUMs; replicate averages in the collective (or
divides by 2 before/after a SUM).  With two addends, a*0.5 + b*0.5 and
(a + b) / 2 are the same float (scaling by a power of two is exact away from
the subnormal range), and gloo's sum of two values does not depend on order.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._dist import ddp_class, world2
from tests._models import loss_fn, make_batch, make_model

pytestmark = pytest.mark.timeout(300)


def _local(t):
    """A gradient or parameter as a plain tensor (DTensor -> its local shard,
    the whole tensor under a Replicate placement)."""
    if t is None:
        return None
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        assert all(p.is_replicate() for p in t.placements), f"unexpected placements {t.placements}"
        return t.to_local()
    return t


def _diff(name, a, b):
    if (a is None) != (b is None):
        return f"{name}: None-ness differs (test {a is None}, replicate {b is None})"
    if a is None:
        return None
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{name}: dtype/shape differ: test {a.dtype}{tuple(a.shape)}, replicate {b.dtype}{tuple(b.shape)}"
    if torch.equal(a, b):
        return None
    d = (a.double() - b.double()).abs()
    return (f"{name}: {int((a != b).sum())}/{a.numel()} elements differ, max |diff| "
            f"{d.max().item():.3e}")


def _parity_body(rank, world, model_name, steps, bucket_cap_mb):
    from fastddp.bench.wrappers import WrapperOptions, build_wrapper

    torch.manual_seed(0)
    base = make_model(model_name)
    rep, note = build_wrapper("replicate", copy.deepcopy(base), None, WrapperOptions())
    ours = ddp_class()(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    opt_r = torch.optim.SGD(rep.parameters(), lr=0.05, momentum=0.9)
    bad = []
    for step in range(steps):
        x, y = make_batch(model_name, rank, step)
        for m, opt in ((ours, opt_o), (rep, opt_r)):
            opt.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
        named_o = dict(ours.module.named_parameters())
        named_r = dict(rep.named_parameters())
        assert list(named_o) == list(named_r), f"parameter names differ: {list(named_o)} vs {list(named_r)}"
        for n in named_o:
            why = _diff(f"step {step} grad {n}", named_o[n].grad, _local(named_r[n].grad))
            if why:
                bad.append(why)
        opt_o.step()
        opt_r.step()
    for n, p in ours.module.named_parameters():
        why = _diff(f"final param {n}", p.detach(), _local(dict(rep.named_parameters())[n]).detach())
        if why:
            bad.append(why)
    n_dtensor = sum(1 for p in rep.parameters() if _local(p) is not p)
    return {"bad": bad[:10], "note": note, "dtensors": n_dtensor, "params": len(list(rep.parameters()))}


@pytest.mark.parametrize("model_name,bucket_cap_mb", [("mlp", None), ("deep", None), ("deep", 0.001)])
def test_grads_equal_replicate_bit_for_bit(world2, model_name, bucket_cap_mb):
    out = world2.run(_parity_body, model_name, 4, bucket_cap_mb)
    for rank, r in enumerate(out):
        # replicate really wrapped the model: every parameter became a DTensor
        assert r["dtensors"] == r["params"] > 0, f"rank {rank}: {r}"
        assert not r["bad"], f"rank {rank} ({r['note']}):\n" + "\n".join(r["bad"])


def _broken_replicate_body(rank, world):
    """The comparison catches a replicate whose gradients are not averaged
    (the check above is not vacuous): scale rank 1's grads and compare."""
    from fastddp.bench.wrappers import WrapperOptions, build_wrapper

    torch.manual_seed(0)
    base = make_model("mlp")
    rep, _ = build_wrapper("replicate", copy.deepcopy(base), None, WrapperOptions())
    ours = ddp_class()(copy.deepcopy(base))
    x, y = make_batch("mlp", rank, 0)
    loss_fn(ours(x), y).backward()
    loss_fn(rep(x), y).backward()
    named_r = dict(rep.named_parameters())
    diffs = []
    for n, p in ours.module.named_parameters():
        g = _local(named_r[n].grad).clone()
        g[..., 0] += 1e-6  # the last-bit kind of difference the test must see
        diffs.append(_diff(n, p.grad, g))
    return sum(d is not None for d in diffs)


def test_comparison_sees_a_one_element_difference(world2):
    assert all(n > 0 for n in world2.run(_broken_replicate_body))
