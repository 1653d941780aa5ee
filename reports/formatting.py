"""Turn result values into short display strings (numbers, mean ± std, shapes, plain words)."""

from __future__ import annotations

import math
from typing import Any

MISSING = "—"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def number(value: Any, digits: int = 4) -> str:
    """4 significant digits; inf as ∞, nan as n/a, None as a dash; other values as text."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "∞" if value > 0 else "−∞"
        return f"{value:.{digits}g}"
    return text(value)


def text(value: Any) -> str:
    """Lists joined by commas, numbers via number(), anything else as str."""
    if value is None:
        return MISSING
    if isinstance(value, (list, tuple)):
        return ", ".join(text(v) for v in value) if value else MISSING
    if is_number(value) or isinstance(value, bool):
        return number(value)
    return str(value)


def shape(value: Any) -> str:
    """[1, 8, 8] -> 1×8×8."""
    if isinstance(value, (list, tuple)) and value:
        return "×".join(str(v) for v in value)
    return text(value)


def mean_std(mean: Any, std: Any = None) -> str:
    """'0.93 ± 0.015'; the ± part only when the std is a finite positive number."""
    if is_finite(std) and std > 0:
        return f"{number(mean)} ± {number(std, 2)}"
    return number(mean)


def signed(value: Any) -> str:
    """+0.44 / −0.02 (non-numbers as number() shows them)."""
    if not is_finite(value):
        return number(value)
    return ("+" if value >= 0 else "−") + number(abs(value))


def advantage_words(kind: str, advantage: Any) -> str:
    """What an attack's advantage over its baseline means, in plain words."""
    if not is_finite(advantage):
        return "advantage unknown"
    if kind == "reconstruction":
        if advantage <= 0:
            return "no better than guessing the average input"
        return f"removes {advantage:.0%} of the error of guessing the average input"
    if advantage <= 0:
        return "no better than the attacker does without the bottom model"
    return f"{advantage * 100:.1f} percentage points better than without the bottom model"
