"""torch.compile and compiled autograd with fastddp (see fastddp/compile.py).

In every rank of ONE gloo group: torch's EAGER DDP is the reference; the
class under test runs the same model compiled (``torch.compile`` of the DDP
module, or eager forward + compiled autograd).  Steps are interleaved as in
test_parity.py (:func:`tests._parity.side_by_side`).  Gradients are compared
after every backward:

* ``aot_eager`` (graph capture + AOTAutograd, no code generation): the same
  aten ops as eager, so bit for bit at W=2;
* inductor (the default backend): generated C++ kernels fuse and reorder
  floating-point arithmetic (addmm vs mm + add, the reduction order of
  LayerNorm / BatchNorm / softmax), so torch's own compiled DDP differs from
  its eager DDP in the last bits too: ``INDUCTOR_TOL``.

Overlap is observed, not assumed: a pre-hook on the autograd node that
produces the FIRST parameter's gradient (the last one backward computes)
reads how many collectives the reducer has issued before that node runs.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fastddp.bench.compile_wrappers import first_grad_node
from tests._dist import STAND_IN, ddp_class, world2  # noqa: F401
from tests._parity import side_by_side

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(STAND_IN, reason="compares fastddp under compile with torch's eager DDP")]

#: inductor vs eager (fused / reordered fp32 arithmetic), a few ulps.
INDUCTOR_TOL = dict(rtol=1e-5, atol=1e-6)

D = 64  # 64x64 fp32 weights: 16 KiB; a 0.02 MiB cap puts ~1 layer in each bucket
CAP = 0.02


# --------------------------------------------------------------------------
# models (small: compile time, not run time, is what costs here)
# --------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, depth=4):
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.hidden = nn.ModuleList(nn.Linear(D, D) for _ in range(depth))
        self.out = nn.Linear(D, 8)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


class Block(nn.Module):
    """One pre-norm transformer block (attention + MLP) and a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, D)  # a (B, 16) input read as 4 tokens of 4 features
        self.ln1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, 8)

    def forward(self, x):
        h = self.emb(x.reshape(x.shape[0], 4, 4))  # (B, 4, D)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.ff(self.ln2(h))
        return self.head(h.mean(1))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        h = x.reshape(x.shape[0], 1, 4, 4)
        h = torch.relu(self.bn1(self.c1(h)))
        h = torch.relu(self.bn2(self.c2(h)))
        return self.fc(h.mean((2, 3)))


class Branch(nn.Module):
    """``branch`` used on odd steps only (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, D)
        self.branch = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, 8)

    def forward(self, x, use_branch: bool = False):
        h = torch.relu(self.fc1(x))
        if use_branch:
            h = h + torch.relu(self.branch(h))
        return self.fc2(h)


MODELS = {"mlp": MLP, "block": Block, "convbn": ConvBN, "branch": Branch}


def _build(name, seed=7):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name]()


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(rank * 10_007 + step * 101 + micro)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def _loss(out, y):
    return ((out - y) ** 2).mean()


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------

def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()


def _forward_kwargs(model_name, step):
    return {"use_branch": step % 2 == 1} if model_name == "branch" else {}


def _compiled_run(rank, world_size, model_name, mode, ddp_kwargs, steps=3, backend="aot_eager",
                  no_sync_micro=0, hook=None, set_to_none=True, tol=None):
    """Train torch's eager DDP and the class under test (``mode``: "compile"
    = torch.compile(ddp), "ca" = compiled autograd, "both") side by side
    (:func:`side_by_side`)."""
    import torch._dynamo

    _fresh_dynamo()
    compiled = []

    def backward(loss):
        if mode in ("ca", "both"):
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
                loss.backward()
        else:
            loss.backward()

    def step_fn(ddp, x, y, step, is_ref):
        fk = _forward_kwargs(model_name, step)
        if is_ref:
            loss = _loss(ddp(x, **fk), y)
            loss.backward()
            return loss
        if not compiled:
            compiled.append(torch.compile(ddp, backend=backend) if mode in ("compile", "both") else ddp)
        loss = _loss(compiled[0](x, **fk), y)
        backward(loss)
        return loss

    def fp16_hook(is_ref):
        import fastddp.hooks
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return None, default_hooks.fp16_compress_hook if is_ref else fastddp.hooks.fp16_compress_hook

    run = side_by_side(rank, world_size, functools.partial(_build, model_name), kwargs=ddp_kwargs,
                       steps=steps, no_sync_micro=no_sync_micro, set_to_none=set_to_none, tol=tol,
                       hook=fp16_hook if hook == "fp16" else None,
                       batch=lambda step, micro: _batch(rank, step, micro), step_fn=step_fn)
    return run.test.stats()["collectives"]


def _compiled_case(rank, world_size, model_name, mode, ddp_kwargs, run_kwargs):
    return _compiled_run(rank, world_size, model_name, mode, ddp_kwargs, **run_kwargs)


def count_nodes(loss, name):
    seen, stack, n = set(), [loss.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        n += name in type(fn).__name__
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return n


def overlap_probe(ddp, loss):
    """Arm a probe: returns a list that, after backward, holds the number of
    collectives issued before backward started computing the first
    parameter's gradient (the last gradient of the step)."""
    import torch._dynamo

    first = next(p for p in ddp.module.parameters() if p.requires_grad)
    node = first_grad_node(loss, first)
    seen = []
    base = ddp.stats()["collectives"]

    @torch._dynamo.disable
    def probe(grad_outputs):
        seen.append(ddp.stats()["collectives"] - base)

    node.register_prehook(probe)
    return seen


