"""Other projects' own test code with fastddp swapped in, torch's DDP beside it.

* HF accelerate's DDP scripts, shipped in its wheel
  (``accelerate/test_utils/scripts/test_sync.py`` and
  ``test_ddp_comm_hook.py``), run unchanged from the installed package on 2
  gloo CPU ranks (torchrun, ``ACCELERATE_USE_CPU``): once with torch's DDP,
  once with fastddp swapped in where torch defines the class and at its
  re-export.  CPU variant: the comm-hook script builds its reference model with
  ``device_ids=[rank]``, which torch's DDP refuses for a CPU module, so both
  runs build DDP through the same thin subclass that drops ``device_ids`` /
  ``output_device`` for CPU modules (nothing else changes).  Every hook
  configuration of the comm-hook script runs on its own (the script stops at
  the first failure; torch refuses the bf16 hooks off NCCL), and the results
  are printed side by side.  fastddp must pass every case torch passes.

* The framework checks Lightning's ``tests/tests_pytorch/strategies/test_ddp*.py``
  make (written here, not copied), with ``Trainer(strategy="fastddp")``
  against ``Trainer(strategy="ddp")`` on 2 CPU processes (Lightning's popen
  launcher): the wrapped model is a ``torch.nn.parallel.DistributedDataParallel``
  around the LightningModule while fitting and not wrapped for
  validate/predict (``test_ddp_configure_ddp``); a comm hook with a wrapper
  registered through Lightning's own ``_register_ddp_comm_hook`` (PowerSGD
  behind the fp16 wrapper) gives torch's weights; Lightning's hint for
  "Expected to have finished reduction" (``on_exception``) reaches the user;
  teardown unwraps.  Gradient accumulation (``no_sync``), manual optimization
  and static graph: ``tests/test_clients.py``.

This file is also the worker of those runs:
``python tests/test_frameworks.py accelerate|lightning --impl torch|fastddp --out DIR``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_clients import _env, _free_port, _run  # noqa: E402

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]


# ---------------------------------------------------------------- accelerate
def _accelerate_scripts() -> Path:
    import accelerate

    return Path(accelerate.__file__).resolve().parent / "test_utils" / "scripts"


def _comm_hook_cases(script: Path) -> list[str]:
    """The (hook, wrapper, state options) table of the script's ``main()``,
    read from its source, as expressions to evaluate in the script's globals."""
    tree = ast.parse(script.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.List) and \
                isinstance(node.target, ast.Tuple) and len(node.target.elts) == 3:
            return [ast.unparse(e) for e in node.iter.elts]
    raise AssertionError(f"no (comm_hook, comm_wrapper, comm_state_option) table in {script}")


_LATE: list = []


def _late_group():
    """One :class:`tests.test_late_collectives.LatePG` per process (built at
    the first DDP, the same point on every rank): collectives that complete
    late, so a gradient read before its collective shows at once."""
    if not _LATE:
        import torch.distributed as dist

        from tests.test_late_collectives import LatePG

        _LATE.append(LatePG(dist.new_group(backend="gloo"), seed=int(os.environ["RANK"])))
    return _LATE[0]


def _install_ddp(impl: str, late: bool = False) -> type:
    """Make ``impl``'s class what ``torch.nn.parallel[.distributed].DistributedDataParallel``
    builds, behind the CPU-variant subclass (same for both impls).  ``late``:
    every DDP the scripts build runs on :func:`_late_group` (unless given a group)."""
    import torch.nn.parallel.distributed as defining

    if impl == "fastddp":
        import fastddp

        base = fastddp.DistributedDataParallel
    else:
        base = torch.nn.parallel.DistributedDataParallel

    class CPUVariant(base):
        built = 0

        def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
            if all(p.device.type == "cpu" for p in module.parameters()):
                device_ids = output_device = None  # the scripts' CUDA-only arguments
            if late and len(args) < 3 and "process_group" not in kwargs:
                kwargs["process_group"] = _late_group()
            super().__init__(module, device_ids, output_device, *args, **kwargs)
            type(self).built += 1

    CPUVariant.__name__ = CPUVariant.__qualname__ = f"CPUVariant[{base.__module__}]"
    torch.nn.parallel.DistributedDataParallel = CPUVariant
    defining.DistributedDataParallel = CPUVariant
    return CPUVariant


