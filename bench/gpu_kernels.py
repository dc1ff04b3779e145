"""GPU measurement of fastddp's pack/unpack kernels (bench/gpu_check.sh runs it).

    python bench/gpu_kernels.py [--out reports | --dest DIR] [--quick] [--time-budget S]
    python bench/gpu_kernels.py --cpu-smoke     # exercise this script on CPU (no figures worth keeping)

``--cpu-smoke`` runs every code path on a tiny CPU bucket (7 tensors): with
``TRITON_INTERPRET=1`` the fastddp rows run the Triton kernel source in the
interpreter, so bench/gpu_check.sh --dry-run checks this script on a CPU
machine in seconds.

For each bucket shape and wire dtype, fastddp's kernels and the ways torch
does it today (per-tensor ``copy_`` + ``mul_``; ``_foreach_copy_`` + one
``mul_``; ``torch.cat`` + ``mul_``) are timed three ways:

* **device time** per call: a ``torch.cuda._sleep`` holds the stream while the
  host queues R calls, then CUDA events bracket them, so host overhead is
  hidden and the figure is the GPU's own time (kernels + gaps between them);
* **synchronised call**: wall time of one call followed by a synchronize;
* **host overhead**: wall time of the Python call alone (the GPU busy).

plus achieved GB/s (bytes read + written / device time) against the device's
measured copy bandwidth (a large ``Tensor.copy_`` timed with CUDA events),
launches per call (fastddp's counter, and CUDA kernels seen by
``torch.profiler``), a bit-exact check against ``fastddp.kernels.reference``,
and a sweep of the kernels' BLOCK.  Writes ``reports/<gpu-slug>/kernels.md``
and ``kernels.json`` (with torch / triton / CUDA versions), or
``<dest>/kernels.md`` / ``.json`` with ``--dest``; both files are rewritten
after every bucket shape, and ``--time-budget`` stops starting new cases
once that many seconds have passed (``meta.truncated`` says so), so a run cut
short still leaves what it measured.

Before ``torch.cuda._sleep`` is calibrated the GPU is kept busy for ~0.3 s
(matmuls) so its clocks have ramped up: the sleep is counted in SM cycles,
and a calibration at idle clocks would make the sleeps too short at boost
clocks.  A measurement whose host enqueue outlasted the sleep (so host time
leaked into the device figure) is flagged ``host_bound``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

SCALE = float(np.float32(1 / 8))  # fp32(1/W) for W = 8
SHAPES = {
    "many_small": (600, 4096),      # launch / overhead bound: 2.4M elements
    "bucket_25mb": (100, 65536),    # a torch-default-sized bucket of mid tensors
    "few_large": (4, 4 << 20),      # bandwidth bound: 16M elements
}
#: --cpu-smoke: odd sizes, one tensor larger than the interpreter's BLOCK.
SMOKE_SHAPES = {"smoke": (7, 2500)}
WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- timing
class Clock:
    """Device time, synchronised wall time and host overhead of a callable."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._cycles_per_us = None
        self.last_host_bound = False  # the last device_us: host enqueue outlasted the sleep

    def warm_up(self, seconds: float = 0.3) -> None:
        """Keep the GPU busy so its clocks ramp up before anything is timed."""
        if not self.cuda:
            return
        a = torch.randn(4096, 4096, device=self.device)
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            self.sync()
        del a

    def calibrate(self) -> float:
        """Cycles per us of ``torch.cuda._sleep``: after a warm-up, the
        fastest of 5 trials (the highest clock gives the longest real sleep
        for a cycle count computed from it)."""
        if self._cycles_per_us is None and self.cuda:
            self.warm_up()
            best = 0.0
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                torch.cuda._sleep(5_000_000)
                b.record()
                b.synchronize()
                best = max(best, 5_000_000 / max(a.elapsed_time(b) * 1e3, 1.0))
            self._cycles_per_us = best
        return self._cycles_per_us or 0.0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _sleep_us(self, us: float):
        if not self.cuda:
            return
        torch.cuda._sleep(int(us * self.calibrate()))

    def host_us(self, fn, reps: int) -> float:
        """Median wall time of ``fn()`` alone (no synchronize in between)."""
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        self.sync()
        return statistics.median(times) * 1e6

    def synced_us(self, fn, reps: int) -> float:
        times = []
        for _ in range(reps):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    def device_us(self, fn, reps: int, host_us: float, trials: int = 3) -> float:
        """GPU time per call with the host's enqueue cost hidden behind a sleep."""
        if not self.cuda:
            return self.synced_us(fn, reps)
        out = []
        self.last_host_bound = False
        for _ in range(trials):
            self.sync()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sleep_us = host_us * reps * 1.5 + 200
            self._sleep_us(sleep_us)
            t = time.perf_counter()
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            enqueue_us = (time.perf_counter() - t) * 1e6
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e3 / reps)
            if enqueue_us > sleep_us:
                self.last_host_bound = True
        return min(out)


