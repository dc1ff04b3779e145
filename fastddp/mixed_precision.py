"""DDP-native mixed precision (torch's ``_MixedPrecision(param_dtype,
reduce_dtype, buffer_dtype)``).

Full-precision parameters stay the masters the optimizer updates.  Before
each forward a low-precision copy (``param_dtype``) is made and swapped in
(``param.data``), so forward and backward compute in ``param_dtype`` and
autograd produces ``param_dtype`` gradients.  The reducer's buckets hold
``reduce_dtype``: the fused pack kernel reads the ``param_dtype`` gradients,
scales by 1/W in fp32 and casts to ``reduce_dtype`` in ONE launch; after the
SUM all-reduce, each bucket's parameters get their full-precision data back
and a full-precision ``.grad`` is written by ONE unpack launch (cast back).
Buffers are cast to ``buffer_dtype`` once, as torch does; floating inputs are
cast to ``param_dtype``.

Differences from torch: the average is taken before the reduced-precision
cast (torch divides after the sum, in ``reduce_dtype``), which cannot
overflow where the average fits; low-precision copies are made on the
current stream (torch uses a side stream plus events).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (torch's _free_storage needs it loaded)
from torch.distributed.utils import _alloc_storage, _cast_forward_inputs, _free_storage

__all__ = ["MixedPrecision"]


class MixedPrecision:
    def __init__(self, ddp, config, params):
        self.config = config
        first = params[0].dtype
        self.param_dtype = config.param_dtype
        self.reduce_dtype = config.reduce_dtype or config.param_dtype or first
        self.module = ddp.module
        ignore = ddp.parameters_to_ignore
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        # every floating parameter that DDP manages (trainable or not) swaps
        self.params = [p for p in ddp.module.parameters()
                       if p.is_floating_point() and names.get(id(p)) not in ignore]
        if self.param_dtype is not None:
            for p in self.params:
                if not hasattr(p, "_mp_param"):
                    p._mp_param = torch.zeros_like(p, dtype=self.param_dtype, requires_grad=False)
                    _free_storage(p._mp_param)
                    p._fp_param = p.data
        if config.buffer_dtype is not None:
            for name, buf in ddp.module.named_buffers():
                if buf.is_floating_point() and name not in ignore:
                    buf.data = buf.to(dtype=config.buffer_dtype)
        self._swapped = False

    def pre_forward(self, inputs, kwargs):
        if self.param_dtype is None:
            return inputs, kwargs
        with torch.no_grad():
            for p in self.params:
                _alloc_storage(p._mp_param, p.size())
                p._mp_param.copy_(p._fp_param)
                if p.grad is not None and p.grad.dtype != self.param_dtype:
                    # accumulating across no_sync steps: in param_dtype, as torch
                    p.grad.data = p.grad.to(self.param_dtype)
                p.data = p._mp_param
        self._swapped = True
        return _cast_forward_inputs(self.param_dtype, *inputs, **kwargs)

    def restore_bucket(self, bucket, comm) -> None:
        """Before a bucket's unpack: its params get full-precision data back and
        a full-precision .grad to receive the reduced values."""
        if self.param_dtype is None:
            return
        for p in bucket.params:
            if p.data.data_ptr() == p._fp_param.data_ptr():
                continue
            g = p.grad
            p.data = p._fp_param
            _free_storage(p._mp_param)
            if g is not None:
                comm.release(g)  # read by the pack queued on the comm stream
                p.grad = comm.hand_over(torch.empty_like(p._fp_param))  # the unpack overwrites it

    def restore_all(self) -> None:
        """After backward (or a forward no backward will follow): every param
        back to full precision (also the frozen ones)."""
        if self.param_dtype is None or not self._swapped:
            return
        for p in self.params:
            if p.data.data_ptr() != p._fp_param.data_ptr():
                g = p.grad
                p.data = p._fp_param
                _free_storage(p._mp_param)
                if g is not None:
                    p.grad = g.to(p._fp_param.dtype)
        self._swapped = False
