"""Checks of Python arguments shared by the package's ops, layers and tools.

One function per kind of argument, so that a bad value gets the same message wherever it is
passed: the argument's name, what it must be, and the value given.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence


def as_integer(value: Any) -> int | None:
    """`value` as a Python int if it is an integer (a Python or numpy integer, anything
    with `__index__`, not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def layer_padding_id(value: Any, rows_name: str, rows: int) -> int | None:
    """A layer's `padding_id`: None, -1 (an id that is never a row) or a row in [0, rows),
    whose embedding training then leaves untouched. Returns it as an int (or None).

    Raises:
      ValueError: naming the argument, the table's row count and the value.
    """
    if value is None:
        return None
    number = as_integer(value)
    if number is None or not -1 <= number < rows:
        raise ValueError(
            f"padding_id must be None, -1 or an integer in [0, {rows_name}={rows}), got {value!r}"
        )
    return number


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int, if it is an integer (not a bool) of at least `minimum`.

    Args:
      name: The argument's name, for the message.
      value: What was passed: a Python or numpy integer, or anything with `__index__`.
      minimum: The smallest value allowed.

    Returns:
      The value as a Python int.

    Raises:
      ValueError: naming the argument, the bound and the value.

    Example:
      >>> positive_int("dim", 8)
      8
    """
    number = as_integer(value)
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def check_choice(what: str, value: Any, allowed: Sequence) -> None:
    """Raises a ValueError naming `what`, the allowed values and `value` unless `value` is one
    of `allowed` (for string options, `value` must be a str).

    Example:
      >>> check_choice("combiner", "sum", ("sum", "mean"))
    """
    if (not isinstance(value, str) and all(isinstance(a, str) for a in allowed)) or (
        value not in allowed
    ):
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def check_table_lists(indices: Sequence, weights: Any, num_tables: int) -> None:
    """For ids given as a list with one entry per table: raises a ValueError unless there
    are `num_tables` of them, and `weights` is None or a list of as many."""
    if len(indices) != num_tables:
        raise ValueError(
            f"a list of indices needs one entry per table ({num_tables}), got {len(indices)}"
        )
    if weights is not None and (
        not isinstance(weights, (list, tuple)) or len(weights) != num_tables
    ):
        raise ValueError(
            f"with a list of indices, weights must be None or a list of {num_tables} "
            f"weights, got {type(weights).__name__}"
        )
