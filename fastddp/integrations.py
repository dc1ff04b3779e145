"""Use fastddp from frameworks that build torch's DDP themselves.

Nothing here imports Lightning or accelerate until you ask for it; importing
:mod:`fastddp` never imports this module.

PyTorch Lightning (``lightning.pytorch``; ``pytorch_lightning`` alike)::

    from fastddp.integrations import FastDDPStrategy      # a DDPStrategy subclass
    trainer = Trainer(strategy=FastDDPStrategy(find_unused_parameters=False),
                      accelerator="gpu", devices=8)
    # for the standalone `pytorch_lightning` package: FastDDPStrategyPL

``FastDDPStrategy`` takes exactly ``DDPStrategy``'s arguments; DDP keyword
arguments (``bucket_cap_mb``, ``static_graph``, ...) go to
``fastddp.DistributedDataParallel``.  It overrides the methods of
``DDPStrategy`` that build the wrapper or check
``isinstance(model, torch.nn.parallel.DistributedDataParallel)``
(``_setup_model``, ``_register_ddp_hooks``, ``pre_backward``,
``post_backward``, ``teardown`` and the forward redirection used by manual
optimization), so gradient accumulation, manual optimization, comm hooks and
the unwrap at the end of ``fit`` behave as with torch's DDP.

HF accelerate::

    from fastddp.integrations import patch_torch_ddp

    with patch_torch_ddp():            # or decorate your main(): @patch_torch_ddp()
        accelerator = Accelerator()
        model, opt, dl = accelerator.prepare(model, opt, dl)
        ...                            # train, unwrap_model, save_model, ...

accelerate builds and recognises DDP through the attribute
``torch.nn.parallel.DistributedDataParallel``, looked up at call time
(``prepare_model``, ``unwrap_model`` / ``extract_model_from_parallel``,
``trigger_sync_in_backward``); inside the block that attribute is fastddp's
class, so keep the whole training (through the last ``unwrap_model`` /
``save_model``) inside it.  The patch is process-wide while active and is
undone on exit; names imported earlier with
``from torch.nn.parallel import DistributedDataParallel`` keep torch's class.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from typing import Any

import torch

# Also importable, built on first access: FastDDPStrategy (lightning.pytorch),
# FastDDPStrategyPL (pytorch_lightning); left out of __all__ so that
# `from fastddp.integrations import *` never imports Lightning.
__all__ = ["lightning_strategy", "patch_torch_ddp", "register_lightning_strategies",
           "LIGHTNING_STRATEGY_NAMES"]

# ---------------------------------------------------------------- accelerate
_patch_lock = threading.Lock()
_patch_depth = 0
_patch_saved: Any = None


@contextlib.contextmanager
def patch_torch_ddp():
    """Within the block, ``torch.nn.parallel.DistributedDataParallel`` is
    :class:`fastddp.DistributedDataParallel` (re-entrant; restored on exit).

    Meant for libraries that construct and ``isinstance``-check DDP through
    that attribute at call time, such as HF accelerate.  Usable as a
    decorator too (``@patch_torch_ddp()``).
    """
    global _patch_depth, _patch_saved
    from .ddp import DistributedDataParallel as FastDDP

    with _patch_lock:
        if _patch_depth == 0:
            _patch_saved = torch.nn.parallel.DistributedDataParallel
            torch.nn.parallel.DistributedDataParallel = FastDDP
        _patch_depth += 1
    try:
        yield FastDDP
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch.nn.parallel.DistributedDataParallel = _patch_saved
                _patch_saved = None


# ----------------------------------------------------------------- Lightning
def _find_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    return []


def _prepare_for_backward(model, output) -> None:
    """Lightning's ``overrides.distributed.prepare_for_backward`` (manual
    optimization: arm the reducer with the loss, not the forward's output),
    on fastddp's reducer."""
    if torch.is_grad_enabled() and model.require_backward_grad_sync:
        model.require_forward_param_sync = True
        outputs = _find_tensors(output) if model.find_unused_parameters and not model.static_graph else []
        model.reducer.prepare_for_backward(outputs)
    else:
        model.require_forward_param_sync = False