def _seed_regression_data(rank: int) -> None:
    """accelerate's ``RegressionDataset`` draws fresh OS entropy for every
    dataset it builds (``np.random.default_rng(None)``): each run of its
    scripts trains on other data, and about 1 run in 4000 two ranks' local
    batches give grads within ``allclose``'s tolerance of each other, so its
    check that ``no_sync`` left them unsynchronised fails whatever the DDP
    (seen once in 45 runs here, both ranks' grads exactly the local ones).
    Seeded per rank and per dataset built, the same for both DDPs: every run
    is the same computation, and a failure can be replayed."""
    import itertools

    from accelerate.test_utils import training

    init, built = training.RegressionDataset.__init__, itertools.count()

    def seeded(self, a=2, b=3, length=64, seed=None):
        init(self, a, b, length, 20261202 + 1000 * rank + next(built) if seed is None else seed)
    training.RegressionDataset.__init__ = seeded


def _record_steps(script_globals: dict, n: int = 4):
    """Wrap the script's ``step_model``: for its last ``n`` steps of a DDP
    model, whether the step synchronised, each parameter's grad increment and
    the increment recomputed locally from the step's own batch (a plain copy
    of the module).  A no_sync step whose increment is the local one is right
    whatever the check after it says (the data are drawn fresh each run: two
    ranks' local grads can agree to allclose's tolerance, ~1e-4 of runs).
    Only read into the failure message."""
    import collections
    import copy

    import torch.nn.functional as F

    steps = collections.deque(maxlen=n)
    step_model = script_globals["step_model"]

    def recorded(model, input, target, accelerator, do_backward=True):
        inner = getattr(model, "module", None)
        if inner is None:
            return step_model(model, input, target, accelerator, do_backward)
        before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        local = copy.deepcopy(inner)
        local.zero_grad(set_to_none=True)
        synced = bool(model.require_backward_grad_sync)
        step_model(model, input, target, accelerator, do_backward)
        out = local(input)
        loss = F.mse_loss(out, target.to(out.device))
        (loss / accelerator.gradient_accumulation_steps).backward()
        inc = [float((p.grad - (0 if b is None else b)).flatten()[0]) for p, b in zip(model.parameters(), before)]
        want = [float(q.grad.flatten()[0]) for q in local.parameters()]
        steps.append({"synced": synced, "increment": inc, "local": want,
                      "increment_is_local": inc == want})
    script_globals["step_model"] = recorded
    return steps


def _accelerate_worker(args: argparse.Namespace) -> None:
    import runpy

    from accelerate import PartialState

    cls = _install_ddp(args.impl, late=args.late)
    rank = int(os.environ["RANK"])
    _seed_regression_data(rank)
    out = Path(args.out)
    results: dict[str, str] = {}
    scripts = _accelerate_scripts()

    # test_ddp_comm_hook.py: each configuration on its own.
    hook_script = scripts / "test_ddp_comm_hook.py"
    g = runpy.run_path(str(hook_script), run_name="accelerate_comm_hook_script")
    for case in _comm_hook_cases(hook_script):
        hook, wrapper, state = eval(case, g)  # noqa: S307 - the script's own table
        name = f"test_ddp_comm_hook[{hook.value}/{wrapper.value}/{state or ''}]".replace(" ", "")
        try:
            g["test_ddp_comm_hook"](hook, wrapper, state)
            results[name] = "passed"
        except Exception as e:  # noqa: BLE001 - recorded, compared with torch's run
            results[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if args.verbose:
                traceback.print_exc()
    # Every DDP model the script built went through the swapped name.
    assert issubclass(cls, torch.nn.parallel.distributed.DistributedDataParallel)

    # test_sync.py: its main() as shipped (it destroys the process group at the end).
    sync = runpy.run_path(str(scripts / "test_sync.py"), run_name="accelerate_test_sync")
    steps = _record_steps(sync["main"].__globals__)
    try:
        sync["main"]()
        results["test_sync.main"] = "passed"
    except Exception as e:  # noqa: BLE001
        detail = " | ".join(str(e).splitlines())[:600]  # the grads it compared: which check, how far
        where = " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(e.__traceback__)[-3:]))
        env = {k: v for k, v in os.environ.items() if k.startswith(("FASTDDP", "TRITON", "OMP", "GLOO", "TORCH"))}
        results["test_sync.main"] = (f"failed: {type(e).__name__}: {detail} [at {where}; env {env}; "
                                     f"last DDP steps {list(steps)}]")
        traceback.print_exc()
        if PartialState().use_distributed:
            PartialState().destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    (out / f"rank{rank}.built.json").write_text(json.dumps(
        {"built": cls.built, "mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__],
         "late_calls": _LATE[0].calls if _LATE else 0}))


def _run_accelerate(tmp_path: Path, impl: str, late: bool = False) -> list[dict[str, str]]:
    out = tmp_path / impl
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(THIS), "accelerate", "--impl", impl, "--out", str(out)] + (["--late"] if late else [])
    _run(cmd, timeout=240, cwd=tmp_path, env=_env(ACCELERATE_USE_CPU="true"))
    built = [json.loads((out / f"rank{r}.built.json").read_text()) for r in range(2)]
    for b in built:  # the scripts' DDP models were built through the swapped name
        assert b["built"] >= 20, b
        assert ("fastddp.ddp.DistributedDataParallel" in b["mro"]) == (impl == "fastddp"), b
        assert (b["late_calls"] > 0) == late, b  # late: the collectives went through the late group
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_accelerate_shipped_ddp_scripts_torch_vs_fastddp(tmp_path):
    pytest.importorskip("accelerate")
    torch_res = _run_accelerate(tmp_path, "torch")
    fast_res = _run_accelerate(tmp_path, "fastddp")
    table = "\n".join(f"  {name:72s} torch: {torch_res[0][name]:10.10s}  fastddp: {fast_res[0][name]}"
                      for name in torch_res[0])
    print("accelerate's shipped DDP scripts, 2 gloo CPU ranks:\n" + table)
    # No rerun.  A gradient read before its collective is caught on every run by the
    # late-collectives tests (test_accelerate_scripts_with_late_collectives below,
    # tests/test_late_collectives.py); should test_sync fail here anyway, its record names
    # the check, the grads it compared and whether each DDP step's increment was the local one.
    for r in range(2):
        assert torch_res[r].keys() == fast_res[r].keys()
        assert len(torch_res[r]) >= 11, torch_res[r]  # 10 hook configurations + test_sync
        worse = {k: v for k, v in fast_res[r].items() if v != "passed" and torch_res[r][k] == "passed"}
        assert not worse, f"rank {r}: fails with fastddp, passes with torch's DDP: {worse}\n{table}"
    # fastddp runs every case (incl. bf16 hooks, which torch refuses off NCCL).
    assert all(v == "passed" for v in fast_res[0].values()), table
    assert torch_res[0]["test_sync.main"] == "passed", table


