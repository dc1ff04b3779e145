"""The reducer: the bucket state machine, pack -> collective -> unpack, the
end-of-backward finalize, rebuilds.

* :mod:`.core` -- :class:`Reducer`: plan install and rebuild, in-order issue,
  finalize, abort;
* :mod:`.arming` -- which readiness hooks run in an iteration (native
  countdown or Python; :class:`HookMode`), the early copy;
* :mod:`.rearm` -- a second backward through one forward;
* :mod:`.divisor` -- torch's div_factor_ (join);
* :mod:`.options` -- what the front passes in.

Bucket modes (:mod:`fastddp.reduction`) see a
:class:`~fastddp.reduction.StepContext`, never the reducer.
"""

from __future__ import annotations

from .arming import EARLY_COPY_MIN_NUMEL, Arming, HookMode
from .core import Reducer
from .options import Collaborators, ReducerOptions

__all__ = ["Reducer", "ReducerOptions", "Collaborators", "Arming", "HookMode", "EARLY_COPY_MIN_NUMEL"]
