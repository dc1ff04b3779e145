"""The ways of packing/unpacking a bucket that the kernel benchmarks compare:
fastddp's op and what torch does today.  One definition, used by the
pytest-benchmark suite (bench/test_bench_kernels.py) and the GPU measurement
script (bench/gpu_kernels.py).

* ``fastddp``  ``fastddp.kernels.pack/unpack`` with a reused ``Layout``;
* ``fastddp-checked``  the same pack with ``check_finite``'s health flag (its
               cost: target under 3% on a GPU, no extra launch);
* ``loop``     a per-tensor ``copy_`` + ``mul_`` (torch's reducer, grad by grad);
* ``foreach``  ``torch._foreach_copy_`` + one ``mul_`` of the whole bucket
               (pack) or ``_foreach_mul_`` (unpack);
* ``cat``      ``torch.cat`` + ``mul_`` (pack only; a bucket-sized temporary
               when the wire dtype differs).
"""

from __future__ import annotations

import torch

import fastddp.kernels as K


def pack_methods(grads, flat, lay, views, scale: float) -> dict:
    flag = torch.zeros(1, dtype=torch.int32, device=flat.device)

    def fastddp():
        K.pack(grads, flat, layout=lay, scale=scale)

    def fastddp_checked():  # check_finite: the same launch also sets the health flag
        K.pack(grads, flat, layout=lay, scale=scale, health=flag)

    def loop():
        for g, v in zip(grads, views):
            v.copy_(g)
            v.mul_(scale)

    def foreach():
        torch._foreach_copy_(views, grads)
        flat.mul_(scale)

    def cat():
        if flat.dtype == grads[0].dtype:
            torch.cat(grads, out=flat)
            flat.mul_(scale)
        else:
            flat.copy_(torch.cat(grads).mul_(scale))

    return {"fastddp": fastddp, "fastddp-checked": fastddp_checked, "loop": loop, "foreach": foreach,
            "cat": cat}


def unpack_methods(grads, flat, lay, views, scale: float, accumulate: bool = False) -> dict:
    def fastddp():
        K.unpack(flat, grads, layout=lay, scale=scale, accumulate=accumulate)

    def loop():
        for g, v in zip(grads, views):
            if accumulate:
                g.add_(v.float().mul(scale))  # out of place: never scale the bucket itself
            else:
                g.copy_(v)
                g.mul_(scale)

    def foreach():
        if accumulate:
            torch._foreach_add_(grads, torch._foreach_mul(list(views) if views[0].dtype == grads[0].dtype
                                                          else [v.float() for v in views], scale))
        else:
            torch._foreach_copy_(grads, views)
            torch._foreach_mul_(grads, scale)

    return {"fastddp": fastddp, "loop": loop, "foreach": foreach}
