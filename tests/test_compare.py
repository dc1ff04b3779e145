"""The tests' one comparison (tests/_compare.py) catches what it must and
says what differs; the parity harness's own control is in tests/test_parity.py."""

from __future__ import annotations

import pytest
import torch

from tests._compare import assert_bits, compare_grads, mismatch

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_one_ulp_is_a_mismatch(dtype):
    x = torch.linspace(-3, 3, 37, dtype=dtype)
    y = x.clone()
    y.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])[5] += 1
    assert mismatch(x, x.clone()) is None
    why = mismatch(y, x)
    assert why is not None and "1 of 37 elements differ, first at [5]" in why, why
    with pytest.raises(AssertionError, match="the case: 1 of 37"):
        assert_bits(y, x, "the case")


def test_signed_zero_differs_bit_for_bit_not_within_a_tolerance():
    assert mismatch(torch.tensor([0.0]), torch.tensor([-0.0])) is not None
    assert mismatch(torch.tensor([0.0]), torch.tensor([-0.0]), dict(rtol=0, atol=0)) is None


def test_nan_rules():
    a = torch.tensor([NAN, 1.0])
    assert mismatch(a, a.clone()) is None  # kernels: NaN where NaN
    why = mismatch(a, a.clone(), equal_nan=False)  # parity: a NaN is a mismatch, as torch.equal says
    assert why is not None and "NaN 1" in why, why
    assert mismatch(a, torch.tensor([1.0, 1.0])) is not None
    assert mismatch(a, a.clone(), dict(rtol=1e-5, atol=1e-6), equal_nan=False) is not None


def test_report_names_count_indices_max_diff_and_nonfinite():
    want = torch.zeros(20)
    got = want.clone()
    got[[3, 7, 11]] = torch.tensor([0.5, INF, 2.0])
    why = mismatch(got, want)
    assert "3 of 20 elements differ, first at [3, 7, 11]" in why, why
    assert "max |diff| inf at flat index 7" in why, why
    assert "got: NaN 0, Inf 1; want: NaN 0, Inf 0" in why, why
    assert "[11] got 2.0 (0x40000000)  want 0.0 (0x00000000)" in why, why


def test_tolerance_reports_only_the_elements_outside_it():
    want = torch.ones(10)
    got = want + 1e-7
    got[4] = 1.01
    why = mismatch(got, want, dict(rtol=1e-5, atol=1e-6))
    assert "1 of 10 elements differ, first at [4]" in why, why


def test_structure_before_values():
    assert "None-ness" in mismatch(None, torch.zeros(1))
    assert mismatch(None, None) is None
    assert "dtype/shape" in mismatch(torch.zeros(2), torch.zeros(3))
    assert "dtype/shape" in mismatch(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    assert "layout" in mismatch(sparse, sparse.to_dense())
    assert mismatch(sparse, sparse.clone()) is None
    assert mismatch(torch.tensor([1 + 2j]), torch.tensor([1 + 3j])) is not None
    assert mismatch(torch.tensor([True, False]), torch.tensor([True, True])) is not None
    assert mismatch(torch.arange(4), torch.arange(4)) is None


def test_compare_grads_names_the_parameter():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(1, 3)).sum().backward()
    compare_grads(a, b, "same")
    b.bias.grad[1] += 1e-3
    with pytest.raises(AssertionError, match=r"here: \.grad differs(.|\n)*bias: 1 of 2 elements differ"):
        compare_grads(a, b, "here")
