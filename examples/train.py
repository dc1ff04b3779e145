"""A small, complete data-parallel training script with fastddp.

    torchrun --nproc-per-node 2 examples/train.py                     # CPU (gloo) or one GPU per rank (nccl)
    torchrun --nproc-per-node 2 examples/train.py --impl torch        # the same run with torch's DDP
    torchrun --nproc-per-node 2 examples/train.py --ckpt run.pt       # saves every epoch, resumes if run.pt exists
    torchrun --nproc-per-node 2 examples/train.py --save final.pt     # the final weights and loss, to compare runs
    torchrun --nproc-per-node 2 examples/train.py --hook fp8          # a fastddp comm hook, by name (--hook list)

Across machines, torchrun's usual multi-node line on every host::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \
        --rdzv-id myjob examples/train.py

The only fastddp-specific line is the import of ``DistributedDataParallel``;
everything else is the usual torch DDP recipe: one process per device,
``DistributedSampler`` (with ``set_epoch``), the model wrapped once, the
checkpoint written by rank 0 from ``model.module`` (no ``module.`` prefix) and
loaded on every rank with ``map_location``.

Rank 0 prints, per epoch, the mean training loss over all ranks and a checksum
of the parameters (``repr`` of the fp64 sum), so runs can be compared exactly.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

#: ``--hook`` names on fastddp: (function in fastddp.hooks, how its state is made).
#: The hierarchical ones are looked up when used: older fastddp lacks them.
FASTDDP_HOOKS = {
    "fp16": ("fp16_compress_hook", None),
    "bf16": ("bf16_compress_hook", None),
    "bf16acc": ("bf16_fp32acc_hook", None),
    "fp8": ("fp8_compress_hook", ("FP8CompressionState", {})),
    "hier-fp32": ("hierarchical_hook", ("HierarchicalState", {"wire": "fp32"})),
    "hier-bf16": ("hierarchical_hook", ("HierarchicalState", {"wire": "bf16"})),
    "hier-fp8": ("hierarchical_hook", ("HierarchicalState", {"wire": "fp8"})),
}
#: ``--hook`` names on torch's DDP: torch's own default_hooks.
TORCH_HOOKS = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ckpt", default=None, help="checkpoint path: saved each epoch, resumed from if present")
    p.add_argument("--impl", choices=("fastddp", "torch"), default="fastddp", help="which DDP wrapper to use")
    p.add_argument("--samples", type=int, default=1024, help="size of the synthetic dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None,
                   help="rank 0 writes the final weights, buffers, last epoch's loss, the hook and "
                        "rank 0's loss at every step here (torch.save)")
    p.add_argument("--hook", default=None, metavar="NAME",
                   help="register a comm hook by name: on fastddp " + ", ".join(FASTDDP_HOOKS)
                        + "; on --impl torch " + ", ".join(TORCH_HOOKS) + " (torch's default_hooks)")
    args = p.parse_args(argv)
    valid = FASTDDP_HOOKS if args.impl == "fastddp" else TORCH_HOOKS
    if args.hook is not None and args.hook not in valid:
        p.error(f"--hook {args.hook!r} is not a hook of --impl {args.impl}; choose one of "
                + ", ".join(valid))
    return args


def register_hook(model, impl: str, name: str | None) -> None:
    """Register the ``--hook`` named ``name`` on the wrapped ``model``."""
    if name is None:
        return
    if impl == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, getattr(default_hooks, TORCH_HOOKS[name]))
        return
    from fastddp import hooks

    fn_name, make_state = FASTDDP_HOOKS[name]
    fn = getattr(hooks, fn_name, None)
    state_cls = None if make_state is None else getattr(hooks, make_state[0], None)
    if fn is None or (make_state is not None and state_cls is None):
        missing = fn_name if fn is None else make_state[0]
        raise SystemExit(f"--hook {name}: this fastddp has no fastddp.hooks.{missing} (the hook is not "
                         "available in this version)")
    model.register_comm_hook(None if state_cls is None else state_cls(**make_state[1]), fn)


def make_model() -> torch.nn.Module:
    # BatchNorm gives the model buffers, which DDP broadcasts from rank 0.
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
        torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def make_dataset(n: int, seed: int) -> TensorDataset:
    """Synthetic classification: labels from a fixed random teacher network.
    Same seed, same data on every rank; the sampler splits it."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.randn(32, 10, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def checksum(module: torch.nn.Module) -> float:
    with torch.no_grad():
        return sum(p.detach().double().sum().item() for p in module.parameters())


def pick_device() -> tuple[torch.device, str]:
    """This rank's device and the backend for it (torchrun sets LOCAL_RANK)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def main(argv=None) -> None:
    args = parse_args(argv)
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    device, backend = pick_device()
    dist.init_process_group(backend=backend)
    if args.impl == "torch":
        import fastddp  # torch's DDP has the same exit race that fastddp's DDP guards against itself
        fastddp.install_exit_drain()  # (docs/options.md, "A clean exit"): the comparison row gets the same clean exit
    train(args, device)
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    """One training run in the process group that exists (``main``'s body:
    tests run several, one after the other, in one group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.impl == "fastddp":
        from fastddp import DistributedDataParallel as DDP
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(args.seed)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # Resume: every rank loads the same file onto its own device; weights go
    # into the plain module (DDP then starts from them), accepting checkpoints
    # written from a DDP model's state_dict() too (keys with "module.").
    start_epoch = 0
    if args.ckpt and os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location=device, weights_only=True)
        state = ckpt["model"]
        consume_prefix_in_state_dict_if_present(state, "module.")
        model.load_state_dict(state)
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.ckpt} at epoch {start_epoch}", flush=True)

    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    register_hook(model, args.impl, args.hook)

    dataset = make_dataset(args.samples, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    loss_fn = torch.nn.CrossEntropyLoss()

    mean_loss = float("nan")  # no epoch left to run (resumed a finished run)
    step_losses = []  # this rank's loss at every step: rank 0's are saved, for loss curves
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        model.train()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()  # gradients are averaged across ranks here
            optimizer.step()
            step_losses.append(loss.item())
            total += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
        dist.all_reduce(total)
        mean_loss = (total[0] / total[1]).item()

        if rank == 0:
            print(f"epoch {epoch} loss {mean_loss!r} checksum {checksum(model.module)!r}", flush=True)
            if args.ckpt:
                tmp = f"{args.ckpt}.tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, tmp)
                os.replace(tmp, args.ckpt)  # never leave a half-written checkpoint
        dist.barrier()  # nobody reads or overwrites the checkpoint while rank 0 writes it

    if rank == 0:
        print(f"done impl={args.impl} world={world} final_checksum {checksum(model.module)!r}", flush=True)
        if args.save:
            torch.save({"model": model.module.state_dict(), "loss": mean_loss, "impl": args.impl,
                        "world": world, "hook": args.hook, "step_losses": step_losses}, args.save)


if __name__ == "__main__":
    main()
