"""What a reward function may return (relayrl.rewards.calls.to_reward): numbers numpy and torch give are numbers
(issue 36: `numpy.bool_(True)` counted as a failure while `True` scored 1); NaN, inf, None and strings are
failures of their sample, with a one-line reason."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from relayrl.rewards.calls import to_reward

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value, want", [
    (np.bool_(True), 1.0), (np.bool_(False), 0.0), (np.float32(0.25), 0.25), (np.float16(-2.0), -2.0),
    (np.int64(3), 3.0), (np.uint8(7), 7.0), (np.array(0.5), 0.5), (np.array(True), 1.0), (np.array(4, np.int32), 4.0),
    (torch.tensor(1.5), 1.5), (torch.tensor(True), 1.0), (torch.tensor(2, dtype=torch.int64), 2.0),
    (torch.tensor(0.75, requires_grad=True), 0.75), (True, 1.0), (Fraction(1, 4), 0.25), (2, 2.0),
])
def test_numbers_of_numpy_and_torch_score_like_python_numbers(value, want):
    assert to_reward(value) == (want, None)
    assert type(to_reward(value)[0]) is float


@pytest.mark.parametrize("value, says", [
    (math.nan, "returned nan, expected a finite real number"),
    (np.float32("inf"), "returned inf, expected a finite real number"),
    (np.array(np.nan), "returned nan, expected a finite real number"),
    (torch.tensor(-math.inf), "returned -inf, expected a finite real number"),
    (np.array([1.0]), "returned array([1.]) (ndarray), expected a finite real number"),  # not one number
    (torch.tensor([1.0, 2.0]), "returned tensor([1., 2.]) (Tensor), expected a finite real number"),
    (np.array(1 + 2j), "returned (1+2j) (complex), expected a finite real number"),
    (None, "returned None (NoneType), expected a finite real number"),
    ("high", "returned 'high' (str), expected a finite real number"),
    ("1.0", "returned '1.0' (str), expected a finite real number"),
])
def test_non_numbers_and_non_finite_values_are_failures(value, says):
    assert to_reward(value) == (None, says)


def test_a_scalar_whose_item_raises_is_a_failure_not_a_crash():
    class Odd:
        ndim = 0

        def item(self):
            raise RuntimeError("no value\nsecond line")

    assert to_reward(Odd()) == (None, "returned Odd whose .item() raised RuntimeError: no value")
