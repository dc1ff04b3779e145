"""The end-to-end runner's model zoo.

Each entry is a :class:`ModelSpec`: how to build the model, how to make one
rank's batch for one step, and the loss.  The zoo covers the regimes a DDP
wrapper can be bound by (DESIGN.md, "Benchmarks"):

* ``small``: 150 x [Linear(64, 64), LayerNorm(64)], 600 parameter tensors,
  0.64M params, batch 32.  Bound by per-tensor overhead (hooks, copies).
* ``transformer``: 6 x nn.TransformerEncoderLayer(d=256, h=4, ff=1024) +
  Linear, 74 tensors, 4.8M params, batch 4 x 32 tokens.  A realistic mix.
* ``convnet``: 4 x [Conv3x3, BatchNorm2d, ReLU] + Linear, batch 16 x 3 x 32
  x 32.  Conv compute, BatchNorm buffers broadcast at every forward.
* ``mlp25m``: Linear(1024, 4096), Linear(4096, 4096), Linear(4096, 1024),
  25.2M params in 6 tensors, batch 8.  Bound by bytes on the wire.
* ``tiny``: 4 x [Linear(16, 16), LayerNorm(16)]; for tests and smoke runs,
  not in the default set.

Not in the default set either, three shapes the default path's rules were
not fitted on (``--models weights1m,manysmall,embedding``):

* ``weights1m``: 24 x Linear(1024, 1024), 25.2M params in 48 tensors, each
  weight exactly 1,048,576 elements: the CPU's in-place threshold
  (``FASTDDP_IN_PLACE_NUMEL``) and several such weights per 25 MiB bucket.
* ``manysmall``: 100 x [Linear(k, k), LayerNorm(k)], k cycling 16, 64, 128,
  256: 400 tensors of 16 to 65,536 elements, 2.2M params.
* ``embedding``: Embedding(50000, 256) (12.8M dense-gradient params, one
  tensor) under 2 x [Linear(256, 256), LayerNorm(256)] and a Linear head.

Nothing here touches torch.distributed.  ``build()`` draws from the global
RNG, which the runner seeds identically on every rank, and every wrapper gets
a deep copy of one built model, so all start from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

__all__ = ["ModelSpec", "model_zoo", "DEFAULT_MODELS"]

Batch = tuple[torch.Tensor, torch.Tensor]

#: The models a run without ``--models`` benchmarks, in this order.
DEFAULT_MODELS = ("small", "transformer", "convnet", "mlp25m")


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model."""

    name: str
    """Short name used on the command line and in reports."""
    description: str
    """One line for the report."""
    build: Callable[[], nn.Module]
    """Builds the model on the CPU from the current RNG state."""
    make_batch: Callable[[torch.Generator, torch.device], Batch]
    """Makes ``(input, target)`` for one rank and one step."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss(output, target)`` -> scalar."""
    steps: int
    """Timed steps per wrapper by default."""
    quick_steps: int
    """Timed steps per wrapper with ``--quick``."""


def _small() -> nn.Module:
    return nn.Sequential(*[m for _ in range(150) for m in (nn.Linear(64, 64), nn.LayerNorm(64))])


def _tiny() -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.LayerNorm(16))])


class _Transformer(nn.Module):
    def __init__(self, layers: int = 6, d_model: int = 256, heads: int = 4, ff: int = 1024):
        super().__init__()
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True),
            num_layers=layers,
            enable_nested_tensor=False,
        )
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _convnet() -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32, 1), *block(32, 64, 2), *block(64, 128, 2), *block(128, 128, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )


def _mlp25m() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024),
    )


def _weights1m() -> nn.Module:
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])


def _manysmall() -> nn.Module:
    widths = [(16, 64, 128, 256)[i % 4] for i in range(100)]
    return _Widths(widths)


class _Widths(nn.Module):
    """Blocks of Linear(k, k) + LayerNorm(k) of changing widths, joined by
    slicing or zero-padding the features (no parameters of their own)."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(k, k), nn.LayerNorm(k)) for k in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            k = block[0].in_features
            x = block(F.pad(x, (0, k - x.shape[-1])) if x.shape[-1] < k else x[..., :k])
        return x


class _Embedding(nn.Module):
    def __init__(self, vocab: int = 50000, d: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Sequential(*[m for _ in range(2) for m in (nn.Linear(d, d), nn.LayerNorm(d))])
        self.head = nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _token_batch(gen: torch.Generator, device: torch.device) -> Batch:
    x = torch.randint(0, 50000, (8, 32), generator=gen)
    y = torch.randn(8, 32, 256, generator=gen)
    return x.to(device), y.to(device)


def _dense_batch(batch: int, width: int):
    def make(gen: torch.Generator, device: torch.device) -> Batch:
        x = torch.randn(batch, width, generator=gen)
        y = torch.randn(batch, width, generator=gen)
        return x.to(device), y.to(device)
    return make


def _seq_batch(gen: torch.Generator, device: torch.device) -> Batch:
    x = torch.randn(4, 32, 256, generator=gen)
    y = torch.randn(4, 32, 256, generator=gen)
    return x.to(device), y.to(device)


def _image_batch(gen: torch.Generator, device: torch.device) -> Batch:
    x = torch.randn(16, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (16,), generator=gen)
    return x.to(device), y.to(device)


def model_zoo() -> dict[str, ModelSpec]:
    """All benchmark models by name (a fresh dict on every call)."""
    specs = [
        ModelSpec("small", "150 x [Linear(64,64), LayerNorm(64)]: 600 tensors, 0.64M params, batch 32",
                  _small, _dense_batch(32, 64), F.mse_loss, steps=50, quick_steps=3),
        ModelSpec("transformer", "6 x TransformerEncoderLayer(d=256, h=4, ff=1024) + Linear, batch 4 x 32 tokens",
                  _Transformer, _seq_batch, F.mse_loss, steps=25, quick_steps=3),
        ModelSpec("convnet", "4 x [Conv3x3, BatchNorm2d, ReLU] + Linear, batch 16 x 3 x 32 x 32",
                  _convnet, _image_batch, F.cross_entropy, steps=25, quick_steps=4),
        ModelSpec("mlp25m", "Linear(1024,4096), Linear(4096,4096), Linear(4096,1024): 25.2M params, batch 8",
                  _mlp25m, _dense_batch(8, 1024), F.mse_loss, steps=20, quick_steps=3),
        ModelSpec("tiny", "4 x [Linear(16,16), LayerNorm(16)] (tests, smoke runs)",
                  _tiny, _dense_batch(4, 16), F.mse_loss, steps=5, quick_steps=2),
        ModelSpec("weights1m", "24 x Linear(1024,1024): 48 tensors, 25.2M params, each weight 2^20 elements, batch 8",
                  _weights1m, _dense_batch(8, 1024), F.mse_loss, steps=20, quick_steps=3),
        ModelSpec("manysmall", "100 x [Linear(k,k), LayerNorm(k)], k = 16/64/128/256: 400 tensors, 2.2M params, "
                  "batch 32", _manysmall, _dense_batch(32, 256), F.mse_loss, steps=50, quick_steps=3),
        ModelSpec("embedding", "Embedding(50000,256) + 2 x [Linear(256,256), LayerNorm(256)] + Linear: "
                  "13.0M params, batch 8 x 32 tokens", _Embedding, _token_batch, F.mse_loss, steps=25,
                  quick_steps=3),
    ]
    return {s.name: s for s in specs}
