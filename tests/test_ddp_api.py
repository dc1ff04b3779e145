"""The drop-in surface: names, state_dict, pickling, train/eval, attributes.

Each test runs inside the W=2 harness and compares the class under test with
torch's own DDP built on the same model in the same process group.  The last
tests check the harness itself (a failing rank is reported with its
traceback; a hung rank is killed and the world respawned).
"""

from __future__ import annotations

import copy
import io
import time

import pytest
import torch
from torch import nn

from tests._dist import ddp_class, torch_ddp_accepts, torch_ddp_class, torch_reference, world2  # noqa: F401
from tests._models import D_IN, D_OUT, HID, loss_fn, make_batch, make_model
from tests._compare import compare_grads, compare_state
from tests._parity import side_by_side

pytestmark = pytest.mark.timeout(300)


def _pair(model_name, rank=0, **kw):
    """(torch DDP, DDP under test, their modules): same weights, same options."""
    m_ref = make_model(model_name, seed=11)
    m_test = copy.deepcopy(m_ref)
    return torch_reference(m_ref, **kw), ddp_class()(m_test, **kw), m_ref, m_test


def _step_both(ref, test, model_name, rank, step, where):
    x, y = make_batch(model_name, rank, step)
    lr_ = loss_fn(ref(x, step=step, rank=rank), y)
    lr_.backward()
    lt_ = loss_fn(test(x, step=step, rank=rank), y)
    lt_.backward()
    assert torch.equal(lr_, lt_), f"{where}: loss differs"
    compare_grads(ref, test, where)


# --------------------------------------------------------------------------
# names and identity
# --------------------------------------------------------------------------

def _names_body(rank, world_size, model_name):
    ref, test, m_ref, m_test = _pair(model_name)
    assert isinstance(test, nn.Module)
    assert test.module is m_test, ".module must be the wrapped module itself"
    assert [n for n, _ in test.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in test.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert [n for n, _ in test.named_modules()][1:] == [n for n, _ in ref.named_modules()][1:]
    # parameters() are the module's own Parameter objects (optimizers hold them)
    tp, mp = list(test.parameters()), list(m_test.parameters())
    assert len(tp) == len(mp) and all(a is b for a, b in zip(tp, mp))
    assert all(n.startswith("module.") for n, _ in test.named_parameters())
    assert list(test.state_dict()) == list(ref.state_dict())
    assert all(k.startswith("module.") for k in test.state_dict())
    assert list(test.module.state_dict()) == list(ref.module.state_dict())
    return len(tp)


@pytest.mark.parametrize("model_name", ["tied", "bn", "frozen", "mixed"])
def test_names_and_module(world2, model_name):
    world2.run(_names_body, model_name)


def _torch_attr(ref, name):
    """torch's value of ``name``; a torch without ``forward_sync_buffers``
    (2.11) has no such attribute: in 2.13 it is what ``broadcast_buffers``
    reads (a property over it)."""
    if name == "forward_sync_buffers" and not torch_ddp_accepts(name):
        return ref.broadcast_buffers
    return getattr(ref, name)


def _attrs_body(rank, world_size, kwargs):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref, test, _, _ = _pair("mlp", **kwargs)
    out = {}
    for name in ("device_ids", "output_device", "dim", "find_unused_parameters",
                 "gradient_as_bucket_view", "static_graph", "broadcast_buffers",
                 "forward_sync_buffers", "require_backward_grad_sync",
                 "require_forward_param_sync"):
        assert hasattr(test, name), f"torch DDP has attribute {name!r}; the class under test lacks it"
        want = _torch_attr(ref, name)
        assert getattr(test, name) == want, f"{name}: torch {want!r}, test {getattr(test, name)!r}"
        out[name] = getattr(test, name)
    assert test.process_group == ref.process_group
    return out


@pytest.mark.parametrize("kwargs", [
    {},
    dict(find_unused_parameters=True, gradient_as_bucket_view=True),
    dict(static_graph=True),
    dict(broadcast_buffers=False),
    dict(forward_sync_buffers=False),
], ids=["default", "find_unused_view", "static", "broadcast_buffers_false", "forward_sync_false"])
def test_public_attributes(world2, kwargs):
    world2.run(_attrs_body, kwargs)


# --------------------------------------------------------------------------
# state_dict / load_state_dict
# --------------------------------------------------------------------------

def _state_dict_body(rank, world_size):
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
    ref, test, m_ref, m_test = _pair("bn")
    sr, st = ref.state_dict(), test.state_dict()
    assert list(sr) == list(st)
    for k in sr:
        assert torch.equal(sr[k], st[k]), k
    # load a different state (as from a checkpoint) into both
    other = make_model("bn", seed=99)
    sd = {f"module.{k}": v.clone() for k, v in other.state_dict().items()}
    res_r = ref.load_state_dict(sd)
    res_t = test.load_state_dict(sd)
    assert tuple(res_t.missing_keys) == tuple(res_r.missing_keys) == ()
    assert tuple(res_t.unexpected_keys) == tuple(res_r.unexpected_keys) == ()
    compare_state(ref, test, "after load_state_dict")
    for k, v in test.module.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    # keys without the prefix are refused like torch refuses them
    with pytest.raises(RuntimeError):
        test.load_state_dict(other.state_dict())
    # round trip into a plain module
    sd_t = copy.deepcopy(test.state_dict())
    consume_prefix_in_state_dict_if_present(sd_t, "module.")
    plain = make_model("bn", seed=5)
    plain.load_state_dict(sd_t)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, test.module.state_dict()[k]), k
    # training after loading still matches torch (the reducer sees the same params)
    for step in range(2):
        _step_both(ref, test, "bn", rank, step, f"rank {rank} step {step} after load_state_dict")
        for p in list(ref.parameters()) + list(test.parameters()):
            p.grad = None
    return True


