"""``examples/train.py``'s ``--hook NAME``: which names each impl takes, the
hook and state each registers, a clear exit where fastddp lacks one, and the
dump ``--save`` writes (the hook's name, rank 0's loss at every step)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def train():
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import train
    finally:
        sys.path.remove(str(TRAIN.parent))
    return train


class _Recorder:
    """Stands in for a wrapped model: records register_comm_hook calls."""

    def __init__(self):
        self.calls = []

    def register_comm_hook(self, state, hook):
        self.calls.append((state, hook))


def test_hook_names_per_impl(train, capsys):
    assert train.parse_args([]).hook is None
    for name in ("fp16", "bf16", "bf16acc", "fp8", "hier-fp32", "hier-bf16", "hier-fp8"):
        assert train.parse_args(["--hook", name]).hook == name
    for name in ("fp16", "bf16"):
        assert train.parse_args(["--impl", "torch", "--hook", name]).hook == name
    for argv, msg in ((["--impl", "torch", "--hook", "fp8"], "--hook 'fp8' is not a hook of --impl torch"),
                      (["--impl", "torch", "--hook", "hier-fp32"], "is not a hook of --impl torch"),
                      (["--hook", "fp4"], "--hook 'fp4' is not a hook of --impl fastddp")):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert msg in err and "choose one of" in err, err


def test_fastddp_hooks_by_name(train):
    from fastddp import hooks

    for name, fn, state in (("fp16", hooks.fp16_compress_hook, type(None)),
                            ("bf16", hooks.bf16_compress_hook, type(None)),
                            ("bf16acc", hooks.bf16_fp32acc_hook, type(None)),
                            ("fp8", hooks.fp8_compress_hook, hooks.FP8CompressionState)):
        m = _Recorder()
        train.register_hook(m, "fastddp", name)
        assert len(m.calls) == 1 and m.calls[0][1] is fn and type(m.calls[0][0]) is state, (name, m.calls)
    m = _Recorder()
    train.register_hook(m, "fastddp", None)
    assert m.calls == []


def test_torch_hooks_by_name(train):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for name, fn in (("fp16", default_hooks.fp16_compress_hook), ("bf16", default_hooks.bf16_compress_hook)):
        m = _Recorder()
        train.register_hook(m, "torch", name)
        assert m.calls == [(None, fn)]


def test_hierarchical_names_exit_clearly_when_absent(train, monkeypatch):
    from fastddp import hooks

    monkeypatch.delattr(hooks, "hierarchical_hook", raising=False)
    with pytest.raises(SystemExit, match=r"--hook hier-fp8: this fastddp has no "
                                         r"fastddp.hooks.hierarchical_hook"):
        train.register_hook(_Recorder(), "fastddp", "hier-fp8")


@pytest.mark.parametrize("name,wire", [("hier-fp32", "fp32"), ("hier-bf16", "bf16"), ("hier-fp8", "fp8")])
def test_hierarchical_names_register_state_and_hook(train, monkeypatch, name, wire):
    from fastddp import hooks

    class State:
        def __init__(self, wire):
            self.wire = wire

    def hierarchical_hook(state, bucket):  # pragma: no cover - never called here
        raise AssertionError

    monkeypatch.setattr(hooks, "HierarchicalState", State, raising=False)
    monkeypatch.setattr(hooks, "hierarchical_hook", hierarchical_hook, raising=False)
    m = _Recorder()
    train.register_hook(m, "fastddp", name)
    (state, fn), = m.calls
    assert fn is hierarchical_hook and isinstance(state, State) and state.wire == wire


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_save_records_the_hook_and_every_step_loss(tmp_path):
    out = tmp_path / "final.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "GROUP_RANK")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(TRAIN), "--hook", "fp16", "--epochs", "2", "--samples", "64",
                        "--batch-size", "16", "--save", str(out)], env=env, capture_output=True, text=True,
                       timeout=100, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    dump = torch.load(out, weights_only=True)
    assert dump["hook"] == "fp16" and dump["impl"] == "fastddp"
    losses = dump["step_losses"]
    assert len(losses) == 2 * 64 // 16 and all(isinstance(x, float) for x in losses)
    assert losses[-1] < losses[0]  # it trained
