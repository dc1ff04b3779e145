"""The reducer on CUDA: gradients equal torch DDP's bit for bit, the comm
stream's plumbing survives a slow comm stream, and each bucket costs one pack
and one unpack launch.  Marked ``gpu`` (skipped without a CUDA device); run by
bench/gpu_check.sh.

* **world 1, NCCL**, in this process: torch DDP against fastddp (default,
  batched, bucket views, tiny buckets), the fused fp16/bf16 hooks against
  their emulation, launches per bucket;
* **world 2 on ONE GPU**: two ranks (tests/_dist.py's gloo harness), both on
  ``cuda:0``, gloo all-reducing CUDA tensors (torch supports it: staged
  through pinned host memory).  W = 2 exercises the scaling rules (torch's
  default multiplies by fp32(1/W) before the SUM, ``batched_grad_copy`` and
  ``allreduce_hook`` divide by W) and fastddp's comm stream against torch's
  DDP on CUDA, bit for bit;
* **slow comm stream**: ``torch.cuda._sleep`` queued on the reducer's comm
  stream (``reducer.comm_stream``) before every gradient's readiness hook, so
  each pack runs long after backward went on; with
  ``gradient_as_bucket_view=True`` and ``zero_grad(set_to_none=True)`` the
  ``.grad`` tensors the pack reads are dropped when the grads become bucket
  views, so if the reducer neither keeps them alive until the compute stream
  waits nor ``record_stream``s them, later backward kernels reuse their memory
  before the pack has read it and the gradients differ from torch's.

torch 2.11's DDP has no ``batched_grad_copy``: there the batched cases
compare with torch's DDP + ``default_hooks.allreduce_hook`` (unscaled copy,
divide by W, SUM: the same rule and bits).

``FASTDDP_GPU_TESTS_ON_CPU=1`` (bench/gpu_check.sh --dry-run) runs the same
world-2 bodies on CPU tensors (gloo), unmarked, as the CPU twin of this file;
the CUDA-only tests skip.
"""

from __future__ import annotations

import copy
import inspect
import os
import tempfile

import pytest
import torch

from tests._compare import mismatch
from tests._dist import world2  # noqa: F401  (module-scoped 2-rank gloo fixture)

ON_CPU = os.environ.get("FASTDDP_GPU_TESTS_ON_CPU", "0") not in ("", "0")
DEVICE = "cpu" if ON_CPU else "cuda"

pytestmark = [pytest.mark.timeout(150)] + ([] if ON_CPU else [pytest.mark.gpu])

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: torch.cuda._sleep spin cycles (~0.25 ms at H200 clocks) queued on the comm
#: stream before each gradient's hook, and once per step before forward.
SLEEP_PER_GRAD = 500_000
SLEEP_PER_STEP = 20_000_000


# ---------------------------------------------------------------- helpers
def torch_has_batched_grad_copy() -> bool:
    return "batched_grad_copy" in inspect.signature(
        torch.nn.parallel.DistributedDataParallel.__init__).parameters


def _device(device: str) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _model(dev: torch.device) -> torch.nn.Module:
    """Linear + LayerNorm + GELU blocks and an odd-sized head (numel 37 * d + 37);
    smaller on CPU, where the twin may run the Triton interpreter."""
    torch.manual_seed(0)
    d, depth = (256, 12) if dev.type == "cuda" else (32, 4)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(d, d), torch.nn.LayerNorm(d), torch.nn.GELU()]
    layers.append(torch.nn.Linear(d, 37))
    return torch.nn.Sequential(*layers).to(dev)


