"""Drop-in gaps closed: what torch's DDP does that fastddp must do too.

Sparse gradients, Python process groups (and their Work subclasses), complex
parameters, static_graph with a non-reentrant checkpoint around the whole
module, comm-hook annotation checks, torch's error sentences.  Parity is
checked against torch's DDP in the same process group, bit for bit (W=2).
"""

from __future__ import annotations

import copy
import datetime
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._dist import STAND_IN, ddp_class, fastddp_only, torch_ddp_class, world2  # noqa: F401
from tests._models import loss_fn, make_batch, make_model
from tests._parity import side_by_side

pytestmark = pytest.mark.timeout(300)


def _train_pair(rank, model_name, kwargs, steps=3, hook=None, make=None, batch=None, pg=None,
                torch_pg=None):
    """torch DDP and the class under test side by side (:func:`side_by_side`):
    grads compared after every backward, the state after every step."""
    world = dist.get_world_size()
    run = side_by_side(
        rank, world, model_name if make is None else make, kwargs=kwargs, steps=steps, hook=hook,
        ref_kwargs=None if torch_pg is None else {"process_group": torch_pg},
        test_kwargs=None if pg is None else {"process_group": pg},
        batch=None if batch is None else (lambda step, micro: batch(rank, step)))
    return run.checks == steps


# --------------------------------------------------------------------------
# sparse gradients
# --------------------------------------------------------------------------

class _BagNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 6, mode="sum", sparse=True)
        self.emb = nn.Embedding(30, 6, sparse=True)
        self.fc = nn.Linear(6, 4)

    def forward(self, idx):
        return self.fc(self.bag(idx) + self.emb(idx).mean(1))


def _bag_batch(rank, step):
    g = torch.Generator().manual_seed(rank * 101 + step)
    return torch.randint(0, 30, (5, 3), generator=g), torch.randn(5, 4, generator=g)


def _sparse_body(rank, world_size, case):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if case == "emb":
        return _train_pair(rank, "sparse_emb", {})
    if case == "emb_tiny_view":
        return _train_pair(rank, "sparse_emb", dict(bucket_cap_mb=0.0001, gradient_as_bucket_view=True))
    if case == "bag":
        return _train_pair(rank, None, {}, make=_BagNet, batch=_bag_batch)
    if case == "bag_hook":
        return _train_pair(rank, None, {}, make=_BagNet, batch=_bag_batch,
                           hook=(None, default_hooks.allreduce_hook))
    raise ValueError(case)


@pytest.mark.parametrize("case", ["emb", "emb_tiny_view", "bag", "bag_hook"])
def test_sparse_gradients_match_torch(world2, case):
    assert world2.run(_sparse_body, case) == [True, True]


def _sparse_join_body(rank, world_size):
    """Uneven inputs with a sparse module: the joined rank shadows the
    sparse bucket's all-reduce too."""
    torch.manual_seed(0)
    m = make_model("sparse_emb")
    ddp = ddp_class()(m)
    steps = 3 if rank == 0 else 1
    with ddp.join():
        for step in range(steps):
            x, y = make_batch("sparse_emb", rank, step)
            loss_fn(ddp(x), y).backward()
    return m.emb.weight.grad is not None and m.emb.weight.grad.is_sparse


@fastddp_only  # torch's DDP raises in join's shadow all-reduce of a sparse bucket
def test_sparse_gradients_with_join(world2):
    assert world2.run(_sparse_join_body) == [True, True]


# --------------------------------------------------------------------------
# Python process groups
# --------------------------------------------------------------------------

class _PyWork(dist._Work):
    """A Work subclass in Python whose wait() takes a timeout without default
    (as torch's own test groups write it)."""

    def __init__(self, inner, pg):
        super().__init__()
        self.inner = inner
        self.pg = weakref.ref(pg)

    def wait(self, timeout):
        self.pg().waits += 1
        return self.inner.wait()

    def get_future(self):
        return self.inner.get_future()

    def result(self):
        return self.inner.result()


