"""tools.zoo_verdicts: the verdict of one run is its own interval's; repeated
runs combine by ratio_over_runs; the counts name every slower pair."""

from __future__ import annotations

import json

from tools import zoo_verdicts as zv


def _report(gbit, comps):
    return {"sections": [{"wire": {"kind": "netns", "gbit": gbit},
                          "comparisons": [{"model": m, "wrapper": w, "peer": p, "ratio": r, "ratio_ci": ci}
                                          for m, w, p, r, ci in comps]}]}


def test_one_run_keeps_its_interval_and_several_combine():
    a = _report(None, [("small", "fastddp", "torch", 0.95, [0.93, 0.97]),
                       ("small", "fastddp-batched", "torch-batched", 1.03, [1.01, 1.05])])
    b = _report(10, [("small", "fastddp", "torch", 1.00, [0.97, 1.03])])
    c = _report(10, [("small", "fastddp", "torch", 1.02, [0.99, 1.05])])
    got = zv.collect([a, b, c])
    assert zv.verdict(got[("small", "fastddp", "unshaped")])[3] == "faster"
    assert zv.verdict(got[("small", "fastddp-batched", "unshaped")])[3] == "slower"
    r, lo, hi, v = zv.verdict(got[("small", "fastddp", "10")])  # two runs: their own spread decides
    assert v == "undecided" and lo < 1.0 < hi and abs(r - (1.00 * 1.02) ** 0.5) < 1e-12
    lines, counts = zv.table(got)
    assert counts["slower"] == ["small fastddp-batched at unshaped"]
    assert counts["faster_fast"] == 1 and counts["pairs_fast"] == 3
    assert lines[0] == "| model | pair | unshaped | 10 Gbit/s |" and "2 runs" in lines[2]


def test_runs_that_agree_decide_where_each_alone_could_not():
    runs = [_report(1, [("m", "fastddp", "torch", r, [r - 0.03, r + 0.03])]) for r in (1.011, 1.012, 1.013)]
    assert zv.verdict(zv.collect(runs)[("m", "fastddp", "1")])[3] == "slower"


def test_main_prints_the_table_and_the_counts(tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_report(0.2, [("m", "fastddp-view", "torch-view", 0.99, [0.98, 1.0])])))
    assert zv.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "| m | fastddp-view / torch-view | 0.990 (0.980-1.000) undecided |" in out
    assert "decided slower: 0 (none)" in out
