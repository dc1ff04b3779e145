"""The bench's simulated network (bench/simwire.py): a process group whose
collectives cross a serial wire of a given speed, used the same way by torch's
DDP and fastddp."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from fastddp.bench.simwire import SimulatedWire
from tests._dist import ddp_class, single_rank_group, torch_ddp_class, world2

CPU = torch.device("cpu")
SLOW = 0.001  # GB/s = 1 MB/s: 1000 bytes take 1 ms


def _seconds(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e9)


# -- one rank: timing and ordering ------------------------------------------------

def test_a_collective_takes_at_least_bytes_over_bandwidth(tmp_path):
    with single_rank_group(tmp_path) as world, SimulatedWire(world, SLOW, CPU) as wire:
        t = torch.ones(5000)  # 20 kB: 20 ms
        t0 = time.perf_counter()
        wire.allreduce([t]).wait()
        assert time.perf_counter() - t0 >= _seconds(20_000, SLOW)
        # through torch.distributed's function and the Work's Future, as DDPs use it
        t0 = time.perf_counter()
        fut = dist.all_reduce(t, group=wire, async_op=True).get_future()
        (value,) = fut.wait()
        assert time.perf_counter() - t0 >= _seconds(20_000, SLOW)
        assert value is t and torch.equal(t, torch.ones(5000))  # one rank: SUM is the identity
        assert wire.bytes_sent == 40_000 and wire.collectives == 2


def test_the_wire_is_serial(tmp_path):
    """Collectives issued together finish one wire time apart, in issue order."""
    n, nbytes = 5, 4000  # 4 ms each
    with single_rank_group(tmp_path) as world, SimulatedWire(world, SLOW, CPU) as wire:
        done: list[tuple[int, float]] = []
        t0 = time.perf_counter()
        works = [wire.allreduce([torch.zeros(nbytes // 4)]) for _ in range(n)]
        for i, w in enumerate(works):
            w.get_future().add_done_callback(lambda _f, i=i: done.append((i, time.perf_counter())))
        for w in works:
            assert w.wait() is True
        limit = time.perf_counter() + 5  # callbacks run just after a Future is marked done
        while len(done) < n and time.perf_counter() < limit:
            time.sleep(0.001)
        assert [i for i, _ in done] == list(range(n))
        for i, t in done:
            assert t - t0 >= (i + 1) * _seconds(nbytes, SLOW)
        # an idle wire starts afresh: a later collective is not charged for the gap
        time.sleep(0.03)
        t1 = time.perf_counter()
        wire.allreduce([torch.zeros(nbytes // 4)]).wait()
        assert time.perf_counter() - t1 < 0.03 + _seconds(nbytes, SLOW)


class _HeldGroup(dist.ProcessGroup):
    """A one-rank group whose all-reduce finishes when the test says so."""

    def __init__(self):
        super().__init__(0, 1)
        self.release = torch.futures.Future()

    def allreduce(self, tensors, opts=None):
        fut = torch.futures.Future()
        self.release.then(lambda _f: fut.set_result(tensors))
        return _create_work_from_future(fut)

    def getBackendName(self):
        return "held"


def test_never_before_the_real_collective():
    held = _HeldGroup()
    with SimulatedWire(held, 1000.0, CPU) as wire:
        work = wire.allreduce([torch.ones(2)])
        time.sleep(0.02)
        assert not work.is_completed() and not work.get_future().done()
        held.release.set_result(None)
        assert work.wait()
        assert work.is_completed()


def test_errors_reach_the_waiter():
    class Failed(dist._Work):
        def wait(self, timeout):
            raise RuntimeError("the real collective failed")

    class Broken(_HeldGroup):
        def allreduce(self, tensors, opts=None):
            return Failed()

    with SimulatedWire(Broken(), 1000.0, CPU) as wire:
        with pytest.raises(RuntimeError, match="the real collective failed"):
            wire.allreduce([torch.ones(2)]).wait()


def test_bad_bandwidth_and_use_outside_the_block():
    with pytest.raises(ValueError):
        SimulatedWire(_HeldGroup(), 0.0, CPU)
    with pytest.raises(RuntimeError, match="outside its `with` block"):
        SimulatedWire(_HeldGroup(), 1.0, CPU).allreduce([torch.ones(1)])


# -- two ranks: torch's DDP and fastddp through the same wire ---------------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _train(rank, cls, pg, steps=3):
    """Grads after each of ``steps`` steps, bytes the wire counted and the
    slowest backward's time (a backward waits for its all-reduces)."""
    model = _model()
    ddp = cls(model, process_group=pg, bucket_cap_mb=0.005)  # a few buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads, sent, backward_s = [], [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad(set_to_none=True)
        before = pg.bytes_sent if pg is not None else 0
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        t0 = time.perf_counter()
        loss.backward()
        backward_s.append(time.perf_counter() - t0)
        sent.append((pg.bytes_sent if pg is not None else 0) - before)
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, sent, backward_s


