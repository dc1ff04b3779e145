"""Measurements for the low-precision reductions (``bf16_fp32acc_hook``).

    python -m tools.lowprec accuracy --models transformer convnet --worlds 2 4 8 --out reports/...
    python -m tools.lowprec training --steps 300 --world 2 --out reports/...
    python -m tools.lowprec conversion --numel 25000000 --out reports/...

* ``accuracy``: W gloo ranks, each with its own batches of a bench model;
  every wrapper computes the averaged gradient from the SAME parameters and
  batches; its relative error ``||g - exact||_2 / ||exact||_2`` (all params
  together) against the exact average (fp64 mean of the ranks' fp32
  gradients), per step.
* ``training``: a small MLP on a fixed teacher's regression task (data made
  here from a seed), W ranks, the same initial weights and batches for every
  wrapper; the loss curve of each.
* ``conversion``: one core, GB/s (bytes read + written) of the CPU path's
  passes against a plain fp32 copy.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WRAPPERS = ["torch-fp16", "torch-bf16", "fastddp-bf16", "fastddp-bf16-fp32acc", "fastddp-fp8", "fastddp-fp8-noef"]


def _wrap(name: str, model):
    """The wrapper ``name`` around ``model``.  torch's own bf16 hook runs on
    fastddp's reducer as a plain callback (torch's DDP refuses it off NCCL;
    the hook's arithmetic is unchanged: bf16 all-reduce, then divide)."""
    import fastddp
    import fastddp.hooks as fh
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    if name == "fp32":
        return TorchDDP(model)
    if name == "torch-fp16":
        m = TorchDDP(model)
        m.register_comm_hook(None, dh.fp16_compress_hook)
        return m
    m = fastddp.DistributedDataParallel(model)
    if name.startswith("fastddp-fp8"):
        m.register_comm_hook(fh.FP8CompressionState(error_feedback=not name.endswith("noef")),
                             fh.fp8_compress_hook)
        return m
    hook = {"torch-bf16": dh.bf16_compress_hook, "fastddp-bf16": fh.bf16_compress_hook,
            "fastddp-fp16": fh.fp16_compress_hook, "fastddp-bf16-fp32acc": fh.bf16_fp32acc_hook}[name]
    m.register_comm_hook(None, hook)
    return m


def _init(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))


# ----------------------------------------------------------------- accuracy
def _accuracy_rank(rank, world, path, model_name, steps, q, names):
    from fastddp.bench.models import model_zoo

    _init(rank, world, path)
    spec = model_zoo()[model_name]
    torch.manual_seed(0)
    base = spec.build()
    wrapped = {n: _wrap(n, copy.deepcopy(base)) for n in names}
    local = copy.deepcopy(base)
    errs = {n: [] for n in names}
    # accumulated over the steps: ||sum_t (g_t - exact_t)|| / ||sum_t exact_t|| (drift)
    acc_err = {n: [torch.zeros_like(p, dtype=torch.float64) for p in base.parameters()] for n in names}
    acc_exact = [torch.zeros_like(p, dtype=torch.float64) for p in base.parameters()]
    cum = {n: [] for n in names}
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = spec.make_batch(gen, torch.device("cpu"))
        local.zero_grad(set_to_none=True)
        spec.loss(local(x), y).backward()
        exact = []
        for p in local.parameters():
            parts = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(parts, p.grad.contiguous())
            exact.append(torch.stack([t.double() for t in parts]).mean(0))
        den = torch.sqrt(sum((e * e).sum() for e in exact))
        for a, e in zip(acc_exact, exact):
            a += e
        acc_den = torch.sqrt(sum((a * a).sum() for a in acc_exact))
        for n, m in wrapped.items():
            m.zero_grad(set_to_none=True)
            spec.loss(m(x), y).backward()
            num = torch.sqrt(sum(((p.grad.double() - e) ** 2).sum() for p, e in zip(m.parameters(), exact)))
            errs[n].append(float(num / den))
            for a, p, e in zip(acc_err[n], m.parameters(), exact):
                a += p.grad.double() - e
            cum[n].append(float(torch.sqrt(sum((a * a).sum() for a in acc_err[n])) / acc_den))
    if rank == 0:
        q.put({"per_step": errs, "accumulated": cum})
    dist.barrier()
    dist.destroy_process_group()


def accuracy(models, worlds, steps, names=WRAPPERS):
    out = {}
    for model in models:
        for w in worlds:
            with tempfile.TemporaryDirectory() as d:
                q = mp.get_context("spawn").SimpleQueue()
                mp.start_processes(_accuracy_rank, args=(w, os.path.join(d, "pg"), model, steps, q, names),
                                   nprocs=w, start_method="spawn")
                out[f"{model}/W={w}"] = q.get()
            r = out[f"{model}/W={w}"]
            print(model, w, {k: f"{statistics.mean(v):.3e} acc {r['accumulated'][k][-1]:.3e}"
                             for k, v in r["per_step"].items()}, flush=True)
    return out


# ----------------------------------------------------------------- training
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                               torch.nn.GELU(), torch.nn.Linear(128, 8))


