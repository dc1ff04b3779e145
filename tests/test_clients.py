"""Real clients of DDP, run with fastddp swapped in.

* torchrun: ``examples/train.py`` under ``python -m torch.distributed.run
  --nproc-per-node 2`` (gloo), ``--impl fastddp`` against ``--impl torch``:
  same per-epoch losses and parameter checksums, and a run resumed from the
  checkpoint ends exactly where the uninterrupted run does.  No extra deps.
* PyTorch Lightning: ``Trainer(strategy=FastDDPStrategy(...),
  accelerator="cpu", devices=2)`` (Lightning's own popen launcher) against
  ``DDPStrategy``: same final weights, for automatic optimization with
  gradient accumulation (``no_sync``), manual optimization with
  ``find_unused_parameters=True`` and manual optimization with
  ``static_graph=True``.  ``@slow``; skipped without ``lightning``.
* HF accelerate: ``Accelerator()`` (MULTI_CPU, 2 ranks) inside
  ``fastddp.integrations.patch_torch_ddp()`` against plain accelerate: same
  final weights with ``accumulate`` (``no_sync``), ``trigger_sync_in_backward``,
  ``unwrap_model`` and ``get_state_dict``.  ``@slow``; skipped without
  ``accelerate``.

Every run is a subprocess (own session, killed as a group on timeout) with a
free port and a temporary folder.  This file is also the worker script of the
Lightning and accelerate runs: ``python tests/test_clients.py lightning|accelerate
--impl fastddp|torch --out DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
THIS = Path(__file__).resolve()

# Variables a parent launcher may have left that would confuse a fresh launch.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED",
                "ACCELERATE_USE_CPU", "FASTDDP_TEST_IMPL")


# ------------------------------------------------------------------ helpers
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra)
    return env


def _run(cmd: list[str], timeout: float, cwd: Path, env: dict[str, str] | None = None) -> tuple[str, float]:
    """Run ``cmd`` in its own session; on timeout kill the whole group (the
    launcher and the ranks it started).  Returns (stdout, seconds).  A
    rendezvous port taken between :func:`_free_port` and the launcher's bind
    (another test process, side by side: EADDRINUSE, before any rank ran) is
    replaced by a fresh one, at most twice."""
    env = env or _env()
    for _ in range(2):
        try:
            return _run_once(cmd, timeout, cwd, env)
        except _PortTaken:
            cmd = [str(_free_port()) if k and cmd[k - 1] == "--master-port" else a for k, a in enumerate(cmd)]
            if "MASTER_PORT" in env:
                env = {**env, "MASTER_PORT": str(_free_port())}
    return _run_once(cmd, timeout, cwd, env, retry=False)


class _PortTaken(Exception):
    pass


def _run_once(cmd, timeout, cwd, env, retry: bool = True) -> tuple[str, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n--- stdout\n{out[-4000:]}\n"
                    f"--- stderr\n{err[-8000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stray ranks, if any
    if proc.returncode != 0 and retry and "EADDRINUSE" in err:
        raise _PortTaken
    if proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{out[-4000:]}\n"
                    f"--- stderr\n{err[-8000:]}")
    return out, time.monotonic() - t0


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a)} vs {sorted(b)}"
    for k in a:
        if isinstance(a[k], dict):
            _assert_same_tensors(a[k], b[k], f"{what}[{k!r}]")
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}[{k!r}] differs: max |diff| " \
                f"{(a[k].double() - b[k].double()).abs().max().item()}"
        else:
            assert a[k] == b[k], f"{what}[{k!r}]: {a[k]!r} != {b[k]!r}"


# ------------------------------------------------------- integrations module
def test_integrations_import_is_lazy(tmp_path):
    """Importing fastddp (and fastddp.integrations) imports no framework."""
    code = ("import sys, fastddp\n"
            "assert 'fastddp.integrations' not in sys.modules\n"
            "import fastddp.integrations as I\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'accelerate')]\n"
            "assert not bad, bad\n"
            "assert callable(I.patch_torch_ddp) and callable(I.lightning_strategy)\n"
            "print('lazy ok')\n")
    out, _ = _run([sys.executable, "-c", code], timeout=50, cwd=tmp_path)
    assert "lazy ok" in out


def test_patch_torch_ddp_swaps_and_restores():
    import torch.nn.parallel.distributed as tdist

    import fastddp
    from fastddp.integrations import patch_torch_ddp

    torch_cls = torch.nn.parallel.DistributedDataParallel
    assert torch_cls is tdist.DistributedDataParallel
    with patch_torch_ddp() as cls:
        assert cls is fastddp.DistributedDataParallel
        assert torch.nn.parallel.DistributedDataParallel is fastddp.DistributedDataParallel
        with patch_torch_ddp():  # re-entrant
            assert torch.nn.parallel.DistributedDataParallel is fastddp.DistributedDataParallel
        assert torch.nn.parallel.DistributedDataParallel is fastddp.DistributedDataParallel
    assert torch.nn.parallel.DistributedDataParallel is torch_cls
    assert tdist.DistributedDataParallel is torch_cls  # the defining module is never touched

    @patch_torch_ddp()
    def boom():
        assert torch.nn.parallel.DistributedDataParallel is fastddp.DistributedDataParallel
        raise KeyError("x")

    with pytest.raises(KeyError):
        boom()
    assert torch.nn.parallel.DistributedDataParallel is torch_cls


def test_a_rendezvous_port_taken_meanwhile_is_replaced(tmp_path):
    """The launcher of a test run side by side with another may find the
    port _free_port() gave already taken: _run retries with a fresh one."""
    bind = ("import socket, sys\n"
            "s = socket.socket()\n"
            "try:\n"
            "    s.bind(('127.0.0.1', int(sys.argv[sys.argv.index('--master-port') + 1])))\n"
            "except OSError:\n"
            "    sys.exit('EADDRINUSE: address already in use')\n"
            "print('bound')\n")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        out, _ = _run([sys.executable, "-c", bind, "--master-port", str(held.getsockname()[1])], timeout=30,
                      cwd=tmp_path)
        assert out.strip() == "bound"
        with pytest.raises(pytest.fail.Exception, match="exit code 1"):  # anything else fails at once
            _run([sys.executable, "-c", "import sys; sys.exit('no')"], timeout=30, cwd=tmp_path)


# ------------------------------------------------------------------ torchrun
_EPOCH = re.compile(r"^epoch (\d+) loss (\S+) checksum (\S+)$", re.M)


def _torchrun(tmp_path: Path, impl: str, epochs: int, ckpt: Path) -> tuple[str, dict[int, tuple[str, str]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(TRAIN), "--impl", impl, "--epochs", str(epochs), "--samples", "256",
           "--batch-size", "16", "--lr", "0.05", "--ckpt", str(ckpt)]
    out, _ = _run(cmd, timeout=55, cwd=tmp_path)
    epochs_seen = {int(e): (loss, cks) for e, loss, cks in _EPOCH.findall(out)}
    return out, epochs_seen


def test_torchrun_example_matches_torch_ddp_and_resumes(tmp_path):
    """fastddp vs torch DDP through examples/train.py: identical loss and
    parameter checksum after every epoch; resuming fastddp from its epoch-0
    checkpoint lands bit for bit on torch's uninterrupted epoch 1."""
    _, ref = _torchrun(tmp_path, "torch", 2, tmp_path / "torch.pt")
    assert sorted(ref) == [0, 1], ref

    out1, fast1 = _torchrun(tmp_path, "fastddp", 1, tmp_path / "fast.pt")
    assert "resumed" not in out1 and sorted(fast1) == [0]
    assert fast1[0] == ref[0], f"epoch 0 (loss, checksum): fastddp {fast1[0]} vs torch {ref[0]}"

    out2, fast2 = _torchrun(tmp_path, "fastddp", 2, tmp_path / "fast.pt")
    assert "resumed from" in out2 and "at epoch 1" in out2, out2
    assert sorted(fast2) == [1], out2
    assert fast2[1] == ref[1], f"epoch 1 after resume: fastddp {fast2[1]} vs torch {ref[1]}"
    assert "done impl=fastddp world=2" in out2

    a = torch.load(tmp_path / "torch.pt", weights_only=True)
    b = torch.load(tmp_path / "fast.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 1
    assert not any(k.startswith("module.") for k in b["model"]), list(b["model"])
    _assert_same_tensors(a["model"], b["model"], "model")
    _assert_same_tensors(a["optimizer"]["state"], b["optimizer"]["state"], "optimizer state")


# ----------------------------------------------------------------- Lightning
_LIGHTNING_FITS = ("auto_accumulate", "manual_find_unused", "manual_static_graph")
_ACC_STEPS = 2


def _launch_worker(tmp_path: Path, client: str, impl: str, timeout: float, **env: str) -> tuple[Path, float]:
    out = tmp_path / f"{client}_{impl}"
    out.mkdir()
    _, secs = _run([sys.executable, str(THIS), client, "--impl", impl, "--out", str(out)],
                   timeout=timeout, cwd=tmp_path, env=_env(**env))
    return out, secs


def _load_rank_results(out: Path, name: str) -> list[tuple[dict, dict]]:
    res = []
    for r in range(2):
        res.append((torch.load(out / f"{name}_rank{r}.pt", weights_only=True),
                    json.loads((out / f"{name}_rank{r}.json").read_text())))
    return res


@pytest.mark.slow
def test_lightning_strategy_class(tmp_path):
    """FastDDPStrategy is a DDPStrategy, built lazily, picklable by reference
    (start_method="spawn" pickles the strategy) and keeps the DDP kwargs."""
    pytest.importorskip("lightning")
    code = ("import pickle, sys\n"
            "import fastddp.integrations as I\n"
            "assert 'lightning' not in sys.modules\n"
            "from lightning.pytorch.strategies import DDPStrategy\n"
            "s = I.lightning_strategy(start_method='spawn', static_graph=True, bucket_cap_mb=5)\n"
            "assert isinstance(s, DDPStrategy) and type(s) is I.FastDDPStrategy\n"
            "assert I.FastDDPStrategy.__module__ == 'fastddp.integrations'\n"
            "t = pickle.loads(pickle.dumps(s))\n"
            "assert type(t) is I.FastDDPStrategy and type(t._forward_redirection) is type(s._forward_redirection)\n"
            "assert t._ddp_kwargs == {'static_graph': True, 'bucket_cap_mb': 5}, t._ddp_kwargs\n"
            "assert t._start_method == 'spawn'\n"
            "print('strategy ok')\n")
    out, _ = _run([sys.executable, "-c", code], timeout=60, cwd=tmp_path)
    assert "strategy ok" in out


@pytest.mark.slow
def test_lightning_strategy_registry(tmp_path):
    """Lightning's StrategyRegistry knows fastddp's names (Lightning's DDP table
    with "fastddp" for "ddp"): registered when fastddp.integrations is imported
    after Lightning, or on register_lightning_strategies(); Lightning's own
    "ddp*" entries stay torch's DDPStrategy; nothing registers before asked."""
    pytest.importorskip("lightning")
    code = ("import sys\n"
            "import fastddp.integrations as I\n"
            "from lightning.pytorch.strategies import StrategyRegistry, DDPStrategy\n"
            "assert not [n for n in StrategyRegistry if 'fastddp' in n]  # integrations came first\n"
            "names = I.register_lightning_strategies()\n"
            "assert I.register_lightning_strategies() == names  # idempotent\n"
            "ddp = sorted(n for n in StrategyRegistry if n.startswith('ddp') and "
            "StrategyRegistry[n]['strategy'] is DDPStrategy)\n"
            "assert sorted(names) == sorted('fast' + n for n in ddp), (names, ddp)\n"
            "for n in ddp:\n"
            "    e, f = StrategyRegistry[n], StrategyRegistry['fast' + n]\n"
            "    assert f['strategy'] is I.FastDDPStrategy and f['init_params'] == e['init_params'], n\n"
            "import lightning.pytorch as L\n"
            "t = L.Trainer(strategy='fastddp_spawn_find_unused_parameters_true', accelerator='cpu',\n"
            "              devices=2, logger=False, enable_progress_bar=False)\n"
            "s = t.strategy\n"
            "assert type(s) is I.FastDDPStrategy and s._start_method == 'spawn', s\n"
            "assert s._ddp_kwargs == {'find_unused_parameters': True}, s._ddp_kwargs\n"
            "try:\n"
            "    I.register_lightning_strategies('lightning.fabric')\n"
            "except ValueError as e:\n"
            "    assert 'pytorch_lightning' in str(e)\n"
            "else:\n"
            "    raise AssertionError('no error for a bad package')\n"
            "print('registry ok')\n")
    out, _ = _run([sys.executable, "-c", code], timeout=120, cwd=tmp_path)
    assert "registry ok" in out
    # Imported after Lightning (the usual order): registered by the import alone.
    code = ("import lightning.pytorch as L\n"
            "import fastddp.integrations\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "assert StrategyRegistry['fastddp']['strategy'].__name__ == 'FastDDPStrategy'\n"
            "assert StrategyRegistry['fastddp']['init_params'] == {'start_method': 'popen'}\n"
            "print('import order ok')\n")
    out, _ = _run([sys.executable, "-c", code], timeout=120, cwd=tmp_path)
    assert "import order ok" in out


@pytest.mark.slow
def test_lightning_fastddp_strategy_matches_ddp_strategy(tmp_path):
    pytest.importorskip("lightning")
    outs = {}
    for impl in ("torch", "fastddp"):
        # Lightning's popen launcher re-runs this script for rank 1.
        outs[impl], _ = _launch_worker(tmp_path, "lightning", impl, timeout=85,
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for fit in _LIGHTNING_FITS:
        ref = _load_rank_results(outs["torch"], fit)
        got = _load_rank_results(outs["fastddp"], fit)
        for r in range(2):
            info = got[r][1]
            assert info["wrapper"] == "fastddp.ddp.DistributedDataParallel", info
            assert ref[r][1]["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
            assert info["after_fit"] == ref[r][1]["after_fit"] == "Net", info  # unwrapped by teardown
            assert info["protocol_isinstance"], info  # block_backward_sync's runtime Protocol check
            assert info["strategy"] == "FastDDPStrategy" and ref[r][1]["strategy"] == "DDPStrategy", info
            assert info["find_unused"] == ref[r][1]["find_unused"] == (fit == "manual_find_unused"), info
            assert info["no_sync_entries"] == ref[r][1]["no_sync_entries"], (info, ref[r][1])
            _assert_same_tensors(ref[r][0], got[r][0], f"{fit} rank {r}: fastddp vs DDPStrategy")
        _assert_same_tensors(got[0][0], got[1][0], f"{fit}: rank 0 vs rank 1")
        if fit == "auto_accumulate":
            assert got[0][1]["no_sync_entries"] > 0  # accumulation went through no_sync
            # ModelCheckpoint, written by rank 0 while the model was wrapped:
            # the module's own keys, the final weights.
            saved = torch.load(outs["fastddp"] / fit / "last.ckpt", weights_only=False)["state_dict"]
            _assert_same_tensors(got[0][0], saved, "Lightning checkpoint vs final weights")


def _lightning_worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities.types import DistributedDataParallel as DDPProtocol
    from torch.utils.data import DataLoader, TensorDataset

    from fastddp.integrations import FastDDPStrategy

    out = Path(args.out)

    def data(seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 8, generator=g)
        return TensorDataset(x, x @ torch.randn(8, 2, generator=g) + 0.1 * torch.randn(64, 2, generator=g))

    class Net(L.LightningModule):
        def __init__(self, manual: bool = False):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
            if manual:
                self.unused = torch.nn.Linear(2, 2)  # never in the loss
            self.automatic_optimization = not manual
            self.no_sync_entries = 0
            self.wrapper = ""
            self.protocol_isinstance = False

        def forward(self, x):
            return self.body(x)

        def _loss(self, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def training_step(self, batch, batch_idx):
            if self.automatic_optimization:
                return self._loss(batch)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self._loss(batch))
            opt.step()
            return None

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def on_train_start(self):
            wrapper = self.trainer.strategy.model
            self.wrapper = f"{type(wrapper).__module__}.{type(wrapper).__qualname__}"
            self.protocol_isinstance = isinstance(wrapper, DDPProtocol)
            real = wrapper.no_sync

            @contextlib.contextmanager
            def counting():
                self.no_sync_entries += 1
                with real():
                    yield

            wrapper.no_sync = counting

    strategy_cls = FastDDPStrategy if args.impl == "fastddp" else DDPStrategy
    prefix = "fastddp" if args.impl == "fastddp" else "ddp"
    # Registered names (Lightning's StrategyRegistry) where one exists, else the class.
    fits = {
        "auto_accumulate": (False, prefix, _ACC_STEPS),
        "manual_find_unused": (True, f"{prefix}_find_unused_parameters_true", 1),
        "manual_static_graph": (True, {"static_graph": True}, 1),
    }
    for name, (manual, strategy, acc) in fits.items():
        L.seed_everything(0, workers=True, verbose=False)
        model = Net(manual=manual)
        ckpt = [ModelCheckpoint(dirpath=out / name, save_last=True)] if name == "auto_accumulate" else []
        trainer = L.Trainer(
            strategy=strategy if isinstance(strategy, str) else strategy_cls(**strategy),
            accelerator="cpu", devices=2, max_epochs=2,
            accumulate_grad_batches=acc, limit_val_batches=2, num_sanity_val_steps=0,
            logger=False, enable_checkpointing=bool(ckpt), callbacks=ckpt, enable_progress_bar=False,
            enable_model_summary=False, deterministic=True)
        trainer.fit(model, DataLoader(data(1), batch_size=8, shuffle=True),
                    DataLoader(data(2), batch_size=8))
        r = trainer.global_rank
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{name}_rank{r}.pt")
        (out / f"{name}_rank{r}.json").write_text(json.dumps({
            "wrapper": model.wrapper, "protocol_isinstance": model.protocol_isinstance,
            "no_sync_entries": model.no_sync_entries, "strategy": type(trainer.strategy).__name__,
            "find_unused": bool(trainer.strategy._ddp_kwargs.get("find_unused_parameters")),
            "after_fit": type(trainer.strategy.model).__name__}))
        trainer.strategy.barrier()


# ---------------------------------------------------------------- accelerate
@pytest.mark.slow
def test_accelerate_patch_matches_plain_accelerate(tmp_path):
    pytest.importorskip("accelerate")
    outs = {}
    for impl in ("torch", "fastddp"):
        out = tmp_path / f"accelerate_{impl}"
        out.mkdir()
        # What `accelerate launch --cpu` exports, with torchrun starting the
        # two ranks (accelerate's own --cpu launcher starts >1 process only via MPI).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(THIS), "accelerate", "--impl", impl, "--out", str(out)]
        _run(cmd, timeout=60, cwd=tmp_path, env=_env(ACCELERATE_USE_CPU="true"))
        outs[impl] = out
    ref = _load_rank_results(outs["torch"], "accelerate")
    got = _load_rank_results(outs["fastddp"], "accelerate")
    for r in range(2):
        info, rinfo = got[r][1], ref[r][1]
        assert rinfo["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel", rinfo
        assert info["wrapper"] == "fastddp.ddp.DistributedDataParallel", info
        assert info["distributed_type"] == rinfo["distributed_type"] == "MULTI_CPU"
        assert info["unwrapped"] == rinfo["unwrapped"] == "Sequential"
        assert info["state_dict_keys"] == rinfo["state_dict_keys"]
        assert not any(k.startswith("module.") for k in info["state_dict_keys"])
        assert info["no_sync_entries"] == rinfo["no_sync_entries"] > 0
        assert info["patched_back"], info
        for k in ("after_loop", "after_trigger"):
            _assert_same_tensors(ref[r][0][k], got[r][0][k], f"accelerate {k} rank {r}: fastddp vs torch")
    _assert_same_tensors(got[0][0]["after_trigger"], got[1][0]["after_trigger"], "rank 0 vs rank 1")


def _accelerate_worker(args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from fastddp.integrations import patch_torch_ddp

    out = Path(args.out)
    patch = patch_torch_ddp() if args.impl == "fastddp" else contextlib.nullcontext()
    with patch:
        accelerator = Accelerator(gradient_accumulation_steps=_ACC_STEPS)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(96, 8, generator=g)
        ds = TensorDataset(x, x @ torch.randn(8, 2, generator=g))
        dl = DataLoader(ds, batch_size=8, shuffle=True)
        model, opt, dl = accelerator.prepare(model, opt, dl)
        info = {"wrapper": f"{type(model).__module__}.{type(model).__qualname__}",
                "distributed_type": accelerator.distributed_type.name, "no_sync_entries": 0}
        real_no_sync = model.no_sync

        @contextlib.contextmanager
        def counting():
            info["no_sync_entries"] += 1
            with real_no_sync():
                yield

        model.no_sync = counting
        for _epoch in range(2):
            for xb, yb in dl:
                with accelerator.accumulate(model):  # no_sync on the accumulation steps
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                    accelerator.backward(loss)
                    opt.step()
                    opt.zero_grad()
        after_loop = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

        # Two forwards without sync, the second backward synchronised
        # (accelerate's trigger_sync_in_backward: isinstance + reducer.prepare_for_backward).
        g = torch.Generator().manual_seed(10 + accelerator.process_index)
        xa, xb = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        with accelerator.no_sync(model):
            loss_a = model(xa).square().mean()
            loss_b = model(xb).square().mean()
        accelerator.backward(loss_a)
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)
        opt.step()
        opt.zero_grad()

        unwrapped = accelerator.unwrap_model(model)
        state = accelerator.get_state_dict(model)
        info["unwrapped"] = type(unwrapped).__name__
        info["state_dict_keys"] = sorted(state)
        after_trigger = {k: v.detach().clone() for k, v in state.items()}
        accelerator.wait_for_everyone()
    info["patched_back"] = torch.nn.parallel.DistributedDataParallel is \
        torch.nn.parallel.distributed.DistributedDataParallel
    r = accelerator.process_index
    torch.save({"after_loop": after_loop, "after_trigger": after_trigger}, out / f"accelerate_rank{r}.pt")
    (out / f"accelerate_rank{r}.json").write_text(json.dumps(info))
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("client", choices=("lightning", "accelerate"))
    parser.add_argument("--impl", choices=("fastddp", "torch"), required=True)
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    if ns.impl == "torch":  # torch's DDP has the exit race fastddp guards against (docs/options.md,
        import fastddp  # "A clean exit"): the comparison row gets the same clean exit, as examples/train.py's

        fastddp.install_exit_drain()
    {"lightning": _lightning_worker, "accelerate": _accelerate_worker}[ns.client](ns)