class _WrapperPG(dist.ProcessGroup):
    """A Python process group forwarding to a gloo group (never registered
    with torch.distributed): the shape of fault-tolerant wrappers."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.waits = 0
        self.calls = 0

    def allreduce(self, tensors, opts):
        self.calls += 1
        return _PyWork(self.inner.allreduce(tensors, opts), self)

    def broadcast(self, tensors, opts):
        self.calls += 1
        return _PyWork(self.inner.broadcast(tensors, opts), self)

    def allgather(self, outputs, inputs, opts):
        self.calls += 1
        return _PyWork(self.inner.allgather(outputs, inputs, opts), self)

    def getBackendName(self):
        return "py-wrapper"


def _pypg_body(rank, world_size, kwargs):
    inner = dist.new_group(list(range(world_size)), backend="gloo")
    pg = _WrapperPG(inner)
    ok = _train_pair(rank, "deep", kwargs, pg=pg, torch_pg=pg)
    return ok, pg.waits > 0, pg.calls > 0


@pytest.mark.parametrize("kwargs", [{}, dict(bucket_cap_mb=0.001, gradient_as_bucket_view=True),
                                    dict(find_unused_parameters=True)],
                         ids=["default", "tiny_view", "find_unused"])
def test_python_process_group_matches_torch(world2, kwargs):
    for ok, waited, called in world2.run(_pypg_body, kwargs):
        assert ok and called and waited


class _LonelyWork(dist._Work):
    def __init__(self, result, pg):
        super().__init__()
        self.future_ = torch.futures.Future()
        self.future_.set_result(result)
        self.pg_ = weakref.ref(pg)

    def wait(self, timeout):
        self.pg_().wait_count += 1
        return True

    def get_future(self):
        return self.future_


class _LonelyPG(dist.ProcessGroup):
    """torch's test_c10d_pypg.py shape: one rank, Works that do nothing."""

    def __init__(self):
        super().__init__(0, 1)
        self.wait_count = 0

    def broadcast(self, tensor_list, opts):
        return _LonelyWork(tensor_list, self)

    def allgather(self, outputs, inputs, opts):
        for o, i in zip(outputs[0], inputs):
            o.copy_(i)
        return _LonelyWork(outputs, self)

    def allreduce(self, tensors, opts):
        return _LonelyWork(tensors, self)

    def getBackendName(self):
        return "lonely-pg"


@pytest.mark.parametrize("init_sync", [True, False])
def test_python_process_group_without_default_group(init_sync):
    """No init_process_group at all: DDP calls the group object it is given."""
    assert not dist.is_initialized()
    pg = _LonelyPG()
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    local = copy.deepcopy(model)
    ddp = ddp_class()(model, process_group=pg, init_sync=init_sync)
    x = torch.rand(2)
    for _ in range(2):
        model.zero_grad()
        local.zero_grad()
        ddp(x).sum().backward()
        local(x).sum().backward()
        assert torch.equal(model[0].bias.grad, local[0].bias.grad)
    assert pg.wait_count > 0
    assert ddp._get_ddp_logging_data()["backend_name"] == "lonely-pg"


# --------------------------------------------------------------------------
# complex parameters
# --------------------------------------------------------------------------

class _ComplexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5, dtype=torch.complex64) * 0.3)
        self.b = nn.Parameter(torch.randn(5, dtype=torch.complex64) * 0.1)
        self.fc = nn.Linear(10, 3)

    def forward(self, x):
        z = x.to(torch.complex64) @ self.w + self.b
        return self.fc(torch.cat([z.real, z.imag], dim=-1))


