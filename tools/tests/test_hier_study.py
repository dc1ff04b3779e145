"""tools/hier_study.py: the accuracy study runs and says what it measured."""

from __future__ import annotations

import pytest

from tools import hier_study

pytestmark = pytest.mark.timeout(300)


def test_error_study_at_2x2():
    """Every format flat and hierarchical; fp32 exact to rounding, the
    compressed ones no worse hierarchical than flat (one step, 10% slack)."""
    got = hier_study.run("error", 2, 2)
    assert set(got) == {f"{f}-{w}" for f in hier_study.FORMATS for w in ("flat", "hier")}
    assert got["fp32-hier"] < 1e-6 and got["fp32-flat"] < 1e-6
    for fmt in ("bf16", "fp8"):
        assert got[f"{fmt}-hier"] <= got[f"{fmt}-flat"] * 1.1, got


def test_train_study_records_every_step():
    got = hier_study.run("train", 2, 2, steps=3)
    assert set(got) == {"torch", "fp32-hier", "bf16-hier", "fp8-hier"}
    assert all(len(v) == 3 for v in got.values())
    assert got["fp32-hier"][0] == got["torch"][0]  # the same model and batch before any update


def test_bad_shape_is_refused(capsys):
    with pytest.raises(SystemExit):
        hier_study.main(["error", "--shape", "2by2"])
    assert "HOSTSxRANKS" in capsys.readouterr().err