def copy_bandwidth_gbs(clock: Clock, nbytes: int = 1 << 30) -> float:
    """Read + write GB/s of a large same-dtype ``Tensor.copy_``."""
    n = nbytes // 4
    x = torch.randn(n, device=clock.device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    us = clock.device_us(lambda: y.copy_(x), reps=10, host_us=20)
    del x, y
    return 2 * nbytes / (us * 1e-6) / 1e9


def kernels_per_call(fn, device: torch.device, calls: int = 3) -> tuple[float | None, float | None]:
    """(CUDA kernels, memcpys) per call, as torch.profiler sees them."""
    if device.type != "cuda":
        return None, None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = memcpy = 0
    for e in prof.events():
        if getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
            continue
        name = e.name.lower()
        if "memcpy" in name or "memset" in name:
            memcpy += 1
        else:
            kernels += 1
    return kernels / calls, memcpy / calls


# ------------------------------------------------------------- the methods
def make_bucket(shape: str, wire: str, device: torch.device, shapes: dict = SHAPES, seed: int = 0):
    import fastddp.kernels as K

    n_t, n = shapes[shape]
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen).to(device) for _ in range(n_t)]
    flat = torch.empty(n_t * n, dtype=WIRE[wire], device=device)
    lay = K.Layout.for_tensors(grads)
    return grads, flat, lay, lay.views(flat)


def pack_methods(grads, flat, lay, views):
    from fastddp.bench.baselines import pack_methods as methods

    return methods(grads, flat, lay, views, SCALE)


def unpack_methods(grads, flat, lay, views, accumulate: bool):
    from fastddp.bench.baselines import unpack_methods as methods

    return methods(grads, flat, lay, views, SCALE, accumulate)


def check_exact(op: str, grads, flat, lay, accumulate: bool = False) -> bool:
    """fastddp's result equals the reference's, bit for bit (NaN as NaN)."""
    import fastddp.kernels as K
    from fastddp.kernels import reference

    def same(a, b):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
        an, bn = a.isnan(), b.isnan()
        eq = a.view(ints[a.element_size()]) == b.view(ints[b.element_size()])
        return bool(torch.equal(an, bn) and (eq | an).all())

    if op == "pack":
        got, want = torch.empty_like(flat), torch.empty_like(flat)
        K.pack(grads, got, layout=lay, scale=SCALE)
        reference.pack(grads, want, scale=SCALE)
        return same(got, want)
    got = [g.clone() for g in grads]
    want = [g.clone() for g in grads]
    K.unpack(flat, got, layout=lay, scale=SCALE, accumulate=accumulate)
    reference.unpack(flat, want, scale=SCALE, accumulate=accumulate)
    return all(same(a, b) for a, b in zip(got, want))


def measure(clock: Clock, fn, nbytes: int, reps: int) -> dict:
    import fastddp.kernels as K

    for _ in range(3):  # warm up: compile, plans, allocator
        fn()
    clock.sync()
    K.reset_launch_count()
    fn()
    launches = K.launch_count()
    clock.sync()
    host = clock.host_us(fn, reps)
    synced = clock.synced_us(fn, reps)
    dev = clock.device_us(fn, reps, host)
    kern, memcpy = kernels_per_call(fn, clock.device)
    out = {
        "device_us": round(dev, 2), "synced_us": round(synced, 2), "host_us": round(host, 2),
        "GB/s": round(nbytes / (dev * 1e-6) / 1e9, 1), "triton_launches": launches,
        "cuda_kernels": kern, "memcpys": memcpy,
    }
    if clock.last_host_bound:
        out["host_bound"] = True
    return out


