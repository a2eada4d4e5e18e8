"""The shared comparison helpers fail on what they must catch (a helper that cannot fail hides bugs)."""

from __future__ import annotations

import pytest
import torch

from tests.common import assert_close_dicts, assert_equal_tensors, error_of


def test_assert_equal_tensors_catches_a_value_and_a_missing_tensor() -> None:
    a, b = torch.ones(3), torch.zeros(3)
    assert_equal_tensors([a, b], [a.clone(), b.clone()])
    with pytest.raises(AssertionError, match="tensor 1 differs"):
        assert_equal_tensors([a, a], [a, b])
    with pytest.raises(AssertionError, match="2 tensors vs 1"):
        assert_equal_tensors([a, b], [a])


def test_assert_close_dicts_catches_keys_and_values() -> None:
    want = {"w": torch.ones(2), "b": torch.zeros(1)}
    assert_close_dicts({"w": torch.ones(2) + 1e-7, "b": torch.zeros(1)}, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="only expected \\['b'\\]"):
        assert_close_dicts({"w": torch.ones(2)}, want)
    with pytest.raises(AssertionError, match="w"):
        assert_close_dicts({"w": torch.ones(2) * 2, "b": torch.zeros(1)}, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="w differs"):
        assert_close_dicts({"w": torch.ones(2) + 1e-7, "b": torch.zeros(1)}, want)


def test_error_of_reports_type_and_message_or_none() -> None:
    def bad(x: int) -> None:
        raise ValueError(f"x must be positive, got {x}")

    assert error_of(bad, -1) == ("ValueError", "x must be positive, got -1")
    assert error_of(lambda: None) is None
    with pytest.raises(KeyError):
        error_of(lambda: {}["k"], catch=ValueError)
