"""Argument checks shared by the compression functions and the compressors' constructors."""

from __future__ import annotations


def check_ratio(name: str, ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]; got {ratio}")


def check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