def _batch(dev: torch.device, d: int, rank: int, step: int) -> torch.Tensor:
    """Different data per rank and step; magnitudes vary so the two scaling
    rules round differently where they can."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(16, d, generator=gen) * (4.0 ** (step % 3 - rank))).to(dev)


def _in_features(m: torch.nn.Module) -> int:
    return next(m.parameters()).shape[1]


def _compare_grads(want_model, got_model, where: str) -> int:
    bad = []
    n = 0
    for (name, pw), pg in zip(want_model.named_parameters(), got_model.parameters()):
        why = mismatch(pg.grad, pw.grad)
        n += 1
        if why:
            bad.append(f"  {name}: {why}")
    assert not bad, f"{where}: .grad differs:\n" + "\n".join(bad)
    return n


def _compare_params(want_model, got_model, where: str) -> None:
    bad = [f"  {name}: {why}" for (name, pw), pg in zip(want_model.named_parameters(), got_model.parameters())
           if (why := mismatch(pg.detach(), pw.detach()))]
    assert not bad, f"{where}: parameters differ:\n" + "\n".join(bad)


def _torch_ddp(module, dev, opts: dict):
    """torch's DDP with ``opts``; ``batched_grad_copy`` on a torch without it
    becomes DDP + default_hooks.allreduce_hook (the same rule and bits)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    opts = dict(opts)
    batched = opts.pop("batched_grad_copy", False)
    ids = [dev.index] if dev.type == "cuda" else None
    if batched and torch_has_batched_grad_copy():
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, batched_grad_copy=True, **opts)
    ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, **opts)
    if batched:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


def _fastddp(module, dev, opts: dict, hook: str | None = None):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel

    ddp = DistributedDataParallel(module, device_ids=[dev.index] if dev.type == "cuda" else None, **opts)
    if hook is not None:
        ddp.register_comm_hook(None, getattr(fh, hook))
    return ddp


def _emulated_compress(model, dtype: torch.dtype, world: int) -> None:
    """fastddp's fused compression rule on a plain model's local grads:
    x * fp32(1/W) in fp32, cast (round to nearest even), SUM in ``dtype``
    over the default group, cast back.  At W <= 2 the per-element sum does not
    depend on the bucket layout, so a per-parameter all-reduce gives the bits."""
    import torch.distributed as dist

    scale = 1.0 / world
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            wire = (p.grad * scale).to(dtype)
            if world > 1:
                dist.all_reduce(wire)
            p.grad.copy_(wire)


def _zero(opt, set_to_none: bool) -> None:
    opt.zero_grad(set_to_none=set_to_none)


# ------------------------------------------------------------ world 1, NCCL
@pytest.fixture(scope="module")
def nccl1():
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL")
    path = os.path.join(tempfile.mkdtemp(prefix="fastddp-nccl-"), "pg")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _nccl_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


@needs_cuda
@pytest.mark.parametrize("opts", [{}, {"batched_grad_copy": True}, {"gradient_as_bucket_view": True},
                                  {"bucket_cap_mb": 0.25}, {"bucket_cap_mb": 0.25, "batched_grad_copy": True}],
                         ids=["default", "batched", "view", "tiny", "tiny-batched"])
def test_cuda_grads_equal_torch_ddp(nccl1, opts):
    dev = torch.device("cuda", 0)
    base = _nccl_model()
    a = _torch_ddp(copy.deepcopy(base), dev, opts)
    b = _fastddp(copy.deepcopy(base), dev, opts)
    oa = torch.optim.SGD(a.parameters(), lr=0.01)
    ob = torch.optim.SGD(b.parameters(), lr=0.01)
    for step in range(4):
        x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
        _compare_grads(a, b, f"nccl1 {opts} step {step}")
        oa.step()
        ob.step()
    torch.cuda.synchronize()
    _compare_params(a, b, f"nccl1 {opts}")


# ----------------------------------------------------- world 2, one device
#: name -> (fastddp + torch DDP options, fastddp hook or None)
W2_CASES = {
    "default": ({}, None),
    "batched": ({"batched_grad_copy": True}, None),
    "view": ({"gradient_as_bucket_view": True}, None),
    "view-batched": ({"gradient_as_bucket_view": True, "batched_grad_copy": True}, None),
    "tiny": ({"bucket_cap_mb": 0.05}, None),
    "tiny-batched": ({"bucket_cap_mb": 0.05, "batched_grad_copy": True}, None),
    "allreduce_hook": ({"bucket_cap_mb": 0.05}, "allreduce_hook"),
    "fp16": ({"bucket_cap_mb": 0.05}, "fp16_compress_hook"),
    "bf16": ({"bucket_cap_mb": 0.05}, "bf16_compress_hook"),
    "view-fp16": ({"gradient_as_bucket_view": True}, "fp16_compress_hook"),
}