def _both_through_the_wire(rank, world_size, gbps):
    world = dist.group.WORLD
    plain, _, _ = _train(rank, torch_ddp_class(), None)
    out = {}
    for name, cls in (("torch", torch_ddp_class()), ("under_test", ddp_class())):
        with SimulatedWire(world, gbps, CPU) as wire:
            out[name] = _train(rank, cls, wire)
        dist.barrier()
    return plain, out


def test_torch_and_fastddp_train_the_same_through_the_wire(world2):
    gbps = 0.01  # 10 MB/s: the 24.6 kB of gradients take ~2.5 ms
    grad_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    for plain, out in world2.run(_both_through_the_wire, gbps):
        t_grads, t_sent, t_bwd = out["torch"]
        f_grads, f_sent, f_bwd = out["under_test"]
        for step in range(len(plain)):
            for ref, a, b in zip(plain[step], t_grads[step], f_grads[step]):
                assert torch.equal(a, ref)  # the wire changes no bits of torch's result
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        # a steady step all-reduces the gradients once, on both sides, and
        # backward (which waits for them) takes at least their wire time
        assert t_sent[-1] == f_sent[-1] == grad_bytes
        assert min(t_bwd) >= _seconds(grad_bytes, gbps)
        assert min(f_bwd) >= _seconds(grad_bytes, gbps)



def _fp8_through_the_wire(rank, world_size, gbps):
    """fastddp's fp8 hook (all-to-all, fp32 sum, all-gather) behind the wire:
    the wire counts the bytes each rank sends in its two collectives."""
    import fastddp
    from fastddp import hooks

    world = dist.group.WORLD
    a = torch.arange(8.0) + 8 * rank
    with SimulatedWire(world, gbps, CPU) as wire:
        out = torch.empty(8)
        wire.alltoall_base(out, a, [], [], dist.AllToAllOptions()).wait()
        exchanged = (out.tolist(), wire.bytes_sent)
        gathered = torch.empty(16)
        wire._allgather_base(gathered, a).wait()
        exchanged += (gathered.tolist(), wire.bytes_sent)
        model = _model()
        ddp = fastddp.DistributedDataParallel(model, process_group=wire)
        ddp.register_comm_hook(None, hooks.fp8_compress_hook)
        torch.nn.functional.mse_loss(ddp(torch.randn(8, 32)), torch.zeros(8, 4)).backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return exchanged, grads_finite


def test_the_two_phase_collectives_cross_the_wire(world2):
    """All-to-all and all-gather into one tensor (fp8's and bf16+fp32-sum's
    collectives) go through the wire: before, fastddp-fp8 failed behind
    --simulate-bandwidth ("No backend type associated with device type cpu")."""
    for rank, ((a2a, sent1, gathered, sent2), finite) in enumerate(world2.run(_fp8_through_the_wire, 1.0)):
        # rank r gets slice r of every rank's tensor
        assert a2a == [float(x) for x in list(range(4 * rank, 4 * rank + 4)) + list(range(8 + 4 * rank, 12 + 4 * rank))]
        assert sent1 == 16  # half of the 32-byte result came from the other rank
        assert gathered == [float(x) for x in range(16)] and sent2 == 16 + 32
        assert finite
