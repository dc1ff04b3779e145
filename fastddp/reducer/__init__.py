"""The reducer: the bucket state machine, pack -> collective -> unpack, the
end-of-backward finalize, rebuilds.

* :mod:`.core` -- :class:`Reducer`: in-order issue, finalize, abort; it holds
  its parts (no base class);
* :mod:`.plans` -- :class:`~.plans.BucketPlans`: the plan, the buckets, the
  one rebuild, the caps and the bucket tuner (whose host it is);
* :mod:`.readiness` -- which parameters count as ready;
* :mod:`.arming` -- which readiness hooks run in an iteration (native
  countdown or Python; :class:`HookMode`), the early copy;
* :mod:`.chain` -- the native issue chain (bucket complete -> pack -> issue,
  and wait -> unpack, in C++ on the CPU's plain all-reduce; Python once a
  step);
* :mod:`.atonce` -- the iterations issued all at once (static_graph's first,
  debug mode's);
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
