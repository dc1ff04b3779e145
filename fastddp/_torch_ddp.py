"""torch's own ``DistributedDataParallel`` class, held from before any swap.

Users and frameworks replace the class by assignment, at the re-export
(``torch.nn.parallel.DistributedDataParallel = fastddp.DistributedDataParallel``)
or where it is defined (``torch.nn.parallel.distributed.DistributedDataParallel``).
Everything in fastddp that means *torch's* class -- the base class, the slot
dynamo reads the active DDP module from -- goes through :data:`TorchDDP`,
never through those names.  Imports nothing from fastddp.
"""

from __future__ import annotations

import torch.nn.parallel.distributed as _defining_module

__all__ = ["TorchDDP", "is_torch_ddp_class"]


def is_torch_ddp_class(cls) -> bool:
    """True for torch's class itself (not a subclass, not a stand-in)."""
    return (isinstance(cls, type) and cls.__module__ == _defining_module.__name__
            and cls.__qualname__ == "DistributedDataParallel")


def _find() -> type:
    # The name may already be swapped (to fastddp's class on a re-import, or
    # to some framework's subclass): torch's class is then in its MRO.
    for cls in _defining_module.DistributedDataParallel.__mro__:
        if is_torch_ddp_class(cls):
            return cls
    raise ImportError(  # pragma: no cover - would need a foreign class under torch's name
        "fastddp: torch.nn.parallel.distributed.DistributedDataParallel has been replaced by "
        f"{_defining_module.DistributedDataParallel!r}, which does not derive from torch's class; "
        "import fastddp before replacing it")


#: torch.nn.parallel.distributed.DistributedDataParallel as torch defines it.
TorchDDP: type = _find()
