"""Argument types the tools' command lines share."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_counts(what: str) -> Callable[[str], list[int]]:
    """An argparse type for comma-separated numbers of ``what``, each at least 1 (``1,2,4``)."""

    def parse(text: str) -> list[int]:
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers of {what}, got {text!r}") from None
        if not counts or min(counts) < 1:
            raise argparse.ArgumentTypeError(f"every number of {what} is at least 1, got {text!r}")
        return counts

    return parse