def _w2_parity(rank, world_size, device, case, steps=4, set_to_none=True):
    """Inside each rank: torch DDP (or, for the fused 16-bit hooks, the
    emulated rule on a plain copy) against fastddp, same data, same order of
    collectives; every .grad compared after every backward, parameters after
    the SGD steps.  Returns (grad checks, kernel backend, launches)."""
    import fastddp.kernels as K
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dev = _device(device)
    opts, hook = W2_CASES[case]
    base = _model(dev)
    d = _in_features(base)
    emulate = {"fp16_compress_hook": torch.float16, "bf16_compress_hook": torch.bfloat16}.get(hook)
    if emulate is not None:
        ref = copy.deepcopy(base)  # no DDP: the rule is applied by hand
    else:
        ref = _torch_ddp(copy.deepcopy(base), dev, opts)
        if hook == "allreduce_hook":
            ref.register_comm_hook(None, default_hooks.allreduce_hook)
    test = _fastddp(copy.deepcopy(base), dev, opts, hook)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_test = torch.optim.SGD(test.parameters(), lr=0.05, momentum=0.9)
    K.reset_launch_count()
    checks = 0
    for step in range(steps):
        x = _batch(dev, d, rank, step)
        _zero(opt_ref, set_to_none)
        ref(x).square().mean().backward()
        if emulate is not None:
            _emulated_compress(ref, emulate, world_size)
        _zero(opt_test, set_to_none)
        test(x).square().mean().backward()
        checks += _compare_grads(ref, test, f"rank {rank} {case} step {step}")
        opt_ref.step()
        opt_test.step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    _compare_params(ref, test, f"rank {rank} {case} after {steps} steps")
    return checks, K.backend(dev), K.launch_count()


@pytest.mark.parametrize("case", list(W2_CASES))
def test_w2_one_device_grads_equal_torch_ddp(world2, case):
    n_params = (12 if DEVICE == "cuda" else 4) * 4 + 2  # per block: Linear w, b + LayerNorm w, b
    for checks, backend, launches in world2.run(_w2_parity, DEVICE, case, timeout=120):
        assert checks == 4 * n_params
        if backend != "reference":
            assert launches > 0, (case, backend)  # the Triton kernels ran in the loop


def test_w2_one_device_zero_grad_in_place(world2):
    """set_to_none=False: the grads persist between steps (torch's other
    zero_grad mode), with bucket views and without."""
    for case in ("default", "view"):
        for checks, _, _ in world2.run(_w2_parity, DEVICE, case, 3, False, timeout=120):
            assert checks > 0


# ------------------------------------------------------------ slow stream
def _cycles_check(dev) -> float:
    """ms one ``torch.cuda._sleep(SLEEP_PER_GRAD)`` takes (after a warm-up)."""
    for _ in range(3):
        torch.cuda._sleep(SLEEP_PER_GRAD)
    torch.cuda.synchronize(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        torch.cuda._sleep(SLEEP_PER_GRAD)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 10


def _slow_comm_stream(rank, world_size, opts, hook=None, steps=4):
    """fastddp with its comm stream held back by sleeps queued before every
    gradient's readiness hook (and once before each forward) against torch's
    DDP without any: .grad must match bit for bit every step, and backward
    must really have waited for the sleeping stream."""
    dev = _device("cuda")
    base = _model(dev)
    d = _in_features(base)
    emulate = {"fp16_compress_hook": torch.float16, "bf16_compress_hook": torch.bfloat16}.get(hook)
    if emulate is not None:
        ref = copy.deepcopy(base)
    else:
        ref = _torch_ddp(copy.deepcopy(base), dev, opts)
    module = copy.deepcopy(base)
    holder: list = []

    def hold_back(_param):
        # Registered before fastddp wraps the module, so it runs before the
        # reducer's own hook for this parameter (hooks run in registration
        # order): the sleep is queued ahead of any pack this grad triggers.
        stream = holder[0].reducer.comm_stream
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_PER_GRAD)

    handles = [p.register_post_accumulate_grad_hook(hold_back) for p in module.parameters()]
    test = _fastddp(module, dev, opts, hook)
    holder.append(test)
    assert hasattr(test.reducer, "comm_stream"), \
        "fastddp's Reducer needs a public `comm_stream` (the CUDA stream its packs and collectives run on)"
    assert isinstance(test.reducer.comm_stream, torch.cuda.Stream)
    assert test.reducer.comm_stream != torch.cuda.current_stream(dev)
    per_sleep_ms = _cycles_check(dev)
    n_params = sum(1 for _ in module.parameters())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt_test = torch.optim.SGD(test.parameters(), lr=0.05)
    checks, waited = 0, []
    for step in range(steps):
        x = _batch(dev, d, rank, step)
        opt_ref.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()
        if emulate is not None:
            _emulated_compress(ref, emulate, world_size)
        opt_test.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.cuda.stream(test.reducer.comm_stream):
            torch.cuda._sleep(SLEEP_PER_STEP)
        test(x).square().mean().backward()
        end.record()  # compute stream: after the reducer made it wait for the comm stream
        checks += _compare_grads(ref, test, f"rank {rank} slow comm stream {opts} {hook} step {step}")
        opt_ref.step()
        opt_test.step()
        end.synchronize()
        waited.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    for h in handles:
        h.remove()
    _compare_params(ref, test, f"rank {rank} slow comm stream {opts} {hook} after {steps} steps")
    # The compute stream waited for every sleep queued on the comm stream.
    # (Two processes time-share one GPU at W=2, so only a loose bound.)
    floor_ms = 0.5 * n_params * per_sleep_ms
    return checks, min(waited), floor_ms