def _training_rank(rank, world, path, names, steps, q):
    _init(rank, world, path)
    torch.manual_seed(0)
    teacher = _mlp()
    base = _mlp()
    curves = {}
    for n in names:
        m = _wrap(n, copy.deepcopy(base))
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(100_003 * step + rank)
            x = torch.randn(64, 32, generator=gen)
            with torch.no_grad():
                y = teacher(x) + 0.01 * torch.randn(64, 8, generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(float(t) / world)
        curves[n] = losses
    if rank == 0:
        q.put(curves)
    dist.barrier()
    dist.destroy_process_group()


def training(world, steps, names):
    with tempfile.TemporaryDirectory() as d:
        q = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_training_rank, args=(world, os.path.join(d, "pg"), names, steps, q),
                           nprocs=world, start_method="spawn")
        return q.get()


# --------------------------------------------------------------- conversion
def conversion(numel, repeats):
    """Single-thread GB/s of each CPU pass over ``numel`` fp32 gradients."""
    import fastddp.kernels as K

    torch.set_num_threads(1)
    assert K.backend("cpu") == "reference"
    g = torch.randn(numel)
    dst32 = torch.empty(numel)
    wire16 = torch.empty(numel, dtype=torch.float16)
    wireb = torch.empty(numel, dtype=torch.bfloat16)
    lay = K.Layout([g.shape])
    shard = numel // 2
    recv = torch.randn(2 * shard).to(torch.bfloat16)
    out = torch.empty(shard, dtype=torch.bfloat16)
    n8 = numel // 256 * 256
    g8, r8, dst8 = g[:n8], torch.zeros(n8), torch.empty(n8)
    q8, s8 = torch.empty(n8, dtype=torch.uint8), torch.empty(n8 // 256)
    K.quantize_fp8(g8, q8, s8, 256)  # valid codes and scales for the passes that read them
    n8h = n8 // 512 * 256
    q8h, s8h = torch.empty(n8h, dtype=torch.uint8), torch.empty(n8h // 256)
    cases = {
        # name: (fn, bytes read + written)
        "copy fp32->fp32": (lambda: dst32.copy_(g), 8 * numel),
        "torch cast fp32->fp16 (.copy_)": (lambda: wire16.copy_(g), 6 * numel),
        # as the reducer's CPU path runs it: grads * fp32(1/W) into the fp32
        # bucket, then the bucket cast into the bf16 wire (two passes)
        "pack fp32 * 1/W -> bf16 (fastddp CPU path: scale into bucket + cast)": (
            lambda: (K.pack([g], dst32, layout=lay, scale=0.5), K.pack([dst32], wireb, layout=lay)),
            14 * numel),
        "shard sum W=2 bf16 -> fp32 acc -> bf16": (lambda: K.reduce_shards(recv, out, 2), 6 * shard),
        "unpack bf16 -> fp32 (fastddp CPU path)": (lambda: K.unpack(wireb, [dst32], layout=lay), 6 * numel),
        # fp8, block 256: read x + residual, write q + scales + residual
        "fp8 quantize + error feedback (CPU path)": (
            lambda: K.quantize_fp8(g8, q8, s8, 256, residual=r8), 4 * n8 + 4 * n8 + n8 + n8 // 64 + 4 * n8),
        "fp8 quantize, no residual (CPU path)": (lambda: K.quantize_fp8(g8, q8, s8, 256), 5 * n8 + n8 // 64),
        "fp8 dequantize (CPU path)": (lambda: K.dequantize_fp8(q8, s8, dst8, 256), 5 * n8 + n8 // 64),
        # the shard sum of a W=2 all-to-all: 2 x half the bucket in, half out (fp8 + scales)
        "fp8 shard sum W=2 (CPU path)": (
            lambda: K.reduce_fp8_shards(q8, s8, q8h, s8h, 2, 256), n8 + n8 // 64 + n8 // 2 + n8 // 128),
    }
    res = {}
    for name, (fn, nbytes) in cases.items():
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        res[name] = {"median_ms": 1e3 * statistics.median(ts), "p20_ms": 1e3 * ts[len(ts) // 5],
                     "p80_ms": 1e3 * ts[(4 * len(ts)) // 5], "GB/s": nbytes / statistics.median(ts) / 1e9}
        print(name, res[name], flush=True)
    return res


# ------------------------------------------------------------------- report
def _load(path):
    with open(path) as f:
        return json.load(f)


def report(acc_path, drift_path, train_paths, conv_path, out_md, chart):
    """Markdown (and a loss-curve chart) from the JSON files above."""
    lines = []
    acc = _load(acc_path)
    m = acc["meta"]
    lines += ["## Accuracy of the averaged gradient", "",
              f"Relative error `||g - exact||_2 / ||exact||_2` over all parameters against the fp64 mean of "
              f"the ranks' fp32 gradients, mean of {m['cmd']['steps']} steps (different batches, same "
              "parameters), bench models, gloo ranks on CPU. Deterministic: machine load does not enter.", ""]
    names = list(next(iter(acc["data"].values()))["per_step"])
    lines += ["| model / W | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, r in acc["data"].items():
        lines.append(f"| {key} | " + " | ".join(f"{statistics.mean(r['per_step'][n]):.2e}" for n in names) + " |")
    if drift_path:
        d = _load(drift_path)
        lines += ["", "### Accumulated error (drift) over many steps", "",
                  f"`||sum_t (g_t - exact_t)|| / ||sum_t exact_t||` after t steps (same parameters, "
                  f"new batches each step; {d['meta']['cmd']['steps']} steps). With error feedback the "
                  "quantization error of a step is sent in later steps, so the accumulated error stays "
                  "bounded instead of growing.", ""]
        for key, r in d["data"].items():
            names_d = list(r["accumulated"])
            steps = len(r["accumulated"][names_d[0]])
            marks = [t for t in (1, 10, 50, steps) if t <= steps]
            lines += [f"{key}:", "", "| wrapper | " + " | ".join(f"t={t}" for t in marks) + " |",
                      "|---|" + "---|" * len(marks)]
            for n in names_d:
                lines.append(f"| {n} | " + " | ".join(f"{r['accumulated'][n][t - 1]:.2e}" for t in marks) + " |")
    lines += ["", "## Training", ""]
    curves_all = []
    for tp in train_paths:
        t = _load(tp)
        w, steps = t["meta"]["cmd"]["world"], t["meta"]["cmd"]["steps"]
        curves = t["data"]
        curves_all.append((w, curves))
        ref = statistics.mean(curves["fp32"][-20:])
        lines += [f"W={w}, {steps} steps, MLP 32-128-128-8 (GELU) on a fixed random teacher's regression "
                  "(data made from seeds), Adam lr 1e-3, batch 64 per rank; final loss = mean of the last "
                  "20 steps' all-rank mean loss.", "",
                  "| wrapper | final loss | vs fp32 DDP |", "|---|---|---|"]
        for n, c in curves.items():
            f = statistics.mean(c[-20:])
            lines.append(f"| {n} | {f:.4e} | {100 * (f - ref) / ref:+.3f} % |")
        lines.append("")
    if chart:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(curves_all), figsize=(6 * len(curves_all), 4), squeeze=False)
        for ax, (w, curves) in zip(axes[0], curves_all):
            for n, c in curves.items():
                ax.plot(c, label=n, lw=1)
            ax.set_yscale("log")
            ax.set_title(f"loss, W={w}")
            ax.set_xlabel("step")
            ax.legend()
        fig.tight_layout()
        fig.savefig(chart, dpi=90)
        lines += [f"![loss curves]({os.path.basename(chart)})", ""]
    if conv_path:
        c = _load(conv_path)
        la = c["meta"]["loadavg"]
        lines += ["## CPU conversion cost (one thread, 25M elements)", "",
                  f"**Machine loaded** (load average {la[0]:.1f} on 2 cores at the start, "
                  f"{c['meta']['loadavg_end'][0]:.1f} at the end; other agents' jobs ran): these timings "
                  "are indicative only, not performance figures. GB/s = bytes read + written / median time.", "",
                  "| pass | median ms (p20-p80) | GB/s |", "|---|---|---|"]
        for name, r in c["data"].items():
            lines.append(f"| {name} | {r['median_ms']:.0f} ({r['p20_ms']:.0f}-{r['p80_ms']:.0f}) | {r['GB/s']:.2f} |")
        lines.append("")
    with open(out_md, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--models", nargs="+", default=["transformer", "convnet"])
    a.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    a.add_argument("--steps", type=int, default=3)
    a.add_argument("--wrappers", nargs="+", default=WRAPPERS)
    t = sub.add_parser("training")
    t.add_argument("--world", type=int, default=2)
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--wrappers", nargs="+", default=["fp32", "torch-fp16", "fastddp-bf16-fp32acc", "fastddp-fp8"])
    c = sub.add_parser("conversion")
    c.add_argument("--numel", type=int, default=25_000_000)
    c.add_argument("--repeats", type=int, default=15)
    for p in (a, t, c):
        p.add_argument("--out", required=True, help="JSON file for the results")
    rp = sub.add_parser("report")
    rp.add_argument("--accuracy", required=True)
    rp.add_argument("--drift")
    rp.add_argument("--training", nargs="*", default=[])
    rp.add_argument("--conversion")
    rp.add_argument("--md", required=True)
    rp.add_argument("--chart")
    args = ap.parse_args(argv)
    if args.cmd == "report":
        report(args.accuracy, args.drift, args.training, args.conversion, args.md, args.chart)
        return
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "loadavg": os.getloadavg(), "torch": torch.__version__, "cmd": vars(args)}
    if args.cmd == "accuracy":
        data = accuracy(args.models, args.worlds, args.steps, args.wrappers)
    elif args.cmd == "training":
        data = training(args.world, args.steps, args.wrappers)
    else:
        data = conversion(args.numel, args.repeats)
    meta["loadavg_end"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "data": data}, f, indent=1)


if __name__ == "__main__":
    main()
