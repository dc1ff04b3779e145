"""fastddp's class as torch's class: ``isinstance``, both ways of swapping
torch's name, and torch DDP's remaining methods (fastddp/surface.py).

* Both swap styles (the re-export ``torch.nn.parallel.DistributedDataParallel``
  only, and also the definition ``torch.nn.parallel.distributed.
  DistributedDataParallel``), with ``torch._dynamo`` imported before the swap
  (as Lightning, accelerate and transformers do) and after it: eager training
  and ``torch.compile`` train with torch's DDP's gradients, and dynamo sees
  the fastddp module as the active DDP module through either name.
* Every name in torch's class dictionary is fastddp's own, inherited on
  purpose (``surface.INHERITED``) or a clear ``NotImplementedError``
  (``surface.TORCH_INTERNALS``).
* ``gather``, ``scatter``, ``to_kwargs``, ``_set_params_and_buffers_to_
  ignore_for_model``, ``_register_fused_optim`` and friends against torch's DDP.
"""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastddp
from fastddp import surface
from fastddp._torch_ddp import TorchDDP
from tests._dist import STAND_IN, single_rank_group, world2  # noqa: F401
from tests.test_compile import count_nodes
from tests._compare import compare_grads, compare_state

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(STAND_IN, reason="about fastddp's class itself")]

FastDDP = fastddp.DistributedDataParallel
D = 32
CAP = 0.005  # ~1 layer per bucket: several buckets, so dynamo's split is visible


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.hidden = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.out = nn.Linear(D, 4)
        self.seen_active = []  # (torch's class, the swapped name) active module, eager only

    def forward(self, x):
        if not torch.compiler.is_compiling():
            import torch.nn.parallel.distributed as tnpd

            self.seen_active.append((TorchDDP._get_active_ddp_module(),
                                     tnpd.DistributedDataParallel._get_active_ddp_module()))
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


def _model(seed=3):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _MLP()


