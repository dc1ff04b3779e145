"""The CPU path's foreach fast path and its fallback: a tensor whose numel is
its slot's but whose shape is not (and does not broadcast to it) goes through
the per-tensor reshape path, with the reference's bits; one that broadcasts
(size-1 dims only) is the same row-major copy."""

from __future__ import annotations

import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import reference


@pytest.mark.parametrize("src_shape", [(6, 4), (24,), (1, 24), (4, 6)])
def test_pack_and_unpack_with_shapes_other_than_the_slots(src_shape):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(5, generator=g), torch.randn(*src_shape, generator=g), torch.randn(3, 2, generator=g)]
    lay = K.Layout([(5,), (4, 6), (3, 2)])  # slot 1 is 4 x 6
    got = torch.empty(lay.total)
    K.pack(srcs, got, layout=lay, scale=0.25)
    want = torch.empty(lay.total)
    reference.pack_views(srcs, lay.views(want), 0.25)
    assert torch.equal(got, want)
    outs = [torch.empty_like(s) for s in srcs]
    K.unpack(got, outs, layout=lay)
    for s, o in zip(srcs, outs):
        assert torch.equal(o, (s * 0.25)), src_shape