@pytest.mark.slow
def test_accelerate_scripts_with_late_collectives(tmp_path):
    """accelerate's scripts as above, fastddp's DDPs on a process group whose
    collectives complete late (random delays, in order): a gradient read
    before its collective (test_sync's "not in sync when they should be")
    would happen on every run here.  No rerun: every case must pass."""
    pytest.importorskip("accelerate")
    res = _run_accelerate(tmp_path, "fastddp", late=True)
    for r in range(2):
        assert len(res[r]) >= 11, res[r]
        failed = {k: v for k, v in res[r].items() if v != "passed"}
        assert not failed, f"rank {r}, late collectives: {failed}"


# ----------------------------------------------------------------- Lightning
def _lightning_worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.utils.data import DataLoader, TensorDataset

    import fastddp.integrations  # noqa: F401 - registers "fastddp*" (Lightning imported first)

    out = Path(args.out)
    strategy = "fastddp" if args.impl == "fastddp" else "ddp"
    TorchDDP = torch.nn.parallel.DistributedDataParallel
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x @ torch.randn(8, 2, generator=g))

    class Net(L.LightningModule):
        def __init__(self, unused: bool = False):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
            self.unused = torch.nn.Linear(2, 2) if unused else None  # never in the loss
            self.seen: dict[str, object] = {}
            self.hook = None

        def forward(self, x):
            return self.body(x)

        def _wrapper_facts(self, stage):
            m = self.trainer.strategy.model
            self.seen[stage] = {"type": f"{type(m).__module__}.{type(m).__qualname__}",
                                "isinstance_torch_ddp": isinstance(m, TorchDDP),
                                "wraps_module": getattr(m, "module", None) is self,
                                "is_module": m is self}

        def on_fit_start(self):
            self._wrapper_facts("fit")
            if self.hook is not None:  # as DDPStrategy._register_ddp_hooks does on CUDA
                _register_ddp_comm_hook(model=self.trainer.strategy.model, **self.hook)

        def on_validation_start(self):
            self._wrapper_facts("validate")

        def on_predict_start(self):
            self._wrapper_facts("predict")

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            return torch.nn.functional.mse_loss(self(xb), yb)

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        def validation_step(self, batch, batch_idx):
            self.log("val", torch.nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def trainer(**kw):
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kw)

    result: dict[str, object] = {}
    # configure_ddp: wrapped for fit only; teardown unwraps; validate/predict unwrapped.
    L.seed_everything(0, verbose=False)
    model = Net()
    t = trainer(max_steps=3, limit_val_batches=1)
    t.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    result["strategy"] = type(t.strategy).__name__
    result["after_fit_is_module"] = t.strategy.model is model
    t.validate(model, DataLoader(data, batch_size=8), verbose=False)
    preds = t.predict(model, DataLoader(data, batch_size=8))
    result["seen"] = model.seen
    result["n_preds"] = len(preds)
    weights = {"plain": {k: v.detach().clone() for k, v in model.state_dict().items()}}

    # A comm hook with a wrapper through Lightning's registration helper.
    L.seed_everything(0, verbose=False)
    model = Net()
    model.hook = {"ddp_comm_state": powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                                start_powerSGD_iter=2),
                  "ddp_comm_hook": powerSGD_hook.powerSGD_hook,
                  "ddp_comm_wrapper": default_hooks.fp16_compress_wrapper}
    t = trainer(max_steps=4, limit_val_batches=0)
    t.fit(model, DataLoader(data, batch_size=8))
    weights["powersgd_fp16"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # An unused parameter without find_unused_parameters: the second step fails with
    # torch's sentence, and DDPStrategy.on_exception adds Lightning's hint.
    L.seed_everything(0, verbose=False)
    t = trainer(max_steps=3, limit_val_batches=0)
    try:
        t.fit(Net(unused=True), DataLoader(data, batch_size=8))
        result["unused_error"] = ""
    except RuntimeError as e:
        result["unused_error"] = str(e)
    rank = t.global_rank
    torch.save(weights, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def _run_lightning(tmp_path: Path, impl: str) -> list[tuple[dict, dict]]:
    out = tmp_path / f"lightning_{impl}"
    out.mkdir()
    # Lightning's popen launcher re-runs this script for rank 1.
    _run([sys.executable, str(THIS), "lightning", "--impl", impl, "--out", str(out)], timeout=180,
         cwd=tmp_path, env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())))
    return [(json.loads((out / f"rank{r}.json").read_text()), torch.load(out / f"rank{r}.pt", weights_only=True))
            for r in range(2)]