FP8_BLOCK = 256


def lowprec_cases(n: int, device: torch.device, seed: int = 0) -> dict:
    """The low-precision reductions' own launches on one flat fp32 bucket of
    ``n`` elements (padded to whole fp8 blocks): name -> (fn, bytes read +
    written, reference fn computing the same outputs).  W = 2 for the shard sums."""
    import fastddp.kernels as K
    from fastddp.kernels import reference

    n = -(-n // (2 * FP8_BLOCK)) * 2 * FP8_BLOCK
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen).to(device)
    res0 = (torch.randn(n, generator=gen) * 1e-3).to(device)
    nb = n // FP8_BLOCK
    q, sc = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(nb, device=device)
    out = torch.empty(n, device=device)
    bf = torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16)  # 2 slices of n/2
    bf_out = torch.empty(n // 2, dtype=torch.bfloat16, device=device)
    res = res0.clone()
    K.quantize_fp8(x, q, sc, FP8_BLOCK)  # valid inputs for the dequantize / shard rows
    qq, ss = q.clone(), sc.clone()
    q_out, s_out = torch.empty(n // 2, dtype=torch.uint8, device=device), torch.empty(nb // 2, device=device)

    def quant_ef():
        res.copy_(res0)  # the same input every call (a copy of n fp32: counted in the bytes)
        K.quantize_fp8(x, q, sc, FP8_BLOCK, residual=res)

    def quant_ef_ref():
        r = res0.clone()
        a, b = torch.empty_like(q), torch.empty_like(sc)
        reference.quantize_fp8(x, a, b, FP8_BLOCK, residual=r)
        return a, b, r

    def fp8_sum_ref():
        a, b = torch.empty_like(q_out), torch.empty_like(s_out)
        reference.reduce_fp8_shards(qq, ss, a, b, 2, FP8_BLOCK)
        return a, b

    cases = {
        "fp8 quantize+ef": (quant_ef, n * (4 + 4 + 4 + 4 + 1) + nb * 4, quant_ef_ref, lambda: (q, sc, res)),
        "fp8 dequantize": (lambda: K.dequantize_fp8(qq, ss, out, FP8_BLOCK), n * (1 + 4) + nb * 4,
                           lambda: (reference.dequantize_fp8(qq, ss, torch.empty_like(out), FP8_BLOCK),),
                           lambda: (out,)),
        "fp8 shard sum W=2": (lambda: K.reduce_fp8_shards(qq, ss, q_out, s_out, 2, FP8_BLOCK),
                              n * 1 + nb * 4 + (n // 2) * 1 + (nb // 2) * 4, fp8_sum_ref, lambda: (q_out, s_out)),
        "bf16 shard sum W=2": (lambda: K.reduce_shards(bf, bf_out, 2), n * 2 + (n // 2) * 2,
                               lambda: (reference.reduce_shards(bf, torch.empty_like(bf_out), 2),),
                               lambda: (bf_out,)),
    }
    return cases


def lowprec_rows(clock, shapes: dict, reps: int, meta: dict, rows: list) -> None:
    """GB/s of the bf16-fp32acc and fp8 launches against the copy bandwidth,
    launches per call, and bit-exactness against the reference (where the
    case returns its outputs)."""
    def same(a, b):
        return torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b)

    for shape, (n_t, n) in shapes.items():
        for name, (fn, nbytes, ref, got) in lowprec_cases(n_t * n, clock.device).items():
            r = measure(clock, fn, nbytes, reps)
            r.update(op=name, shape=shape, wire="-", method="fastddp", tensors=1, elements=n_t * n,
                     bytes=nbytes, pct_copy=round(100 * r["GB/s"] / meta["copy_GB/s"], 1))
            if got is not None:  # bit for bit against the reference
                fn()
                want = ref()
                r["bit_exact"] = all(same(a.cpu(), b.cpu()) for a, b in zip(got(), want))
            rows.append(r)
            print(f"  {name:<19}{shape:<12} dev {r['device_us']:9.1f} us  {r['GB/s']:7.1f} GB/s "
                  f"({r['pct_copy']:5.1f}%)  launches {r['triton_launches']}", flush=True)


def run(args, save=None) -> dict:
    """Measure; ``save(res)`` is called after every bucket shape (and at the end)."""
    import triton

    import fastddp.kernels as K
    from fastddp.kernels import _triton_common as TC

    device = torch.device("cuda" if not args.cpu_smoke else "cpu")
    clock = Clock(device)
    reps = 3 if args.cpu_smoke else 20
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    t_start = time.perf_counter()

    def out_of_time() -> bool:
        return args.time_budget is not None and time.perf_counter() - t_start > args.time_budget
    name = torch.cuda.get_device_name(device) if clock.cuda else f"cpu-smoke-{platform.machine()}"
    meta = {
        "device": name, "date": _dt.date.today().isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "backend": K.backend(device), "scale": SCALE, "block": TC.BLOCK_GPU, "num_warps": TC.NUM_WARPS_GPU,
    }
    print(f"[gpu_kernels] {name}: torch {torch.__version__}, triton {triton.__version__}, "
          f"backend {meta['backend']}", flush=True)
    if clock.cuda:
        meta["sleep_cycles_per_us"] = round(clock.calibrate(), 1)  # warms the GPU first
    meta["copy_GB/s"] = round(copy_bandwidth_gbs(clock, (4 << 20) if args.cpu_smoke else (1 << 30)), 1)
    print(f"[gpu_kernels] copy bandwidth {meta['copy_GB/s']} GB/s (read + write)", flush=True)
    meta["truncated"] = False
    res = {"meta": meta, "rows": [], "block_sweep": []}
    rows = res["rows"]

    cases = [("pack", w, False) for w in ("fp32", "bf16", "fp16")] + \
            [("unpack", w, acc) for w in ("fp32", "bf16") for acc in (False, True)]
    if args.quick:
        cases = [("pack", "fp32", False), ("pack", "bf16", False), ("unpack", "bf16", True)]
    for shape in shapes:
        for op, wire, acc in cases:
            if out_of_time():
                meta["truncated"] = True
                break
            grads, flat, lay, views = make_bucket(shape, wire, device, shapes)
            nbytes = sum(g.numel() for g in grads) * (4 + flat.element_size()) + \
                (sum(g.numel() for g in grads) * 4 if acc else 0)  # acc also reads the grads
            if op == "pack":
                flat.zero_()
                methods = pack_methods(grads, flat, lay, views)
            else:
                flat.copy_(torch.randn(flat.numel(), device=device).to(flat.dtype))
                methods = unpack_methods(grads, flat, lay, views, acc)
            exact = check_exact(op, grads, flat, lay, acc)
            for method, fn in methods.items():
                r = measure(clock, fn, nbytes, reps)
                r.update(op=op + ("+acc" if acc else ""), shape=shape, wire=wire, method=method,
                         tensors=len(grads), elements=sum(g.numel() for g in grads), bytes=nbytes,
                         pct_copy=round(100 * r["GB/s"] / meta["copy_GB/s"], 1))
                if method == "fastddp":
                    r["bit_exact"] = exact
                rows.append(r)
                print(f"  {r['op']:<11}{shape:<12}{wire:<5}{method:<8} dev {r['device_us']:9.1f} us  "
                      f"{r['GB/s']:7.1f} GB/s ({r['pct_copy']:5.1f}%)  host {r['host_us']:7.1f} us  "
                      f"launches {r['triton_launches']} kernels {r['cuda_kernels']}"
                      + ("  HOST-BOUND" if r.get("host_bound") else ""), flush=True)
            del grads, flat, lay, views, methods
        if save is not None:
            save(res)

    if not out_of_time():
        lowprec_rows(clock, shapes, reps, meta, rows)
        if save is not None:
            save(res)

    sweep = res["block_sweep"]
    if clock.cuda and not args.quick and not out_of_time():
        saved = TC.BLOCK_GPU
        try:
            for shape in ("many_small", "few_large"):
                grads, flat, lay, views = make_bucket(shape, "bf16", device, shapes)
                nbytes = sum(g.numel() for g in grads) * 6
                for block in (1024, 2048, 4096, 8192):
                    if out_of_time():
                        meta["truncated"] = True
                        break
                    TC.BLOCK_GPU = block  # plans are keyed by BLOCK: a new one is built
                    fn = pack_methods(grads, flat, lay, views)["fastddp"]
                    r = measure(clock, fn, nbytes, reps)
                    sweep.append({"shape": shape, "op": "pack fp32->bf16", "block": block,
                                  "device_us": r["device_us"], "GB/s": r["GB/s"]})
                    print(f"  sweep {shape:<12} BLOCK {block:5d}: {r['device_us']:8.1f} us {r['GB/s']:7.1f} GB/s",
                          flush=True)
                del grads, flat, lay, views
        finally:
            TC.BLOCK_GPU = saved
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    if save is not None:
        save(res)
    return res


def to_markdown(res: dict) -> str:
    m = res["meta"]
    out = [f"# fastddp kernels on {m['device']}", "",
           f"{m['date']} - torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, python {m['python']}; "
           f"BLOCK {m['block']}, {m['num_warps']} warps; scale fp32(1/8).", "",
           f"Device copy bandwidth (large `copy_`, read + write): **{m['copy_GB/s']} GB/s**.", "",
           *([f"**Truncated**: the time budget ran out after {len(res['rows'])} rows.", ""]
             if m.get("truncated") else []),
           "device us: GPU time per call (host hidden); synced us: one call + synchronize; host us: the "
           "Python call alone. GB/s = bytes read + written / device time. launches: Triton launches "
           "(fastddp counter); kernels / memcpys: as torch.profiler sees them, per call.", "",
           "| op | shape | wire | method | device us | GB/s | % of copy | synced us | host us | launches | kernels | memcpys | exact |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        out.append(f"| {r['op']} | {r['shape']} ({r['tensors']}x{r['elements'] // r['tensors']}) | {r['wire']} | "
                   f"{r['method']} | {r['device_us']} | {r['GB/s']} | {r['pct_copy']} | {r['synced_us']} | "
                   f"{r['host_us']} | {r['triton_launches']} | {r['cuda_kernels']} | {r['memcpys']} | "
                   f"{r.get('bit_exact', '')}{' (host-bound)' if r.get('host_bound') else ''} |")
    if res["block_sweep"]:
        out += ["", "BLOCK sweep (pack fp32 -> bf16, fastddp):", "", "| shape | BLOCK | device us | GB/s |",
                "|---|---:|---:|---:|"]
        out += [f"| {s['shape']} | {s['block']} | {s['device_us']} | {s['GB/s']} |" for s in res["block_sweep"]]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports", help="reports folder (default: reports); files go to <out>/<device>/")
    ap.add_argument("--dest", help="write kernels.md and kernels.json straight into this folder instead")
    ap.add_argument("--time-budget", type=float, metavar="S",
                    help="start no new case after S seconds (the files say the run was truncated)")
    ap.add_argument("--quick", action="store_true", help="fewer cases, no BLOCK sweep")
    ap.add_argument("--cpu-smoke", action="store_true", help="run the script's logic on CPU (figures meaningless)")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_kernels.py: no CUDA device visible (torch.cuda.is_available() is False); "
              "nothing measured. Run it on a GPU machine (bench/gpu_check.sh), or pass --cpu-smoke "
              "to exercise the script on CPU.", file=sys.stderr)
        return 2
    where: list[Path] = []

    def save(res: dict) -> None:
        from fastddp.bench.export import slugify

        folder = Path(args.dest) if args.dest else Path(args.out) / slugify(res["meta"]["device"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernels.json").write_text(json.dumps(res, indent=1) + "\n")
        (folder / "kernels.md").write_text(to_markdown(res))
        where[:] = [folder]

    res = run(args, save)
    print(f"[gpu_kernels] wrote {where[0] / 'kernels.md'} and {where[0] / 'kernels.json'}"
          + (" (truncated by --time-budget)" if res["meta"]["truncated"] else ""))
    bad = [r for r in res["rows"] if r.get("bit_exact") is False]
    if bad:
        print(f"[gpu_kernels] NOT bit-exact vs reference: {[(r['op'], r['shape'], r['wire']) for r in bad]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
