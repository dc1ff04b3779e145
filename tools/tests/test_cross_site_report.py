"""tools.cross_site_report: the target is torch's DDP's loss near the given
fraction of the run; time to target counts the warm-up at DDP's step time and
the rest at the run's own; a run that never reaches the target says so."""

from __future__ import annotations

from tools import cross_site_report as csr


def _run(evals, step_s, bytes_out=(0, 0), **extra):
    return {"evals": evals, "step_s": [step_s] * 10, "mean_step_s": step_s, "bytes_out": list(bytes_out), **extra}


def _results():
    ddp = [(0, 5.0), (9, 3.0), (19, 2.5), (29, 2.0), (39, 1.8)]
    cross = [(0, 5.0), (9, 3.2), (19, 2.6), (29, 2.4), (39, 2.0)]
    slow = [(0, 5.0), (9, 4.0), (19, 3.5), (29, 3.0), (39, 2.9)]
    return {"config": {"warmup": 10},
            "curves": {"local": _run(ddp, 0.1), "torch-ddp": _run(ddp, 1.0), "cross-16-fp8": _run(cross, 0.2),
                       "fastddp-hier-fp8": _run(slow, 0.5)},
            "timed": {"local@0.2": _run([], 0.1), "torch-ddp@0.2": _run([], 1.0, (100, 100)),
                      "cross-16-fp8@0.2": _run([], 0.2, (20, 20)),
                      "fastddp-hier-fp8@0.2": _run([], 0.5, (30, 30))}}


def test_steps_to_is_the_first_evaluation_at_or_below():
    assert csr.steps_to([(0, 3.0), (9, 2.0), (19, 1.0)], 2.0) == 10
    assert csr.steps_to([(0, 3.0)], 2.0) is None


def test_time_to_target_counts_the_warm_up_at_ddp_speed():
    text = csr.tables(_results(), target_frac=0.75)
    assert "step 30 of 40: **2.0000**" in text  # the evaluation nearest 0.75 of the run
    # cross reaches 2.0 at step 40: 10 warm-up steps at 1.0 s + 30 at 0.2 s = 16 s; DDP: 30 steps at 1 s
    assert "| cross-16-fp8 | 2.0000 | +11.1% | 40 | 16.0 s (0.533, —) |" in text
    assert "| fastddp-hier-fp8 | 2.9000 | +61.1% | never | — |" in text
    assert "| cross-16-fp8 | 200, 2.00, 0.200; 0.00 MB |" in text


def test_a_named_warm_up_wire_takes_the_hierarchical_modes_step_time():
    assert csr._warm_peer("cross-16-fp8-avg-wfp8") == "fastddp-hier-fp8"
    assert csr._warm_peer("cross-16-fp8-avg") == "torch-ddp"
    assert csr._warm_peer("torch-postlocal-16") == "torch-ddp"
