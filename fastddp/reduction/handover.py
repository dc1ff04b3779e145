"""Error-feedback residuals across a change of wire format: the part of
:class:`~.autoprec.AutoPrecision` that hands one format's residuals to the
next, held by it (not inherited)."""

from __future__ import annotations

__all__ = ["ResidualHandover"]


class ResidualHandover:
    """At a switch, the old format's finished residuals go to the new format
    where it keeps them in the bucket's layout (bf16 <-> fp8: adopted at each
    bucket's next pack), else they are dropped; memory no format holds any
    more is kept while a trial switches at every step (``spare``: the next
    format starts from it zeroed, without allocating).  Every hand-over or
    drop is noted (``events``, the last 16: auto precision's stats)."""

    def __init__(self):
        self.pending: dict = {}  # bucket index -> residual carried from the last format
        self.spare: dict = {}    # bucket index -> a dropped residual's memory, for the next format's
        self.events: list = []

    def note(self, it: int, text: str) -> None:
        self.events.append(f"step {it}: {text}")
        del self.events[:-16]

    def before_pack(self, ctx, bucket, mode, name: str) -> None:
        """Bucket ``bucket`` is about to be packed by ``mode`` (format ``name``):
        its carried residual adopted (or the drop noted), else a spare's memory."""
        values = self.pending.pop(bucket.index, None) if self.pending else None
        if values is not None:
            if not mode.adopt_residual(ctx, bucket, values):
                self.note(ctx.iteration, f"bucket {bucket.index}'s residual dropped: {name} keeps "
                                         "its residuals in another layout")
        elif (bucket.index in self.spare and mode.book is not None and mode.book.error_feedback
              and mode.residual_of(bucket.index) is None):
            mode.adopt_residual(ctx, bucket, self.spare.pop(bucket.index).zero_())

    def residual_of(self, bucket_index: int, mode):
        v = self.pending.get(bucket_index)
        return v if v is not None else mode.residual_of(bucket_index)

    def rebuilt(self, it: int) -> None:
        """The buckets were rebuilt: what was carried is laid out for the old ones."""
        if self.pending:
            self.note(it, f"{len(self.pending)} carried residuals dropped: the buckets were rebuilt")
            self.pending = {}
        self.spare = {}

    def switch(self, it: int, old, new, old_name: str, new_name: str, trial: bool) -> None:
        """The format changes from ``old`` to ``new`` (``trial``: switching at every step)."""
        carried = dict(self.pending)
        if old.book is not None and old.book.error_feedback:
            carried.update(old.book.finished_residuals())
        keeps = new.book is not None and new.book.error_feedback
        # memory no format holds any more: the new format's own (stale, from when it was last in use),
        # or the carried ones it cannot keep; kept only while the trial switches at every step
        unheld = new.book.finished_residuals() if keeps else carried
        if trial:
            for i, t in unheld.items():
                self.spare.setdefault(i, t)
        else:
            self.spare = {}
        self.pending = carried if keeps else {}
        if carried:
            self.note(it, f"{'carried' if keeps else 'dropped'} the residuals of {len(carried)} buckets: "
                          f"{old_name} -> {new_name}" + ("" if keeps else f" ({new_name} keeps none)"))