@pytest.mark.slow
def test_lightning_ddp_checks_torch_vs_fastddp(tmp_path):
    pytest.importorskip("lightning")
    from tests.test_clients import _assert_same_tensors

    ref = _run_lightning(tmp_path, "torch")
    got = _run_lightning(tmp_path, "fastddp")
    for r in range(2):
        (info, w), (rinfo, rw) = got[r], ref[r]
        assert rinfo["strategy"] == "DDPStrategy" and info["strategy"] == "FastDDPStrategy", info
        assert info["seen"]["fit"].pop("type") == "fastddp.ddp.DistributedDataParallel", info
        assert rinfo["seen"]["fit"].pop("type") == "torch.nn.parallel.distributed.DistributedDataParallel"
        fit = {"isinstance_torch_ddp": True, "wraps_module": True, "is_module": False}
        unwrapped = {"type": "__main__._lightning_worker.<locals>.Net", "isinstance_torch_ddp": False, "wraps_module": False,
                     "is_module": True}
        assert rinfo["seen"] == info["seen"] == {"fit": fit, "validate": unwrapped, "predict": unwrapped}, info
        assert info["after_fit_is_module"] and rinfo["after_fit_is_module"]
        assert info["n_preds"] == rinfo["n_preds"] > 0
        for what in ("plain", "powersgd_fp16"):
            _assert_same_tensors(rw[what], w[what], f"{what} rank {r}: fastddp vs torch's DDPStrategy")
        # DDPStrategy.on_exception's hint replaces torch's sentence; fastddp's names its own option.
        for e in (info["unused_error"], rinfo["unused_error"]):
            assert e.startswith("It looks like your LightningModule has parameters that were not used"), e
        assert "strategy='ddp_find_unused_parameters_true'" in rinfo["unused_error"]
        assert "strategy='fastddp_find_unused_parameters_true'" in info["unused_error"], info
        assert "FastDDPStrategy(find_unused_parameters=True)" in info["unused_error"], info
    _assert_same_tensors(got[0][1]["powersgd_fp16"], got[1][1]["powersgd_fp16"], "rank 0 vs rank 1")
    assert not all(torch.equal(got[0][1]["plain"][k], got[0][1]["powersgd_fp16"][k])
                   for k in got[0][1]["plain"]), "the comm hook changed nothing"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("client", choices=("accelerate", "lightning"))
    parser.add_argument("--impl", choices=("fastddp", "torch"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--late", action="store_true", help="accelerate: DDPs on a late-collectives group")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    if ns.impl == "torch":  # torch's DDP has the exit race fastddp guards against (docs/options.md,
        import fastddp  # "A clean exit"): the comparison row gets the same clean exit, as examples/train.py's

        fastddp.install_exit_drain()
    {"accelerate": _accelerate_worker, "lightning": _lightning_worker}[ns.client](ns)
