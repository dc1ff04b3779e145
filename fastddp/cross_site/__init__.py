"""Cross-site training (docs/cross-site.md): exact DDP inside each host, an
overlapped outer sync between hosts every ``sync_every`` steps (DiLoCo's
outer Nesterov step on the averaged pseudo-gradient, or plain averaging),
its payload in fp32, bf16 or fp8 with error feedback.

Modules: :mod:`.sites` (hosts and groups), :mod:`.wire` (the outer sync's
formats on the existing kernels), :mod:`.outer` (one sync, on its thread),
:mod:`.optimizer` (:class:`CrossSite`, the optimizer wrapper).  The inner
reduction is a bucket mode like the others:
:mod:`fastddp.reduction.sitelocal`.
"""

from .optimizer import CrossSite

__all__ = ["CrossSite"]
