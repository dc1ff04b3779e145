"""The bucket modes' names: one enum, read by :func:`fastddp.reduction.choose`,
the hooks' fused tags (:mod:`fastddp.hooks`) and ``stats()``."""

from __future__ import annotations

import enum

__all__ = ["Kind"]


class Kind(enum.Enum):
    """A bucket mode.  The value is the name ``stats()["fused_path"]`` reports."""

    ALLREDUCE = "allreduce"        #: SUM all-reduce of the flat bucket (torch's default path)
    HOOK = "hook"                  #: a Python comm hook called with a GradBucket
    COMPRESS = "compress"          #: fp16/bf16 wire, scaled in fp32 before the cast
    FP32ACC = "fp32acc"            #: bf16 wire, shards summed in fp32 (two phases)
    FP8 = "fp8"                    #: block-scaled e4m3 wire, shards summed in fp32 (two phases)
    HIER = "hierarchical"          #: fp32 inside each host, the chosen wire between hosts (rounds)
    AUTO = "auto-precision"        #: the wire format chosen from measurement among the allowed modes
    NOOP = "noop"                  #: nothing on the wire
    SITE = "site-local"            #: cross-site training's inner reduction: mean over the host's ranks
    SPARSE = "sparse-allreduce"    #: a sparse parameter's own bucket