def test_state_dict_round_trip(world2):
    world2.run(_state_dict_body)


# --------------------------------------------------------------------------
# pickling: torch.save / torch.load / copy.deepcopy of the wrapper
# --------------------------------------------------------------------------

def _pickle_body(rank, world_size, how):
    ref, test, _, _ = _pair("mlp")
    _step_both(ref, test, "mlp", rank, 0, "before pickling")
    if how == "torch.save":
        clones = []
        for obj in (ref, test):
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            clones.append(torch.load(buf, weights_only=False))
        ref2, test2 = clones
    else:
        ref2, test2 = copy.deepcopy(ref), copy.deepcopy(test)
    assert type(test2) is type(test)
    assert test2.module is not test.module
    compare_state(ref2, test2, f"after {how}")
    for p in list(ref2.parameters()) + list(test2.parameters()):
        p.grad = None
    # the re-created wrapper trains and still matches torch's re-created one
    for step in range(1, 3):
        _step_both(ref2, test2, "mlp", rank, step, f"rank {rank} step {step} after {how}")
        for p in list(ref2.parameters()) + list(test2.parameters()):
            p.grad = None
    return True


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_pickle_round_trip(world2, how):
    world2.run(_pickle_body, how)


# --------------------------------------------------------------------------
# train() / eval(), forward under no_grad between training steps
# --------------------------------------------------------------------------

def _train_eval_body(rank, world_size):
    ref, test, m_ref, m_test = _pair("bn")
    assert test.train() is test and test.eval() is test
    for ddp, m in ((ref, m_ref), (test, m_test)):
        ddp.eval()
        assert not ddp.training and not any(mod.training for mod in m.modules())
    x, _ = make_batch("bn", rank, 0)
    with torch.no_grad():
        out_r, out_t = ref(x), test(x)
    assert torch.equal(out_r, out_t), "eval-mode outputs differ"
    compare_state(ref, test, "after eval forward")
    for ddp, m in ((ref, m_ref), (test, m_test)):
        ddp.train()
        assert ddp.training and all(mod.training for mod in m.modules())
    for step in range(3):
        _step_both(ref, test, "bn", rank, step, f"rank {rank} train step {step}")
        for p in list(ref.parameters()) + list(test.parameters()):
            p.grad = None
        # a validation forward under no_grad in the middle of training must not
        # leave a pending reduction behind (torch allows it)
        with torch.no_grad():
            xv, _ = make_batch("bn", rank, 100 + step)
            assert torch.equal(ref(xv), test(xv))
    compare_state(ref, test, "after train/eval/no_grad sequence")
    return True


def test_train_eval_and_no_grad_forward(world2):
    world2.run(_train_eval_body)


# --------------------------------------------------------------------------
# forward: kwargs and nested output structures pass through unchanged
# --------------------------------------------------------------------------

class StructNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, HID)
        self.b = nn.Linear(HID, D_OUT)
        self.c = nn.Linear(HID, D_OUT)

    def forward(self, x, *, scale=1.0, step=0, rank=0):
        h = torch.relu(self.a(x)) * scale
        return {"out": self.b(h), "aux": (self.c(h), [h.sum()])}


def _struct_body(rank, world_size, kwargs):
    torch.manual_seed(5)
    m_ref = StructNet()
    m_test = copy.deepcopy(m_ref)
    ref = torch_reference(m_ref, **kwargs)
    test = ddp_class()(m_test, **kwargs)
    for step in range(3):
        x, y = make_batch("mlp", rank, step)
        outs = []
        for ddp in (ref, test):
            o = ddp(x, scale=0.5 + step)
            assert isinstance(o, dict) and list(o) == ["out", "aux"]
            assert isinstance(o["aux"], tuple) and isinstance(o["aux"][1], list)
            loss = loss_fn(o["out"], y) + loss_fn(o["aux"][0], y) + 1e-3 * o["aux"][1][0]
            loss.backward()
            outs.append(o)
        assert torch.equal(outs[0]["out"], outs[1]["out"])
        compare_grads(ref, test, f"rank {rank} step {step}")
        for p in list(ref.parameters()) + list(test.parameters()):
            p.grad = None
    return True


