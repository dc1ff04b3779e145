"""One rank of tests/test_two_hosts.py: several ``examples/train.py`` runs
(its ``train``, the body of its ``main``), one after the other in ONE
process group, so that a torchrun launch per shape serves every run of
that shape (a launch is ~10-17 s of CPU in interpreter starts and exits,
more than the runs it serves).  Around each run, between barriers, the
host's first local rank reads its veth end's kernel tx counter.

    python tests/_two_hosts_rank.py OUT RUNS_JSON

``RUNS_JSON``: ``[[key, [train.py arguments...]], ...]``; the host's index
comes from ``FASTDDP_TEST_HOST``, its interface from ``GLOO_SOCKET_IFNAME``.
Writes ``OUT/sent-host{i}.json``: ``{key: bytes out of host i during it}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from tools.netlink import read_counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train  # noqa: E402  (examples/ is not a package)


def main() -> None:
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    host, ifname = int(os.environ["FASTDDP_TEST_HOST"]), os.environ["GLOO_SOCKET_IFNAME"]
    reader = int(os.environ["LOCAL_RANK"]) == 0
    device, backend = train.pick_device()
    dist.init_process_group(backend=backend)
    import fastddp
    fastddp.install_exit_drain()  # as train.py's main does for its torch runs
    sent = {}
    for key, argv in runs:
        dist.barrier()
        before = read_counters(ifname)[0] if reader else 0
        train.train(train.parse_args(argv), device)
        dist.barrier()
        if reader:
            sent[key] = read_counters(ifname)[0] - before
    if reader:
        (out / f"sent-host{host}.json").write_text(json.dumps(sent))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
