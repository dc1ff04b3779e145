"""Small deterministic test models and per-rank data for the DDP tests.

Every model is built by :func:`make_model` from a seed, so two calls give
identical weights; the parity tests build one and ``copy.deepcopy`` it (ties
survive a deepcopy).  :func:`make_batch` gives DIFFERENT data on each rank and
step (so an all-reduce that forgets a rank or averages wrongly shows up).

A model's ``forward`` takes ``(x, step=0, rank=0)`` keyword-compatible
arguments; models with control flow use them to decide which branch runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

D_IN = 16
HID = 32
D_OUT = 8
BATCH = 4


class MLP(nn.Module):
    """Three Linear layers (6 params); the workhorse."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HID)
        self.fc2 = nn.Linear(HID, HID)
        self.fc3 = nn.Linear(HID, D_OUT)

    def forward(self, x, step=0, rank=0):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class DeepMLP(nn.Module):
    """Twelve small Linear+LayerNorm blocks: many tensors, many buckets."""

    def __init__(self, depth=12):
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HID, HID), nn.LayerNorm(HID)) for _ in range(depth))
        self.out = nn.Linear(HID, D_OUT)

    def forward(self, x, step=0, rank=0):
        h = self.inp(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


class BranchNet(nn.Module):
    """A trunk plus ``branch`` used only on some steps.

    ``schedule``: ``"odd"`` (branch on odd steps, every rank alike),
    ``"rank"`` (branch on rank 0 at even steps, on the other ranks at odd
    steps: used on SOME ranks each step), ``"never"`` (branch never used).
    """

    def __init__(self, schedule="odd"):
        super().__init__()
        self.schedule = schedule
        self.fc1 = nn.Linear(D_IN, HID)
        self.branch = nn.Linear(HID, HID)
        self.fc2 = nn.Linear(HID, D_OUT)

    def uses_branch(self, step, rank):
        if self.schedule == "odd":
            return step % 2 == 1
        if self.schedule == "rank":
            return (step + (rank != 0)) % 2 == 0
        if self.schedule == "always":
            return True
        return False

    def forward(self, x, step=0, rank=0):
        h = torch.relu(self.fc1(x))
        if self.uses_branch(step, rank):
            h = h + torch.relu(self.branch(h))
        return self.fc2(h)


class TiedNet(nn.Module):
    """``mid2.weight`` IS ``mid.weight`` (one Parameter in two modules)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D_IN, HID)
        self.mid = nn.Linear(HID, HID)
        self.dec = nn.Linear(HID, D_IN)
        self.mid2 = nn.Linear(HID, HID)
        self.mid2.weight = self.mid.weight
        self.head = nn.Linear(D_IN, D_OUT)

    def forward(self, x, step=0, rank=0):
        h = torch.relu(self.enc(x))
        h = torch.relu(self.mid(h))
        h = torch.relu(self.mid2(h))
        return self.head(self.dec(h))


class FrozenNet(MLP):
    """MLP with ``fc1`` frozen (requires_grad=False) and ``fc2.bias`` frozen."""

    def __init__(self):
        super().__init__()
        self.fc1.requires_grad_(False)
        self.fc2.bias.requires_grad_(False)


class MixedDtypeNet(nn.Module):
    """fp32 -> fp64 -> fp32 layers: two dtype groups of buckets."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HID)
        self.fc2 = nn.Linear(HID, HID).double()
        self.fc3 = nn.Linear(HID, D_OUT)

    def forward(self, x, step=0, rank=0):
        h = torch.relu(self.fc1(x)).double()
        h = torch.relu(self.fc2(h)).float()
        return self.fc3(h)


class BNNet(nn.Module):
    """Linear + BatchNorm1d: buffers (running stats, num_batches_tracked)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HID)
        self.bn = nn.BatchNorm1d(HID)
        self.fc2 = nn.Linear(HID, D_OUT)

    def forward(self, x, step=0, rank=0):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class CheckpointNet(nn.Module):
    """Two blocks under ``torch.utils.checkpoint(use_reentrant=False)``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.b1 = nn.Sequential(nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, HID))
        self.b2 = nn.Sequential(nn.Linear(HID, HID), nn.Tanh())
        self.out = nn.Linear(HID, D_OUT)

    def forward(self, x, step=0, rank=0):
        h = self.inp(x)
        h = checkpoint(self.b1, h, use_reentrant=False)
        h = checkpoint(self.b2, h, use_reentrant=False)
        return self.out(h)


class ReuseNet(nn.Module):
    """``shared`` applied twice in one forward (grad accumulates twice)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.shared = nn.Linear(HID, HID)
        self.out = nn.Linear(HID, D_OUT)

    def forward(self, x, step=0, rank=0):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.shared(h))
        h = torch.relu(self.shared(h))
        return self.out(h)


class SparseEmbNet(nn.Module):
    """``nn.Embedding(sparse=True)`` followed by a Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, HID, sparse=True)
        self.fc = nn.Linear(HID, D_OUT)

    def forward(self, idx, step=0, rank=0):
        return self.fc(self.emb(idx).mean(1))


class NoGradNet(nn.Module):
    """Every parameter frozen (DDP must refuse it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, D_OUT)
        self.fc.requires_grad_(False)

    def forward(self, x, step=0, rank=0):
        return self.fc(x)


MODELS = {
    "mlp": MLP,
    "deep": DeepMLP,
    "branch_odd": lambda: BranchNet("odd"),
    "branch_rank": lambda: BranchNet("rank"),
    "branch_never": lambda: BranchNet("never"),
    "branch_always": lambda: BranchNet("always"),
    "tied": TiedNet,
    "frozen": FrozenNet,
    "mixed": MixedDtypeNet,
    "bn": BNNet,
    "ckpt": CheckpointNet,
    "reuse": ReuseNet,
    "sparse_emb": SparseEmbNet,
    "nograd": NoGradNet,
}


def make_model(name: str, seed: int = 0) -> nn.Module:
    """Build model ``name`` with weights drawn from ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name]()


def make_batch(name: str, rank: int, step: int, micro: int = 0, seed: int = 0):
    """Per-rank, per-step input and target: ``(x, target)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step * 101 + micro)
    if name == "sparse_emb":
        x = torch.randint(0, 20, (BATCH, 3), generator=g)
    else:
        x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.randn(BATCH, D_OUT, generator=g)
    return x, y


def loss_fn(out, y):
    return ((out.float() - y) ** 2).mean()