@pytest.mark.parametrize("kwargs", [{}, dict(find_unused_parameters=True)],
                         ids=["default", "find_unused"])
def test_forward_structures_and_kwargs(world2, kwargs):
    world2.run(_struct_body, kwargs)


# --------------------------------------------------------------------------
# require_backward_grad_sync (what no_sync toggles; some libraries set it)
# --------------------------------------------------------------------------

def _grad_sync_attr_body(rank, world_size):
    ref, test, _, _ = _pair("mlp")
    for step in range(3):
        sync = step == 2
        for ddp in (ref, test):
            ddp.require_backward_grad_sync = sync
        x, y = make_batch("mlp", rank, step)
        loss_fn(ref(x), y).backward()
        loss_fn(test(x), y).backward()
        compare_grads(ref, test, f"rank {rank} step {step} (require_backward_grad_sync={sync})")
    return True


def test_require_backward_grad_sync_attribute(world2):
    world2.run(_grad_sync_attr_body)


# --------------------------------------------------------------------------
# init_sync=False and _ddp_params_and_buffers_to_ignore
# --------------------------------------------------------------------------

def _init_sync_false_body(rank, world_size):
    m_ref = make_model("bn", seed=3 + rank)  # different weights on each rank
    m_test = copy.deepcopy(m_ref)
    ref = torch_ddp_class()(m_ref, init_sync=False)
    test = ddp_class()(m_test, init_sync=False)
    compare_state(ref, test, "after construction with init_sync=False")
    fresh = make_model("bn", seed=3 + rank)
    for k, v in fresh.state_dict().items():
        assert torch.equal(test.module.state_dict()[k], v), f"init_sync=False must not touch {k}"
    return True


def test_init_sync_false_keeps_local_state(world2):
    world2.run(_init_sync_false_body)


class IgnoredNet(nn.Module):
    """``fc1.weight`` and ``bn.running_mean`` are excluded from DDP."""
    _ddp_params_and_buffers_to_ignore = ["fc1.weight", "bn.running_mean"]

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HID)
        self.bn = nn.BatchNorm1d(HID)
        self.fc2 = nn.Linear(HID, D_OUT)

    def forward(self, x, step=0, rank=0):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _ignored_body(rank, world_size):
    def build():
        torch.manual_seed(21)
        m = IgnoredNet()
        with torch.no_grad():  # rank-local values for the ignored entries
            m.fc1.weight.add_(0.1 * rank)
            m.bn.running_mean.add_(1.0 + rank)
            m.bn.running_var.add_(1.0 + rank)
        return m

    # the ignored entries stay local: compared with torch's after construction
    # and after every step, and not the same on every rank
    run = side_by_side(rank, world_size, build, steps=3, optim=dict(lr=0.1), check_synced=False,
                       batch=lambda step, micro: make_batch("mlp", rank, step, micro))
    return run.checks == 3


def test_params_and_buffers_to_ignore(world2):
    assert world2.run(_ignored_body) == [True, True]


# --------------------------------------------------------------------------
# the harness itself
# --------------------------------------------------------------------------

def _return_tensors(rank, world_size):
    return {"rank": rank, "ws": world_size, "t": torch.full((3,), float(rank)),
            "threads": torch.get_num_threads(), "pg": torch.distributed.is_initialized()}


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _sleep_on_rank0(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    return rank


def test_harness_results(world2):
    res = world2.run(_return_tensors)
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["ws"] == 2 and r["threads"] == 1 and r["pg"] for r in res)
    assert torch.equal(res[1]["t"], torch.ones(3))


def test_harness_reports_failing_rank_and_recovers(world2):
    with pytest.raises(AssertionError) as ei:
        world2.run(_fail_on_rank1)
    msg = str(ei.value)
    assert "rank 1" in msg and "boom on rank 1" in msg and "ValueError" in msg
    assert world2.run(_return_tensors)[0]["rank"] == 0  # the next call works


def test_harness_timeout_kills_and_respawns(world2):
    spawns = world2.spawns
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="timed out"):
        world2.run(_sleep_on_rank0, 60, timeout=3)
    assert time.monotonic() - t0 < 20
    assert world2.run(_return_tensors)[1]["rank"] == 1
    assert world2.spawns == spawns + 1


def test_harness_runs_module_functions_only(world2):
    with pytest.raises(TypeError):
        world2.run(lambda rank, ws: rank)