SLOW_CASES = {
    "view": {"gradient_as_bucket_view": True},
    "view-tiny": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.25},
    "view-batched-tiny": {"gradient_as_bucket_view": True, "batched_grad_copy": True, "bucket_cap_mb": 0.25},
    "default-tiny": {"bucket_cap_mb": 0.25},
}


@needs_cuda
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_slow_comm_stream_nccl1(nccl1, case):
    checks, waited, floor_ms = _slow_comm_stream(0, 1, SLOW_CASES[case])
    assert checks > 0
    assert waited >= floor_ms, f"backward returned after {waited:.2f} ms; the comm stream slept >= {floor_ms:.2f} ms"


@needs_cuda
@pytest.mark.parametrize("hook", ["fp16_compress_hook", "bf16_compress_hook"])
def test_slow_comm_stream_fused_hooks_nccl1(nccl1, hook):
    checks, waited, floor_ms = _slow_comm_stream(0, 1, {"bucket_cap_mb": 0.25}, hook)
    assert checks > 0 and waited >= floor_ms, (waited, floor_ms)


@needs_cuda
@pytest.mark.parametrize("case", ["view-tiny", "view-batched-tiny"])
def test_slow_comm_stream_w2_one_device(world2, case):
    for checks, waited, floor_ms in world2.run(_slow_comm_stream, SLOW_CASES[case], timeout=120):
        assert checks > 0
        assert waited >= floor_ms, (waited, floor_ms)


@needs_cuda
@pytest.mark.parametrize("hook,dtype", [("fp16_compress_hook", torch.float16), ("bf16_compress_hook", torch.bfloat16)])
def test_cuda_fused_hooks_equal_their_rule(nccl1, hook, dtype):
    """The fused fp16/bf16 path compiled for the GPU: cast with round to
    nearest even (torch's .to), bit for bit against the rule on local grads."""
    dev = torch.device("cuda", 0)
    base = _nccl_model()
    ref = copy.deepcopy(base)
    test = _fastddp(copy.deepcopy(base), dev, {"bucket_cap_mb": 0.25}, hook)
    for step in range(3):
        x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step)) * 3.0 ** step
        for m in (ref, test):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
        _emulated_compress(ref, dtype, 1)
        _compare_grads(ref, test, f"nccl1 {hook} step {step}")


@needs_cuda
@pytest.mark.parametrize("hook", [None, "fp16_compress_hook", "bf16_compress_hook"])
def test_cuda_one_pack_one_unpack_launch_per_bucket(nccl1, hook):
    import fastddp.kernels as K

    dev = torch.device("cuda", 0)
    m = _fastddp(_nccl_model(), dev, {"bucket_cap_mb": 0.25, "batched_grad_copy": True}, hook)
    x = torch.randn(32, 256, device="cuda")
    for _ in range(2):  # the rebuild happens before the second forward
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    m.zero_grad(set_to_none=True)
    K.reset_launch_count()
    m(x).sum().backward()
    torch.cuda.synchronize()
    nb = m.reducer.num_buckets
    assert nb > 1
    assert K.launch_count() == 2 * nb, (K.stats(), nb)
    assert K.stats()["reference_calls"] == 0