def _overlap_run(rank, world_size, mode, steps=3, backend="aot_eager", optimize_ddp=True):
    """Per step: (collectives issued before the last gradient, buckets,
    compiled backward nodes)."""
    import torch._dynamo

    _fresh_dynamo()
    test = ddp_class()(_build("mlp"), bucket_cap_mb=CAP)
    out = []
    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
        run = torch.compile(test, backend=backend) if mode in ("compile", "both") else test
        for step in range(steps):
            x, y = _batch(rank, step)
            loss = _loss(run(x), y)
            seen = overlap_probe(test, loss)
            nodes = count_nodes(loss, "CompiledFunction")
            if mode in ("ca", "both"):
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
                    loss.backward()
            else:
                loss.backward()
            out.append((seen[0] if seen else None, len(test.stats()["buckets"]), nodes))
            for p in test.parameters():
                p.grad = None
    return out


def _explain_run(rank, world_size, model_name):
    """Graph breaks in torch.compile(fastddp module), DDPOptimizer's own
    intentional splits switched off: what fastddp's forward causes."""
    import torch._dynamo

    _fresh_dynamo()
    test = ddp_class()(_build(model_name), bucket_cap_mb=CAP)
    x, _ = _batch(rank, 0)
    with torch._dynamo.config.patch(optimize_ddp=False):
        ex = torch._dynamo.explain(test)(x)
    reasons = [str(b.reason).splitlines()[0] for b in ex.break_reasons]
    with torch._dynamo.config.patch(optimize_ddp=True):
        _fresh_dynamo()
        split = torch._dynamo.explain(test)(x)
    split_reasons = {str(b.reason).splitlines()[0][:40] for b in split.break_reasons}
    # explain only sees the frame it starts in: count every graph break dynamo
    # takes over a few training steps too (fastddp's frames before this
    # module existed: 23 in 3 steps, in the reducer and the forward's Python)
    from torch._dynamo.utils import counters

    _fresh_dynamo()
    counters.clear()
    run = torch.compile(test, backend="aot_eager")
    for step in range(3):
        x, y = _batch(rank, step)
        _loss(run(x), y).backward()
    breaks = {k.splitlines()[0]: v for k, v in counters["graph_break"].items()}
    return ex.graph_count, ex.graph_break_count, reasons, split.graph_count, sorted(split_reasons), breaks


# --------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------

def test_no_graph_breaks_from_fastddp(world2):
    for graphs, breaks, reasons, split_graphs, split_reasons, train_breaks in world2.run(_explain_run, "mlp"):
        assert (graphs, breaks) == (1, 0), f"fastddp's forward breaks the graph: {reasons}"
        assert not train_breaks, f"graph breaks while training: {train_breaks}"
        assert split_graphs > 1, "DDPOptimizer did not split the graph at bucket boundaries"
        assert all(r.startswith("DDPOptimizer") for r in split_reasons), split_reasons


@pytest.mark.parametrize("model", ["mlp", "block", "convbn"])
def test_compile_aot_eager_bitwise(world2, model):
    world2.run(_compiled_run, model, "compile", dict(bucket_cap_mb=CAP))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "convbn"])
def test_compiled_autograd_bitwise(world2, model):
    world2.run(_compiled_run, model, "ca", dict(bucket_cap_mb=CAP))


@pytest.mark.slow
def test_compile_and_compiled_autograd(world2):
    world2.run(_compiled_run, "mlp", "both", dict(bucket_cap_mb=CAP))


@pytest.mark.parametrize("case,kwargs,run_kwargs", [
    ("no_sync", dict(bucket_cap_mb=CAP), dict(no_sync_micro=2)),
    ("static_graph", dict(bucket_cap_mb=CAP, static_graph=True), {}),
    ("bucket_view", dict(bucket_cap_mb=CAP, gradient_as_bucket_view=True), dict(set_to_none=False)),
    # fastddp's fused fp16 path scales by 1/W before the cast, torch's hook after
    # the fp16 sum (DESIGN.md contract 3): equal to fp16 rounding, not bitwise
    ("fp16_hook", dict(bucket_cap_mb=CAP), dict(hook="fp16", tol=dict(rtol=2e-3, atol=1e-5))),
    ("find_unused", dict(bucket_cap_mb=CAP, find_unused_parameters=True), dict(steps=4)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_compile_options(world2, case, kwargs, run_kwargs):
    model = "branch" if case == "find_unused" else "mlp"
    world2.run(_compiled_case, model, "compile", kwargs, run_kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "block"])
def test_compile_inductor(world2, model):
    world2.run(_compiled_case, model, "compile", dict(bucket_cap_mb=CAP),
               dict(backend="inductor", steps=2, tol=INDUCTOR_TOL), timeout=600)


@pytest.mark.parametrize("mode", ["eager", "compile", "ca"])
def test_buckets_issued_before_last_gradient(world2, mode):
    res = world2.run(_overlap_run, mode)
    for rank_res in res:
        for step, (before, n_buckets, nodes) in enumerate(rank_res):
            if step == 0:
                continue  # the first step reduces one bucket (buckets are rebuilt after it)
            assert n_buckets > 2, rank_res
            assert before is not None and before >= n_buckets - 2, (
                f"{mode}: only {before} of {n_buckets} buckets issued before the last gradient: {rank_res}")
            if mode == "compile":
                assert nodes > 1, f"the compiled graph was not split: {rank_res}"


def test_unsplit_graph_issues_nothing_early(world2):
    """The probe's negative control: with DDPOptimizer off the compiled
    backward is one node and no bucket can go before it ends."""
    for rank_res in world2.run(_overlap_run, "compile", 3, "aot_eager", False):
        for before, n_buckets, nodes in rank_res[1:]:
            assert nodes == 1 and before == 0, rank_res
