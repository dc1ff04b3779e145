"""The one tensor comparison of the tests: bit for bit, or within a
tolerance, with a verbose report when it fails.

* :func:`mismatch` -- ``None`` when two tensors are equal, else what differs:
  None-ness, layout, dtype, shape, then how many elements differ, the first
  indices with both values (and their bits), the largest ``|diff|`` and where,
  and the NaN / Inf counts on both sides.
* :func:`assert_bits` -- raises with that report (kernels, casts, oracles).
* :func:`compare_grads` / :func:`compare_state` -- every ``.grad`` / every
  ``state_dict`` entry of two models, by name (the parity tests).

Bit for bit (``tol=None``) compares the integer bits of every element, so
``-0.0`` differs from ``0.0``.  NaN: by default any NaN equals any NaN in the
same place (kernels may carry another payload); ``equal_nan=False`` makes
every NaN a mismatch, as ``torch.equal`` and ``torch.testing.assert_close``
do.  With ``tol`` (``dict(rtol=..., atol=...)``) the values are compared with
``torch.testing.assert_close``'s rule.
"""

from __future__ import annotations

import torch

__all__ = ["assert_bits", "compare_grads", "compare_state", "mismatch"]

#: integer views of the same width: the bits of one element
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: how many differing elements a report lists one by one
SHOW = 8


def _describe(t) -> str:
    return "None" if t is None else f"{tuple(t.shape)} {t.dtype}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _hex(bits: int, size: int) -> str:
    return f"0x{bits & ((1 << 8 * size) - 1):0{2 * size}x}"


def _nonfinite(t: torch.Tensor) -> str:
    if not t.is_floating_point():
        return "no NaN/Inf"
    return f"NaN {int(t.isnan().sum())}, Inf {int(t.isinf().sum())}"


def _report(got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor, names) -> str:
    g_name, w_name = names
    idx = bad.nonzero().reshape(-1)
    lines = [f"{idx.numel()} of {got.numel()} elements differ, first at {idx[:SHOW].tolist()}"]
    if got.is_floating_point() or got.is_complex():
        diff = (got.double() - want.double()).abs()
        finite = diff[~diff.isnan()]
        if finite.numel():
            at = int(torch.where(diff.isnan(), torch.full_like(diff, -1.0), diff).argmax())
            lines.append(f"max |diff| {finite.max().item():.3e} at flat index {at}")
    lines.append(f"{g_name}: {_nonfinite(got)}; {w_name}: {_nonfinite(want)}")
    size = got.element_size()
    for i in idx[:SHOW].tolist():
        lines.append(f"  [{i}] {g_name} {got[i].item()!r} ({_hex(_bits(got)[i].item(), size)})"
                     f"  {w_name} {want[i].item()!r} ({_hex(_bits(want)[i].item(), size)})")
    return "\n".join(lines)


def mismatch(got, want, tol: dict | None = None, *, equal_nan: bool = True,
             names: tuple[str, str] = ("got", "want")) -> str | None:
    """``None`` when ``got`` equals ``want`` (bit for bit if ``tol`` is None),
    else a report of what differs (see the module docstring)."""
    g_name, w_name = names
    if (got is None) != (want is None):
        return f"None-ness differs: {g_name} {_describe(got)}, {w_name} {_describe(want)}"
    if got is None:
        return None
    if got.is_sparse or want.is_sparse:
        if got.is_sparse != want.is_sparse:
            return f"layout differs: {g_name} {got.layout}, {w_name} {want.layout}"
        got, want = got.coalesce().to_dense(), want.coalesce().to_dense()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape differ: {g_name} {_describe(got)}, {w_name} {_describe(want)}"
    got = got.detach().cpu().reshape(-1)
    want = want.detach().cpu().reshape(-1)
    if got.is_complex():
        got, want = torch.view_as_real(got).reshape(-1), torch.view_as_real(want).reshape(-1)
    if tol is None:
        gn, wn = got.isnan(), want.isnan()
        differ = _bits(got) != _bits(want)
        bad = ((gn != wn) | (~gn & ~wn & differ)) if equal_nan else (gn | wn | differ)
    else:
        try:
            torch.testing.assert_close(got, want, equal_nan=equal_nan, **tol)
            return None
        except AssertionError:
            bad = ~torch.isclose(got, want, equal_nan=equal_nan, **tol)
    if not bool(bad.any()):
        return None
    return _report(got, want, bad, names)


def assert_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "", *,
                equal_nan: bool = True) -> None:
    """Bit-exact equality (NaN compared as NaN unless ``equal_nan=False``);
    a verbose report on mismatch."""
    why = mismatch(actual, expected, equal_nan=equal_nan)
    if why:
        raise AssertionError(f"{what}: {why}")


def compare_grads(ref, test, where: str, tol: dict | None = None) -> None:
    """Every parameter's ``.grad`` of ``test`` equals ``ref``'s (the reference,
    torch's DDP): bit for bit, or within ``tol``; NaN is a mismatch."""
    ref_named = list(ref.named_parameters())
    test_named = list(test.named_parameters())
    names_r = [n for n, _ in ref_named]
    names_t = [n for n, _ in test_named]
    assert names_r == names_t, f"{where}: named_parameters differ: torch {names_r} vs test {names_t}"
    bad = []
    for (n, pr), (_, pt) in zip(ref_named, test_named):
        why = mismatch(pt.grad, pr.grad, tol, equal_nan=False, names=("test", "torch"))
        if why:
            bad.append(f"  {n}: " + why.replace("\n", "\n    "))
    assert not bad, f"{where}: .grad differs from torch DDP's:\n" + "\n".join(bad)


def compare_state(ref, test, where: str, tol: dict | None = None) -> None:
    """Every ``state_dict`` entry (parameters and buffers) of ``test`` equals
    ``ref``'s, in the same order: bit for bit, or within ``tol``."""
    sr, st = ref.state_dict(), test.state_dict()
    assert list(sr) == list(st), f"{where}: state_dict keys differ: {list(sr)} vs {list(st)}"
    bad = []
    for k in sr:
        why = mismatch(st[k], sr[k], tol, equal_nan=False, names=("test", "torch"))
        if why:
            bad.append(f"  {k}: " + why.replace("\n", "\n    "))
    assert not bad, f"{where}: parameters/buffers differ from torch DDP's:\n" + "\n".join(bad)
