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

This file is also the worker of those runs:
``python tests/test_frameworks.py accelerate --impl torch|fastddp --out DIR``.
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


def _install_ddp(impl: str) -> type:
    """Make ``impl``'s class what ``torch.nn.parallel[.distributed].DistributedDataParallel``
    builds, behind the CPU-variant subclass (same for both impls)."""
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
            super().__init__(module, device_ids, output_device, *args, **kwargs)
            type(self).built += 1

    CPUVariant.__name__ = CPUVariant.__qualname__ = f"CPUVariant[{base.__module__}]"
    torch.nn.parallel.DistributedDataParallel = CPUVariant
    defining.DistributedDataParallel = CPUVariant
    return CPUVariant


def _accelerate_worker(args: argparse.Namespace) -> None:
    import runpy

    from accelerate import PartialState

    cls = _install_ddp(args.impl)
    rank = int(os.environ["RANK"])
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
    try:
        runpy.run_path(str(scripts / "test_sync.py"), run_name="__main__")
        results["test_sync.main"] = "passed"
    except Exception as e:  # noqa: BLE001
        results["test_sync.main"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        traceback.print_exc()
        if PartialState().use_distributed:
            PartialState().destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    (out / f"rank{rank}.built.json").write_text(json.dumps(
        {"built": cls.built, "mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__]}))


def _run_accelerate(tmp_path: Path, impl: str) -> list[dict[str, str]]:
    out = tmp_path / impl
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(THIS), "accelerate", "--impl", impl, "--out", str(out)]
    _run(cmd, timeout=240, cwd=tmp_path, env=_env(ACCELERATE_USE_CPU="true"))
    built = [json.loads((out / f"rank{r}.built.json").read_text()) for r in range(2)]
    for b in built:  # the scripts' DDP models were built through the swapped name
        assert b["built"] >= 20, b
        assert ("fastddp.ddp.DistributedDataParallel" in b["mro"]) == (impl == "fastddp"), b
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_accelerate_shipped_ddp_scripts_torch_vs_fastddp(tmp_path):
    pytest.importorskip("accelerate")
    torch_res = _run_accelerate(tmp_path, "torch")
    fast_res = _run_accelerate(tmp_path, "fastddp")
    table = "\n".join(f"  {name:72s} torch: {torch_res[0][name]:10.10s}  fastddp: {fast_res[0][name]}"
                      for name in torch_res[0])
    print("accelerate's shipped DDP scripts, 2 gloo CPU ranks:\n" + table)
    for r in range(2):
        assert torch_res[r].keys() == fast_res[r].keys()
        assert len(torch_res[r]) >= 11, torch_res[r]  # 10 hook configurations + test_sync
        worse = {k: v for k, v in fast_res[r].items() if v != "passed" and torch_res[r][k] == "passed"}
        assert not worse, f"rank {r}: fails with fastddp, passes with torch's DDP: {worse}\n{table}"
    # fastddp runs every case (incl. bf16 hooks, which torch refuses off NCCL).
    assert all(v == "passed" for v in fast_res[0].values()), table
    assert torch_res[0]["test_sync.main"] == "passed", table


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("client", choices=("accelerate",))
    parser.add_argument("--impl", choices=("fastddp", "torch"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--verbose", action="store_true")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    {"accelerate": _accelerate_worker}[ns.client](ns)
