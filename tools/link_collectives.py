"""gloo's collectives on a real shaped link, bytes per second each way.

    python -m tools.link_collectives netns:0.2 [netns:1 ...]      (root)

Two ranks in network namespaces over a veth pair shaped by ``tc tbf``
(:mod:`tools.netlink`); every collective moves the same bytes each way
(``--mb``, default 8 MiB): a ring all-reduce of fp16, one all-to-all, the same
all-to-all as 8 smaller ones issued together, an all-gather, and a send/recv
pair. Median of 3 after a barrier; rank 0 prints one line per collective.
It answers "which primitive carries a reduction's bytes best on this link":
fastddp's bf16+fp32-sum and fp8 reductions move half their bytes by
all-to-all and half by all-gather, torch's fp16 hook all by all-reduce.
The chunked variants (x4/x8/x16 calls issued together, an all-gather done as
all-to-alls) are the candidates for those reductions' two phases.

    python -m tools.link_collectives netns:1 --paired [--reps 21]      (root)
    python -m tools.link_collectives local --paired                   (loopback, no root)

``--paired`` decides between candidates instead of listing rates: each
comparison's candidates run alternately (the order flipped every
repetition), and rank 0 prints, per candidate, MB/s each way (median), the
rank's CPU time (median) and the paired median of its time over the first
candidate's with the quartiles. Two comparisons: an all-gather in 8 pieces
against the same gather as all-to-alls of each rank's piece twice (the same
bytes on the wire; gloo's all-gather copies through a fresh flat buffer), and
an all-to-all in 8 pieces against 4, 16 and 32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPS = int(os.environ.get("FASTDDP_LINK_REPS", "3"))


def _rank(mb: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    n = mb * 2**20 // 2  # 16-bit elements in mb MiB

    def timed(fn, k: int = REPS) -> float:
        ts = []
        for _ in range(k):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    ar = torch.zeros(n, dtype=torch.float16)  # ring at W=2: n/2 each way twice
    a_in = torch.zeros(2 * n, dtype=torch.bfloat16)
    a_out = torch.empty_like(a_in)
    g_in = torch.zeros(n, dtype=torch.bfloat16)
    g_out = torch.empty(2 * n, dtype=torch.bfloat16)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def a2a_chunks(c: int = 8) -> None:
        ins, outs, m = a_in.view(2, -1), a_out.view(2, -1), n // c
        pieces = [(outs[:, i * m:(i + 1) * m].contiguous(), ins[:, i * m:(i + 1) * m].contiguous())
                  for i in range(c)]
        for w in [dist.all_to_all_single(o, i, async_op=True) for o, i in pieces]:
            w.wait()

    def gather_chunks(c: int = 8) -> None:
        m = n // c
        pieces = [(torch.empty(2 * m, dtype=torch.bfloat16), g_in[i * m:(i + 1) * m]) for i in range(c)]
        for w in [gather(o, i, async_op=True) for o, i in pieces]:
            w.wait()

    def a2a_gather_chunks(c: int = 8) -> None:
        # an all-gather as all-to-alls: each rank sends its piece to every rank
        m = n // c
        pieces = [(torch.empty(2 * m, dtype=torch.bfloat16), g_in[i * m:(i + 1) * m].repeat(2)) for i in range(c)]
        for w in [dist.all_to_all_single(o, i, async_op=True) for o, i in pieces]:
            w.wait()

    def p2p() -> None:
        s, r = torch.zeros(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, s, 1 - rank), dist.P2POp(dist.irecv, r, 1 - rank)]):
            w.wait()

    cases = [("all_reduce (fp16, ring)", lambda: dist.all_reduce(ar)),
             ("all_to_all_single", lambda: dist.all_to_all_single(a_out, a_in)),
             ("all_to_all_single x8 (async)", a2a_chunks),
             ("all_gather", lambda: gather(g_out, g_in)),
             ("all_gather x8 (async)", gather_chunks),
             ("all_to_all_single as gather x8", a2a_gather_chunks),
             ("all_to_all_single x4 (async)", lambda: a2a_chunks(4)),
             ("all_to_all_single x16 (async)", lambda: a2a_chunks(16)),
             ("isend/irecv", p2p)]
    for name, fn in cases:
        s = timed(fn)
        if rank == 0:
            print(f"  {name:30s} {s * 1e3:8.1f} ms  {mb * 1.048576 / s:7.1f} MB/s each way", flush=True)
    dist.destroy_process_group()


def _paired(mb: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = mb * 2**20  # bytes each way

    def gathers(c: int, as_a2a: bool):
        m = n // c
        src = [torch.zeros(m, dtype=torch.uint8) for _ in range(c)]
        two = [torch.zeros(2 * m, dtype=torch.uint8) for _ in range(c)]  # the piece twice
        out = [torch.empty(2 * m, dtype=torch.uint8) for _ in range(c)]

        def run() -> None:
            calls = ([dist.all_to_all_single(out[i], two[i], async_op=True) for i in range(c)] if as_a2a
                     else [gather(out[i], src[i], async_op=True) for i in range(c)])
            for w in calls:
                w.wait()
        return run

    def a2a(c: int):
        inp, out, m = torch.zeros(2 * n, dtype=torch.uint8), torch.empty(2 * n, dtype=torch.uint8), n // c

        def run() -> None:
            for w in [dist.all_to_all_single(out[2 * i * m:2 * (i + 1) * m], inp[2 * i * m:2 * (i + 1) * m],
                                             async_op=True) for i in range(c)]:
                w.wait()
        return run

    comparisons = [
        ("all-gather, 8 pieces", [("all_gather", gathers(8, False)), ("as all_to_all, piece twice", gathers(8, True))]),
        ("all-to-all", [(f"{c} pieces", a2a(c)) for c in (8, 4, 16, 32)]),
    ]
    for title, cands in comparisons:
        wall = {k: [] for k, _ in cands}
        cpu = {k: [] for k, _ in cands}
        for _, fn in cands:  # one warm-up each
            fn()
        for r in range(reps):
            for k, fn in (cands if r % 2 == 0 else cands[::-1]):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        if rank == 0:
            base = cands[0][0]
            print(f"  {title} ({reps} alternations):", flush=True)
            for k, _ in cands:
                rat = [a / b for a, b in zip(wall[k], wall[base])]
                q = statistics.quantiles(rat, n=4) if len(rat) > 1 else [rat[0]] * 3
                print(f"    {k:28s} {mb * 1.048576 / statistics.median(wall[k]):7.1f} MB/s each way  "
                      f"cpu {statistics.median(cpu[k]) * 1e3:6.1f} ms  time / first {statistics.median(rat):.3f} "
                      f"({q[0]:.3f}-{q[2]:.3f})", flush=True)
    dist.destroy_process_group()


def _local_ranks(argv: list[str]) -> None:
    """Two ranks on loopback (no namespaces, no root), on a free port."""
    import socket
    import subprocess

    from .netlink import supervise

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    supervise(procs, timeout_s=600, grace_s=10, where="on loopback")  # a failed rank's peer is not waited for


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.link_collectives", description=__doc__.split("\n\n")[0])
    ap.add_argument("links", nargs="+", help="netns:RATE (Gbit/s), or local (loopback; --paired)")
    ap.add_argument("--mb", type=int, default=8, help="MiB each way per collective")
    ap.add_argument("--paired", action="store_true", help="alternate candidates and compare them (see above)")
    ap.add_argument("--reps", type=int, default=21, help="--paired: alternations per comparison")
    args = ap.parse_args(argv)
    if args.mb < 1 or args.reps < 1:
        ap.error(f"--mb and --reps must be at least 1 (got --mb {args.mb}, --reps {args.reps})")
    from .netlink import NetnsLink, parse_link

    for text in args.links:
        print(f"{text}: {args.mb} MiB each way", flush=True)
        rank_argv = [sys.executable, "-m", "tools.link_collectives"] + (
            ["--_paired", str(args.mb), str(args.reps)] if args.paired else ["--_rank", str(args.mb)])
        if text == "local":
            if not args.paired:
                ap.error("local runs only with --paired (the rates are the shaped link's)")
            _local_ranks(rank_argv)
            continue
        with NetnsLink(parse_link(text)) as link:
            link.run_ranks(rank_argv, timeout_s=600)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_rank":
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        _rank(int(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) == 4 and sys.argv[1] == "--_paired":
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        _paired(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
