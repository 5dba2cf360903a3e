"""tf_ttemb._args: the shared argument checks and their messages."""

from __future__ import annotations

import numpy as np
import pytest

from tf_ttemb import _args


@pytest.mark.parametrize(
    "value,minimum,want", [(3, 1, 3), (np.int64(7), 1, 7), (0, 0, 0), (np.array(5), 2, 5)]
)
def test_positive_int_accepts_integers_at_least_the_minimum(value, minimum, want):
    got = _args.positive_int("n", value, minimum)
    assert got == want and type(got) is int


@pytest.mark.parametrize(
    "value,minimum",
    [(0, 1), (-3, 1), (1, 2), (True, 1), (2.0, 1), ("3", 1), (None, 1), (np.array([2]), 1)],
)
def test_positive_int_names_the_argument_the_bound_and_the_value(value, minimum):
    with pytest.raises(ValueError) as info:
        _args.positive_int("num_rows", value, minimum)
    assert str(info.value) == f"num_rows must be an integer >= {minimum}, got {value!r}"


def test_check_choice():
    _args.check_choice("combiner", "mean", ("sum", "mean"))
    _args.check_choice("quantize", None, (None, "int8"))
    for bad in ("max", 1, None, b"sum"):
        with pytest.raises(ValueError) as info:
            _args.check_choice("combiner", bad, ("sum", "mean"))
        assert str(info.value) == f"combiner must be one of 'sum', 'mean', got {bad!r}"


@pytest.mark.parametrize("value,want", [(3, 3), (np.int64(-7), -7), (np.array(5), 5), (0, 0)])
def test_as_integer_takes_integers(value, want):
    assert _args.as_integer(value) == want and type(_args.as_integer(value)) is int


@pytest.mark.parametrize("value", [True, False, 2.0, "3", None, np.array([1]), 1.5])
def test_as_integer_rejects_everything_else(value):
    assert _args.as_integer(value) is None


@pytest.mark.parametrize("value,want", [(None, None), (-1, -1), (0, 0), (np.int32(9), 9)])
def test_layer_padding_id_accepts_none_minus_one_and_rows(value, want):
    assert _args.layer_padding_id(value, "input_dim", 10) == want


@pytest.mark.parametrize("value", [10, -2, True, 1.0, "0"])
def test_layer_padding_id_names_the_rows_and_the_value(value):
    with pytest.raises(ValueError) as e:
        _args.layer_padding_id(value, "input_dim", 10)
    assert str(e.value) == (
        f"padding_id must be None, -1 or an integer in [0, input_dim=10), got {value!r}"
    )
