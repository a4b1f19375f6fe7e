"""Strict equality of decoded values: same types all the way down, for the codec tests."""
from __future__ import annotations

import datetime
import decimal
import math
from typing import Any

from rstreamer.codec.core import packb, unpackb


def roundtrip(value: Any) -> Any:
    """``value`` through the codec and back."""
    return unpackb(packb(value))


def assert_same(left: Any, right: Any) -> None:
    """Equal values of the same types all the way down (1 == 1.0 == True is not enough), time zones
    and folds included."""
    assert type(left) is type(right), (left, right)
    if isinstance(left, (list, tuple)):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            assert_same(a, b)
    elif isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, decimal.Decimal):
        assert str(left) == str(right)  # also for NaN, and keeps the exponent: Decimal("1.50")
    elif isinstance(left, complex):
        assert str(left) == str(right)  # nan, inf and the sign of zero
    elif isinstance(left, float) and math.isnan(left):
        assert math.isnan(right)
    elif isinstance(left, (datetime.datetime, datetime.time)):
        assert (left, left.fold) == (right, right.fold)
        assert type(left.tzinfo) is type(right.tzinfo) and left.tzinfo == right.tzinfo
        if isinstance(left.tzinfo, datetime.timezone):
            assert left.tzinfo.tzname(None) == right.tzinfo.tzname(None)
    else:
        assert left == right
