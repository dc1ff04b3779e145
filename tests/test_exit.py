"""The exit path, looped: 2 gloo ranks train a few steps with a comm hook and
end WITHOUT ``destroy_process_group``; every rank must exit with status 0.

Guards against an intermittent ``terminate called without an active
exception`` after a script's last line (issue: one rank aborting at exit).
Every exit is a real interpreter finalisation: a parent process imports torch
and fastddp once, then each round forks two ranks that build their process
group, train, and leave through ``sys.exit(0)`` (atexit handlers, module
teardown, the process group's C++ destructor), so a round costs one short
training run, not two interpreter starts.  Hooks: torch's PowerSGD behind
torch's fp16 wrapper (Python ``Future.then`` callbacks run on gloo's worker
threads) and fastddp's fused fp16 hook (no Python callback).

Also the worker: ``python tests/test_exit.py IMPL HOOK ROUNDS`` prints one
line per failed round and ``failures F/N``.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
ROUNDS = 10  # per hook
ROUND_TIMEOUT_S = 60  # a round that takes longer counts as failed (hung), its ranks killed


def _rank(impl: str, hook: str, rank: int, init_file: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=ROUND_TIMEOUT_S))
    if impl == "fastddp":
        import fastddp

        DDP = fastddp.DistributedDataParallel
    else:
        DDP = torch.nn.parallel.DistributedDataParallel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)  # a few buckets: several futures per step
    if hook == "powersgd_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook))
    elif hook == "fastddp_fp16":
        import fastddp.hooks

        ddp.register_comm_hook(None, fastddp.hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        ddp(torch.randn(8, 16)).sum().backward()
        if step < 3:  # the script's last line is a backward: the tightest exit
            opt.step()
            opt.zero_grad()


def _wait_round(pids: list[int]) -> list[int | str]:
    import time

    deadline, codes = time.monotonic() + ROUND_TIMEOUT_S, {}
    while len(codes) < len(pids):
        for p in pids:
            if p not in codes:
                done, status = os.waitpid(p, os.WNOHANG)
                if done:
                    codes[p] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            for p in pids:
                if p not in codes:
                    os.kill(p, signal.SIGKILL)
                    os.waitpid(p, 0)
                    codes[p] = "hung"
        time.sleep(0.02)
    return [codes[p] for p in pids]


def _loop(impl: str, hook: str, rounds: int) -> int:
    import tempfile

    import torch
    import torch._dynamo  # noqa: F401 - what frameworks import (and torch.optim on first use): once, here
    import torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    if impl == "fastddp":
        import fastddp  # noqa: F401
    failures, parent = 0, os.getpid()
    tmp = tempfile.mkdtemp()  # no context manager: the ranks' sys.exit unwinds through this frame
    try:
        for n in range(rounds):
            init_file = os.path.join(tmp, f"init{n}")
            pids = []
            for r in range(2):
                pid = os.fork()
                if pid == 0:  # a rank: train, then finalise the interpreter normally
                    try:
                        _rank(impl, hook, r, init_file)
                    except BaseException:
                        import traceback

                        traceback.print_exc()
                        os._exit(3)
                    sys.exit(0)
                pids.append(pid)
            codes = _wait_round(pids)
            if any(codes):
                failures += 1
                print(f"round {n}: exit codes {codes} (negative: killed by that signal)", flush=True)
    finally:
        if os.getpid() == parent:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"failures {failures}/{rounds}", flush=True)
    return failures


#: Python 3.12 + torch 2.11 (the GPU machine's stack): ranks using torch's
#: PowerSGD behind its fp16 wrapper (Python ``Future.then`` callbacks on gloo's
#: threads) abort at exit with torch's OWN DDP too: 4 of 30 rounds, against
#: fastddp's 1 of 10 and 0 of 30 (the same loop, python tests/test_exit.py
#: torch|fastddp powersgd_fp16 30).  Not fastddp's to fix; Python 3.11 +
#: torch 2.13 gave 0 in 166 with either class, and fastddp's own fused hook
#: (no Python callback) is held to 0 on every stack.
_TORCH_ABORTS_TOO = sys.version_info >= (3, 12)


@pytest.mark.slow
@pytest.mark.parametrize("hook", [
    pytest.param("powersgd_fp16", marks=pytest.mark.skipif(
        _TORCH_ABORTS_TOO, reason="torch's own DDP aborts at exit with this hook on this Python "
                                  "(4/30 rounds, see _TORCH_ABORTS_TOO)")),
    "fastddp_fp16"])
def test_exit_without_destroy_process_group_is_clean(hook):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(THIS), "fastddp", hook, str(ROUNDS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    tail = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, tail
    assert f"failures 0/{ROUNDS}" in proc.stdout, tail
    assert "terminate called" not in proc.stderr, tail


if __name__ == "__main__":
    sys.exit(1 if _loop(sys.argv[1], sys.argv[2], int(sys.argv[3])) else 0)
