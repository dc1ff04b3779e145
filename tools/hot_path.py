"""Count the calls and files one bucket's gradient passes through, from the
autograd hook to the collective and from the end-of-backward wait to
``.grad``, in a real one-rank gloo step of fastddp's default path.

    python tools/hot_path.py [--view] [--hook fp16|fp8|fp32acc]

It profiles the Python frames of fastddp and fastddp.kernels (native code
and torch are not counted): for the way out, the frames of the longest chain that
packs the bucket and of the chain that asks ``torch.distributed`` for its
collective; for the unpack, the longest chain of
frames below the finalize callback that reaches the op writing ``.grad``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours(frame) -> bool:
    f = frame.f_code.co_filename
    return f.startswith(ROOT) and "/tools/" not in f


def _chain(frame) -> list[str]:
    out = []
    while frame is not None:
        if _ours(frame):
            out.append(f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--view", action="store_true", help="gradient_as_bucket_view=True")
    ap.add_argument("--hook", choices=["fp16", "fp8", "fp32acc"], default=None)
    args = ap.parse_args(argv)
    import fastddp
    from fastddp import hooks

    path = os.path.join(tempfile.mkdtemp(prefix="fastddp-hot-"), "pg")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = fastddp.DistributedDataParallel(model, gradient_as_bucket_view=args.view)
    if args.hook:
        fn = {"fp16": hooks.fp16_compress_hook, "fp8": hooks.fp8_compress_hook,
              "fp32acc": hooks.bf16_fp32acc_hook}[args.hook]
        ddp.register_comm_hook(None, fn)
    x = torch.randn(16, 64)
    for _ in range(3):  # past the rebuild
        ddp.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
    issue, pack, unpack, handover = [], [], [], []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ("all_reduce", "all_to_all_single") \
                and "distributed_c10d" in frame.f_code.co_filename and not issue:
            issue.append(_chain(frame.f_back))
        elif event == "call" and _ours(frame) and not any(":_finalize" in s for s in _chain(frame)):
            c = _chain(frame)
            if any(":_native_chain" in s for s in c) and len(c) > len(handover):
                handover[:] = c  # the native issue chain hands over: once a step, after the last issue
        elif event == "c_call" and _ours(frame):
            c = _chain(frame)
            if any(":_finalize" in s for s in c) and any("unpack" in s or "chain.py:finish" in s for s in c) \
                    and len(c) > len(unpack):
                unpack[:] = c
            elif not issue and not any(":_finalize" in s for s in c) and any(":pack" in s for s in c) \
                    and len(c) > len(pack):
                pack[:] = c
    ddp.zero_grad(set_to_none=True)
    loss = ddp(x).sum()
    sys.setprofile(prof)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    to_wire = list(dict.fromkeys(pack + (issue[0] if issue else [])))  # the pack's chain, then the issue's
    rows = [("hook -> collective (pack and issue)", to_wire), ("wait -> .grad", unpack)]
    if ddp.reducer.arming.chaining:  # packed and issued in C++: no Python before the collective
        rows.insert(1, ("the native issue chain's hand-over, once a step after its waits and unpacks", handover))
    for what, c in rows:
        files = sorted({s.split(":")[0] for s in c})
        print(f"{what}: {len(c)} calls in {len(files)} files")
        for s in c:
            print("   ", s)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
