"""attrs validators for the router's settings: one definition of each bound."""

from __future__ import annotations

import attrs


def positive(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


def positive_int(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be at least 1, got {value}")


def non_negative(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def optional_non_negative(
    _inst: object, attr: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and not value >= 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")