def _batch(rank, step):
    g = torch.Generator().manual_seed(rank * 7919 + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


# --------------------------------------------------------------------------
# swap styles, eager and compile
# --------------------------------------------------------------------------

def _swap_body(rank, world_size, style, mode, dynamo_first):
    import torch.nn.parallel as tnp
    import torch.nn.parallel.distributed as tnpd

    if dynamo_first:
        import torch._dynamo  # noqa: F401  (frameworks import it before any DDP is built)
    saved = tnp.DistributedDataParallel, tnpd.DistributedDataParallel
    try:
        tnp.DistributedDataParallel = FastDDP
        if style == "definition":
            tnpd.DistributedDataParallel = FastDDP
        import torch._dynamo

        torch._dynamo.reset()
        m_test = _model()
        m_ref = copy.deepcopy(m_test)
        test = torch.nn.parallel.DistributedDataParallel(m_test, bucket_cap_mb=CAP)
        assert type(test) is FastDDP
        assert isinstance(test, saved[0]) and isinstance(test, tnpd.DistributedDataParallel)
        ref = TorchDDP(m_ref, bucket_cap_mb=CAP)  # torch's own, in the same group, swapped or not
        run = torch.compile(test, backend="aot_eager") if mode == "compile" else test
        opt_t = torch.optim.SGD(test.parameters(), lr=0.05, momentum=0.9)
        opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        nodes = []
        for step in range(3):
            x, y = _batch(rank, step)
            loss = ((run(x) - y) ** 2).mean()
            nodes.append(count_nodes(loss, "CompiledFunction"))
            loss.backward()
            ((ref(x) - y) ** 2).mean().backward()
            compare_grads(ref, test, f"rank {rank} step {step} ({style}, {mode})")
            opt_t.step()
            opt_r.step()
            opt_t.zero_grad()
            opt_r.zero_grad()
        compare_state(ref, test, f"rank {rank} ({style}, {mode})")
        # the slot is torch's class's only: fastddp's class never shadows it
        assert "_active_ddp_module" not in FastDDP.__dict__
        assert TorchDDP._active_ddp_module is None
        seen = [(a is test, b is test) for a, b in m_test.seen_active]
        return seen, nodes
    finally:
        tnp.DistributedDataParallel, tnpd.DistributedDataParallel = saved


@pytest.mark.parametrize("dynamo_first", [True, False], ids=["dynamo-imported-first", "dynamo-after"])
@pytest.mark.parametrize("style", ["reexport", "definition"])
def test_swap_eager(world2, style, dynamo_first):
    for seen, _ in world2.run(_swap_body, style, "eager", dynamo_first):
        # dynamo's protocol: the fastddp module is the active DDP module, by either name
        assert seen and all(a and b for a, b in seen), seen


@pytest.mark.parametrize("style", ["reexport", "definition"])
def test_swap_compile(world2, style):
    for _, nodes in world2.run(_swap_body, style, "compile", True):
        # DDPOptimizer split the compiled graph at fastddp's buckets
        assert all(n > 1 for n in nodes), f"compiled backward nodes per step: {nodes}"


def test_torch_ddp_run_after_definition_swap_keeps_the_slot():
    """torch's own forward sets the slot through its module-level name; when
    that name is fastddp's class the assignment still lands on torch's."""
    import torch.nn.parallel.distributed as tnpd

    saved = tnpd.DistributedDataParallel
    try:
        tnpd.DistributedDataParallel = FastDDP
        marker = object()
        FastDDP._active_ddp_module = marker  # what torch's _inside_ddp_forward does by name
        assert TorchDDP._active_ddp_module is marker and "_active_ddp_module" not in FastDDP.__dict__
        FastDDP._active_ddp_module = None
        assert TorchDDP._active_ddp_module is None
    finally:
        tnpd.DistributedDataParallel = saved


def test_real_class_found_after_a_swap_at_import():
    """fastddp imported (again) while torch's name already points at it: the
    held class is still torch's."""
    code = textwrap.dedent("""
        import torch.nn.parallel.distributed as tnpd
        real = tnpd.DistributedDataParallel
        import fastddp
        tnpd.DistributedDataParallel = fastddp.DistributedDataParallel
        import importlib, fastddp._torch_ddp as h
        importlib.reload(h)
        assert h.TorchDDP is real, h.TorchDDP
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --------------------------------------------------------------------------
# isinstance and torch's class surface
# --------------------------------------------------------------------------

def test_isinstance_of_torch_class():
    assert issubclass(FastDDP, torch.nn.parallel.DistributedDataParallel)
    assert issubclass(FastDDP, torch.nn.parallel.distributed.DistributedDataParallel)
    from torch.distributed.algorithms.join import Joinable

    assert issubclass(FastDDP, Joinable)


_NOT_METHODS = {"__module__", "__doc__", "__dict__", "__weakref__", "__annotations__", "__init__",
                "__getstate__", "__setstate__", "__abstractmethods__", "_abc_impl", "__slots__",
                "__firstlineno__", "__static_attributes__", "__qualname__", "__parameters__",
                "__orig_bases__", "__annotate_func__", "__annotations_cache__"}


def _own(name: str) -> bool:
    """Defined by fastddp (its class or a mixin before torch's in the MRO)."""
    for cls in FastDDP.__mro__:
        if cls is TorchDDP:
            return False
        if name in cls.__dict__ and not (cls is surface.TorchSurface and name in surface.TORCH_INTERNALS):
            return True
    return False


def test_every_torch_method_is_ours_inherited_on_purpose_or_refused():
    names = [n for n in vars(TorchDDP) if n not in _NOT_METHODS]
    unaccounted = [n for n in names if not _own(n) and n not in surface.INHERITED
                   and n not in surface.TORCH_INTERNALS]
    assert not unaccounted, (
        f"torch {torch.__version__}'s DistributedDataParallel has {unaccounted}, which fastddp neither "
        "defines, nor inherits on purpose (surface.INHERITED), nor refuses (surface.TORCH_INTERNALS)")
    # the lists do not rot: each name exists on this torch (or on a newer one: none yet)
    for n in list(surface.INHERITED) + list(surface.TORCH_INTERNALS):
        assert n in vars(TorchDDP), f"{n} is listed but torch {torch.__version__} has no such member"
    for n in surface.INHERITED:
        assert not _own(n), f"{n} is listed as inherited but fastddp defines it"


def test_constructor_signature_equals_torch():
    ours = inspect.signature(FastDDP.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    for name, p in theirs.items():
        assert name in ours, f"torch's DDP takes {name!r}, fastddp does not"
        assert ours[name].default == p.default or name in ("broadcast_buffers", "forward_sync_buffers"), name


def test_torch_internals_raise_clear_errors(tmp_path):
    with single_rank_group(tmp_path):
        ddp = FastDDP(nn.Linear(4, 4))
        for name, what in surface.TORCH_INTERNALS.items():
            with pytest.raises(NotImplementedError, match=rf"DistributedDataParallel\.{name}\(\)") as e:
                getattr(ddp, name)()
            assert what in str(e.value)


def _same_outcome(f, g):
    """Both calls give equal results, or both raise the same error (torch's
    gather and scatter refuse CPU tensors: fastddp must refuse them alike)."""
    def call(fn):
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - the outcome under comparison
            return None, (type(e), str(e))

    (a, ea), (b, eb) = call(f), call(g)
    assert ea == eb, (ea, eb)
    flat_a, flat_b = torch.utils._pytree.tree_flatten(a)[0], torch.utils._pytree.tree_flatten(b)[0]
    assert len(flat_a) == len(flat_b)
    for p, q in zip(flat_a, flat_b):
        assert torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q
    return ea


def test_public_helpers_match_torch(tmp_path):
    """gather / scatter / to_kwargs: torch's results or torch's errors (CPU, world 1)."""
    with single_rank_group(tmp_path):
        ours, theirs = FastDDP(nn.Linear(4, 4)), TorchDDP(nn.Linear(4, 4))
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        assert _same_outcome(lambda: ours.to_kwargs((x,), {"y": y}, 0),
                             lambda: theirs.to_kwargs((x,), {"y": y}, 0)) is None
        for dim in (0, 1):
            ours.dim = theirs.dim = dim
            outs = [torch.randn(3, 4), torch.randn(3, 4)]
            _same_outcome(lambda: ours.gather(outs, -1), lambda: theirs.gather(outs, -1))
            _same_outcome(lambda: ours.gather([outs[0]], -1), lambda: theirs.gather([outs[0]], -1))
            for ids in ([None], [0], []):
                _same_outcome(lambda: ours.scatter((x,), {"y": y}, ids),
                              lambda: theirs.scatter((x,), {"y": y}, ids))


def test_inherited_helpers_work_without_torch_constructor(tmp_path):
    with single_rank_group(tmp_path):
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        ddp = FastDDP(m)
        assert ddp._distributed_rank == 0
        ddp._check_default_group()  # default group: no error
        params = list(ddp.parameters())
        mapping = ddp._build_debug_param_to_name_mapping(params)
        assert mapping == {i: n for i, n in enumerate(["0.weight", "0.bias", "1.weight", "1.bias",
                                                       "2.weight", "2.bias"])}
        assert list(FastDDP._get_data_parallel_params(m)) == list(m.parameters())
        assert list(ddp._get_parameters(m)) == list(m.parameters())
        assert ddp.train(False) is ddp and not m.training
        ddp._default_broadcast_coalesced()  # world 1: buffers unchanged, no error
        ddp._set_ddp_runtime_logging_sample_rate(5)
        with pytest.raises(ValueError, match="sample rate"):
            ddp._set_ddp_runtime_logging_sample_rate(0)
        with pytest.raises(ValueError, match="Communication hook: bucket annotation"):
            def hook(state, bucket: int) -> torch.futures.Future[torch.Tensor]: ...
            ddp._check_comm_hook(hook)


def test_syncbatchnorm_on_cpu_refused_like_torch(tmp_path):
    with single_rank_group(tmp_path):
        m = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
        with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
            TorchDDP(copy.deepcopy(m))
        with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
            FastDDP(m)


def test_optimizer_in_backward_refused(tmp_path):
    """Its optimizer would step on the local, unaveraged gradient: a clear error."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    with single_rank_group(tmp_path):
        m = nn.Linear(4, 4)
        _apply_optimizer_in_backward(torch.optim.SGD, m.parameters(), {"lr": 0.1})
        with pytest.raises(NotImplementedError, match=r"'weight' has an optimizer applied in backward"):
            FastDDP(m)


class _Keeps(nn.Linear):
    def forward(self, x):
        self.last = super().forward(x)
        return self.last


def test_sink_clone_switch(tmp_path):
    """_set_ddp_sink_clone(False): outputs through the find_unused sink are no
    longer copied (torch's switch); gradients are unchanged."""
    with single_rank_group(tmp_path):
        m = _Keeps(4, 4)
        ref = copy.deepcopy(m)
        ddp = FastDDP(m, find_unused_parameters=True)
        x = torch.randn(3, 4)
        out = ddp(x)
        assert out.data_ptr() != m.last.data_ptr()  # cloned by default, as torch
        out.sum().backward()
        ddp._set_ddp_sink_clone(False)
        ddp.zero_grad()
        out = ddp(x)
        assert out.data_ptr() == m.last.data_ptr()
        out.sum().backward()
        ref(x).sum().backward()
        assert torch.equal(m.weight.grad, ref.weight.grad)


def test_check_reducer_finalized_raises_torch_error(tmp_path):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x)

    with single_rank_group(tmp_path):
        ddp = FastDDP(TwoHeads())
        ddp._check_reducer_finalized()  # nothing pending
        ddp(torch.randn(2, 4)).sum().backward()  # b unused: reduction unfinished
        with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
            ddp._check_reducer_finalized()


# --------------------------------------------------------------------------
# against torch's DDP at W=2
# --------------------------------------------------------------------------

def _ignore_body(rank, world_size, via):
    m_test = _model()
    m_ref = copy.deepcopy(m_test)
    names = ["hidden.1.weight", "hidden.1.bias"]
    for m in (m_test, m_ref):
        # frameworks call it on the class they build DDP with
        (FastDDP if via == "fastddp" else TorchDDP)._set_params_and_buffers_to_ignore_for_model(m, names)
    test, ref = FastDDP(m_test), TorchDDP(m_ref)
    assert test.parameters_to_ignore == set(names)
    for step in range(2):
        x, y = _batch(rank, step)
        for ddp in (test, ref):
            ((ddp(x) - y) ** 2).mean().backward()
        compare_grads(ref, test, f"rank {rank} step {step}")
        for ddp in (test, ref):
            ddp.zero_grad()
    return True


@pytest.mark.parametrize("via", ["fastddp", "torch"])
def test_params_to_ignore_for_model_matches_torch(world2, via):
    assert all(world2.run(_ignore_body, via))


def _fused_optim_body(rank, world_size):
    m_test = _model()
    m_ref = copy.deepcopy(m_test)
    test, ref = FastDDP(m_test, bucket_cap_mb=CAP), TorchDDP(m_ref, bucket_cap_mb=CAP)
    for ddp in (test, ref):
        ddp._register_fused_optim(torch.optim.SGD, 0.1, momentum=0.9)
    for step in range(3):
        x, y = _batch(rank, step)
        for ddp in (test, ref):
            ((ddp(x) - y) ** 2).mean().backward()  # the optimizer steps inside the hook
        compare_state(ref, test, f"rank {rank} step {step} (fused optimizer)")
    return True


def test_register_fused_optim_matches_torch(world2):
    assert all(world2.run(_fused_optim_body))


def _join_surface_body(rank, world_size):
    """torch's join helper methods, on fastddp's reducer: the ranks agree."""
    ddp = FastDDP(_model())
    common = ddp._find_common_rank(dist.get_rank(), rank == 1)
    flag = ddp._check_global_requires_backward_grad_sync(is_joined_rank=(rank == 0))
    return common, flag


def test_join_helpers(world2):
    (c0, f0), (c1, f1) = world2.run(_join_surface_body)
    assert c0 == c1 == 1
    assert f0 is True and f1 is None  # rank 0 (joined) learns that rank 1 still syncs


# --------------------------------------------------------------------------
# the forward's buffer broadcast: skipped where the group has one rank
# --------------------------------------------------------------------------

def _broadcasts_per_forward(rank=0, world=1):
    """Three forwards of a BatchNorm model on the same batch on every rank:
    how many ``dist._broadcast_coalesced`` calls they made, and the running
    mean after each (the ranks other than 0 perturb theirs before each
    forward: the broadcast puts rank 0's back, so every rank ends equal)."""
    from unittest import mock

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ddp = fastddp.DistributedDataParallel(m)
    real = dist._broadcast_coalesced
    calls, means = [], []
    with mock.patch.object(dist, "_broadcast_coalesced", side_effect=lambda *a: calls.append(1) or real(*a)):
        for step in range(3):
            if rank:
                m[1].running_mean.add_(1.0)
            ddp(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
            means.append(m[1].running_mean.clone())
    return len(calls), means


@pytest.mark.skipif(STAND_IN, reason="fastddp's forward")
def test_one_rank_forward_broadcasts_no_buffers(tmp_path):
    with single_rank_group(tmp_path):
        n, means = _broadcasts_per_forward()
    assert n == 0  # from the one rank to itself: nothing to move


@pytest.mark.skipif(STAND_IN, reason="fastddp's forward")
def test_two_ranks_forward_broadcasts_buffers(world2):
    (n0, m0), (n1, m1) = world2.run(_broadcasts_per_forward)
    assert n0 == n1 == 3
    assert all(torch.equal(a, b) for a, b in zip(m0, m1))  # rank 0's buffers reached rank 1 each time