_STRATEGY_NAMES = {"lightning.pytorch": "FastDDPStrategy", "pytorch_lightning": "FastDDPStrategyPL"}
_build_lock = threading.Lock()


def _build_lightning_strategy(pkg: str) -> type:
    """Subclass ``<pkg>.strategies.DDPStrategy`` (built on first use so that
    Lightning is imported only when asked for)."""
    ddp_mod = importlib.import_module(f"{pkg}.strategies.ddp")
    overrides = importlib.import_module(f"{pkg}.overrides.distributed")
    from .ddp import DistributedDataParallel as FastDDP

    name = _STRATEGY_NAMES[pkg]

    class _Redirection(ddp_mod._DDPForwardRedirection):
        # Manual optimization: keep the reducer out of the forward; the
        # strategy's pre_backward arms it with the loss.
        def on_after_inner_forward(self, wrapper_module, original_module) -> None:
            if isinstance(wrapper_module, FastDDP) and not original_module.automatic_optimization:
                wrapper_module.require_backward_grad_sync = False
            else:
                super().on_after_inner_forward(wrapper_module, original_module)

        def on_after_outer_forward(self, wrapper_module, original_module) -> None:
            if isinstance(wrapper_module, FastDDP) and not original_module.automatic_optimization:
                wrapper_module.require_backward_grad_sync = True
            else:
                super().on_after_outer_forward(wrapper_module, original_module)

    class Strategy(ddp_mod.DDPStrategy):
        __doc__ = (f"``{pkg}.strategies.DDPStrategy`` that wraps the model in "
                   "``fastddp.DistributedDataParallel``; same arguments.")

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._forward_redirection = _Redirection()

        def _setup_model(self, model: torch.nn.Module) -> FastDDP:
            device_ids = self.determine_ddp_device_ids()
            # as DDPStrategy: build DDP on a side stream on CUDA
            ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else contextlib.nullcontext()
            with ctx:
                return FastDDP(module=model, device_ids=device_ids, **self._ddp_kwargs)

        def _register_ddp_hooks(self) -> None:
            # DDPStrategy registers comm hooks on CUDA only, after asserting
            # torch's class; same rule, fastddp's class.
            if self.root_device.type == "cuda":
                assert isinstance(self.model, FastDDP)
                overrides._register_ddp_comm_hook(
                    model=self.model,
                    ddp_comm_state=self._ddp_comm_state,
                    ddp_comm_hook=self._ddp_comm_hook,
                    ddp_comm_wrapper=self._ddp_comm_wrapper,
                )

        def pre_backward(self, closure_loss: torch.Tensor) -> None:
            if not isinstance(self.model, FastDDP):
                return super().pre_backward(closure_loss)
            if not self.lightning_module.automatic_optimization:
                _prepare_for_backward(self.model, closure_loss)

        def post_backward(self, closure_loss: torch.Tensor) -> None:
            model = self.model
            if not isinstance(model, FastDDP):
                return super().post_backward(closure_loss)
            lm = self.lightning_module
            if lm is None or lm.automatic_optimization or not model.static_graph:
                return
            if getattr(self, "_pl_static_graph_delay_done", False):
                return
            # First static-graph iteration under manual optimization: the loss
            # did not pass through the wrapper's output sink, so reduce now.
            if not model._static_graph_delay_allreduce_enqueued:
                model.reducer.delay_all_reduce()
                model._static_graph_delay_allreduce_enqueued = True
            self._pl_static_graph_delay_done = True

        def teardown(self) -> None:
            if isinstance(self.model, FastDDP):
                self.model = self.lightning_module  # unwrap, as DDPStrategy does
            super().teardown()

        def on_exception(self, exception: BaseException) -> None:
            # DDPStrategy's hint, naming this strategy's option and registered name.
            exceptions = importlib.import_module(f"{pkg}.utilities.exceptions")
            exceptions._augment_message(
                exception, pattern=".*Expected to have finished reduction in the prior iteration.*",
                new_message=(
                    "It looks like your LightningModule has parameters that were not used in producing "
                    "the loss returned by training_step. If this is intentional, you must enable the "
                    "detection of unused parameters in DDP, either by setting the string value "
                    "`strategy='fastddp_find_unused_parameters_true'` or by setting the flag in the "
                    f"strategy with `strategy={name}(find_unused_parameters=True)`."))

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            # DDPStrategy's names with "fastddp" for "ddp"; overriding also keeps
            # the inherited method from registering "ddp*" to this class.
            for name, kwargs, what in _registry_entries():
                if name not in strategy_registry:
                    strategy_registry.register(name, cls, description=f"fastddp DDP strategy with {what}",
                                               **kwargs)

    for cls, cls_name in ((Strategy, name), (_Redirection, f"_{name}Redirection")):
        cls.__name__ = cls.__qualname__ = cls_name
        cls.__module__ = __name__
        globals()[cls_name] = cls  # picklable by reference (start_method="spawn")
    Strategy.register_strategies(importlib.import_module(f"{pkg}.strategies").StrategyRegistry)
    return Strategy