def _complex_batch(rank, step):
    g = torch.Generator().manual_seed(rank * 31 + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _complex_body(rank, world_size, kwargs, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    h = (None, default_hooks.allreduce_hook) if hook else None
    return _train_pair(rank, None, kwargs, make=_ComplexNet, batch=_complex_batch, hook=h)


@pytest.mark.parametrize("kwargs,hook", [({}, False), (dict(bucket_cap_mb=0.0001), False),
                                         (dict(gradient_as_bucket_view=True), False), ({}, True)],
                         ids=["default", "tiny", "view", "allreduce_hook"])
def test_complex_parameters_match_torch(world2, kwargs, hook):
    assert world2.run(_complex_body, kwargs, hook) == [True, True]


# --------------------------------------------------------------------------
# static_graph + non-reentrant checkpoint around the whole module, shared weights
# --------------------------------------------------------------------------

class _SharedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(20, 20)
        self.l2 = nn.Linear(20, 20)

    def forward(self, x):
        return self.l2(self.l2(self.l1(x)))


def _ckpt_whole_body(rank, world_size, kwargs):
    from torch.utils.checkpoint import checkpoint

    def batch(step, micro):
        g = torch.Generator().manual_seed(rank * 7 + step)
        return torch.rand(16, 20, generator=g, requires_grad=True), torch.randn(16, 20, generator=g)

    def step_fn(ddp, x, y, step, is_ref):
        loss = nn.functional.mse_loss(checkpoint(ddp, x, use_reentrant=False), y)
        loss.backward()
        return loss

    run = side_by_side(rank, world_size, _SharedNet, kwargs=dict(bucket_cap_mb=1, **kwargs), steps=4,
                       batch=batch, step_fn=step_fn, optim=None)
    return run.checks == 4


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("find_unused", [False, True])
def test_static_graph_checkpoint_whole_module(world2, view, find_unused):
    kwargs = dict(static_graph=True, gradient_as_bucket_view=view, find_unused_parameters=find_unused)
    assert world2.run(_ckpt_whole_body, kwargs) == [True, True]


# --------------------------------------------------------------------------
# comm hook annotations (torch's checks and sentences)
# --------------------------------------------------------------------------

@pytest.fixture
def pg1(tmp_path):
    from tests._dist import single_rank_group

    with single_rank_group(tmp_path) as pg:
        yield pg


def test_comm_hook_bucket_annotation(pg1):
    def hook(state, bucket: int):
        return None

    ddp = ddp_class()(make_model("mlp"))
    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket"):
        ddp.register_comm_hook(None, hook)


@fastddp_only  # torch's DDP compares annotation objects: string ones (this module's) fail its check
def test_comm_hook_return_annotation(pg1):
    def hook(state, bucket: dist.GradBucket) -> int:
        return None

    ddp = ddp_class()(make_model("mlp"))
    with pytest.raises(ValueError, match="return annotation should be torch.futures.Future"):
        ddp.register_comm_hook(None, hook)


@fastddp_only  # torch's DDP compares annotation objects: string ones (this module's) fail its check
def test_comm_hook_good_annotations_accepted(pg1):
    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    m = make_model("mlp")
    ddp = ddp_class()(m)
    ddp.register_comm_hook(None, hook)
    x, y = make_batch("mlp", 0, 0)
    loss_fn(ddp(x), y).backward()
    assert all(p.grad is not None for p in m.parameters())


# --------------------------------------------------------------------------
# torch's sentences first
# --------------------------------------------------------------------------

class _TwiceNet(nn.Module):
    """``block`` under reentrant checkpointing twice: its AccumulateGrad fires
    twice in one backward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=True)
        h = checkpoint(self.block, h, use_reentrant=True)
        return self.out(h)


def _marked_twice_text_body(rank, world_size):
    m = _TwiceNet()
    ddp = ddp_class()(m)
    try:
        ddp(torch.randn(4, 8)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_marked_twice_starts_with_torch_sentence(world2):
    for msg in world2.run(_marked_twice_text_body):
        assert msg.startswith("Expected to mark a variable ready only once."), msg
        if not STAND_IN:
            assert "block.weight" in msg or "block.bias" in msg, msg


def _static_changed_body(rank, world_size):
    m = make_model("branch_always")
    ddp = ddp_class()(m, static_graph=True)
    msgs = []
    for step in range(4):
        m.schedule = "never" if step < 2 else "always"
        x, y = make_batch("branch_always", rank, step)
        try:
            loss_fn(ddp(x), y).backward()
        except RuntimeError as e:
            msgs.append(str(e))
            break
        for p in m.parameters():
            p.grad = None
    return msgs


@fastddp_only
def test_static_graph_change_names_static_graph(world2):
    for msgs in world2.run(_static_changed_body):
        assert msgs, "a graph change under static_graph=True must raise"
        assert msgs[0].startswith("Your training graph has changed in this iteration"), msgs[0]
        assert "static_graph" in msgs[0] and "branch." in msgs[0], msgs[0]
