"""The bench's wrappers that need no multi-rank run: the ``replicate``
peer's blocks and refusals, and the ``torch.compile`` rows the registry
builds (bench/wrappers.py, bench/compile_wrappers.py)."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from tests._models import make_model


def test_replicate_blocks_rule():
    from fastddp.bench.models import model_zoo
    from fastddp.bench.wrappers import replicate_blocks

    zoo = model_zoo()
    tr = zoo["transformer"].build()
    assert replicate_blocks(tr) == list(tr.encoder.layers)  # torchtitan: each transformer block
    small = zoo["small"].build()
    assert len(replicate_blocks(small)) == 300  # every Linear and LayerNorm of the Sequential
    conv = zoo["convnet"].build()
    blocks = replicate_blocks(conv)
    assert all(any(True for _ in b.parameters()) for b in blocks) and len(blocks) == 9  # ReLU/pool skipped
    assert replicate_blocks(make_model("mlp")) == []  # no repeated unit: the root alone


def test_refused_on_the_simulated_wire_with_the_reason():
    from fastddp.bench.wrappers import WrapperOptions, build_wrapper

    with pytest.raises(RuntimeError, match="simulated wire.*--link netns"):
        build_wrapper("replicate", make_model("mlp"), object(), WrapperOptions())


def test_unavailable_on_a_torch_without_it(monkeypatch):
    from fastddp.bench.wrappers import WrapperOptions, build_wrapper

    monkeypatch.setitem(sys.modules, "torch.distributed._composable.replicate_with_fsdp", None)
    with pytest.raises(ImportError, match=re.escape(f"torch {torch.__version__} has no replicate_with_fsdp")):
        build_wrapper("replicate-bf16", make_model("mlp"), None, WrapperOptions())


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch._dynamo's import
def test_compile_rows_still_come_from_the_registry(tmp_path):
    """bench.wrappers.registry hands compile_wrappers its spec class and the two
    DDP factories (no import back): the rows exist, refuse what torch's
    compiled DDP cannot do, and fastddp's row builds a compiled fastddp."""
    from torch import nn

    from fastddp.bench.wrappers import WrapperOptions, WrapperSpec, registry
    from tests._dist import single_rank_group

    reg = registry()
    torch_row, fast_row = reg["torch-compile"], reg["fastddp-compile"]
    assert isinstance(torch_row, WrapperSpec) and isinstance(fast_row, WrapperSpec)
    assert (torch_row.family, fast_row.family, fast_row.baselines) == ("torch", "fastddp", ("torch-compile", "torch"))
    with pytest.raises(RuntimeError, match="bucket_cap_mb < 1"):
        torch_row.factory(nn.Linear(2, 2), None, WrapperOptions(bucket_cap_mb=0.5))
    with pytest.raises(RuntimeError, match="simulated wire"):
        torch_row.factory(nn.Linear(2, 2), None, WrapperOptions(wire=object()))
    with single_rank_group(tmp_path) as pg:
        compiled, note = fast_row.factory(nn.Linear(2, 2), pg, WrapperOptions(bucket_cap_mb=0.5))
        assert type(compiled._orig_mod).__module__.startswith("fastddp"), type(compiled._orig_mod)
        assert note.startswith("torch.compile(fastddp DDP")
        assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
