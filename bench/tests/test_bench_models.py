"""The model zoo's shapes outside the default set: the ones the default
path's rules must hold on without having been fitted to them."""

from __future__ import annotations

import pytest
import torch

from fastddp.bench.models import DEFAULT_MODELS, model_zoo
from fastddp.reduction import IN_PLACE_MIN_NUMEL


def _params(name):
    spec = model_zoo()[name]
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.make_batch(torch.Generator().manual_seed(0), torch.device("cpu"))
    spec.loss(model(x), y).backward()  # one step runs, every parameter gets a gradient
    params = list(model.parameters())
    assert all(p.grad is not None and p.grad.layout is torch.strided for p in params)
    return params


def test_weights1m_sits_at_the_in_place_threshold():
    params = _params("weights1m")
    weights = [p for p in params if p.dim() == 2]
    assert len(params) == 48 and len(weights) == 24
    assert {p.numel() for p in weights} == {IN_PLACE_MIN_NUMEL} == {1 << 20}


def test_manysmall_is_hundreds_of_small_tensors():
    params = _params("manysmall")
    assert len(params) == 400
    assert min(p.numel() for p in params) == 16 and max(p.numel() for p in params) == 65536


def test_embedding_is_one_large_dense_table_and_small_layers():
    params = _params("embedding")
    big = [p for p in params if p.numel() > 1 << 20]
    assert len(big) == 1 and big[0].shape == (50000, 256)
    assert sum(p.numel() for p in params if p is not big[0]) < 0.02 * big[0].numel()


@pytest.mark.parametrize("name", ["weights1m", "manysmall", "embedding"])
def test_the_new_shapes_stay_out_of_the_default_run(name):
    assert name in model_zoo() and name not in DEFAULT_MODELS