def _registry_entries() -> list[tuple[str, dict, str]]:
    """(name, DDPStrategy kwargs, description) of every registered name:
    Lightning's own DDP table (``DDPStrategy.register_strategies``)."""
    methods = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"), ("_notebook", "fork"))
    out = []
    for suffix, start in methods:
        out.append((f"fastddp{suffix}", {"start_method": start}, f"start_method {start!r}"))
    for suffix, start in methods:
        for fup in (False, True):
            out.append((f"fastddp{suffix}_find_unused_parameters_{str(fup).lower()}",
                        {"start_method": start, "find_unused_parameters": fup},
                        f"find_unused_parameters={fup} and start_method {start!r}"))
    return out


#: the names ``Trainer(strategy=...)`` accepts once registered
LIGHTNING_STRATEGY_NAMES = tuple(name for name, _, _ in _registry_entries())


def register_lightning_strategies(package: str = "lightning.pytorch") -> tuple[str, ...]:
    """Register :data:`LIGHTNING_STRATEGY_NAMES` (``"fastddp"``,
    ``"fastddp_spawn"``, ``"fastddp_find_unused_parameters_true"``, ...) in
    ``<package>.strategies.StrategyRegistry`` so that
    ``Trainer(strategy="fastddp")`` selects :class:`FastDDPStrategy`.

    ``package``: ``"lightning.pytorch"`` (default) or ``"pytorch_lightning"``.
    Idempotent.  Also done by importing this module after Lightning, and by
    the first access to ``FastDDPStrategy`` / ``FastDDPStrategyPL``.
    """
    if package not in _STRATEGY_NAMES:
        raise ValueError(f"register_lightning_strategies: package must be one of "
                         f"{sorted(_STRATEGY_NAMES)}, got {package!r}")
    __getattr__(_STRATEGY_NAMES[package])  # builds the class, which registers the names
    return LIGHTNING_STRATEGY_NAMES


def __getattr__(name: str):
    for pkg, cls_name in _STRATEGY_NAMES.items():
        if name in (cls_name, f"_{cls_name}Redirection"):
            with _build_lock:
                if cls_name not in globals():
                    _build_lightning_strategy(pkg)
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Imported after Lightning (the usual order: `import lightning as L` first):
# register the strategy names now; Lightning is never imported from here.
for _pkg in _STRATEGY_NAMES:
    if f"{_pkg}.strategies" in sys.modules:
        register_lightning_strategies(_pkg)
del _pkg


def lightning_strategy(**kwargs: Any):
    """``FastDDPStrategy(**kwargs)``: a Lightning ``DDPStrategy`` whose model
    wrapper is ``fastddp.DistributedDataParallel``."""
    return __getattr__("FastDDPStrategy")(**kwargs)
