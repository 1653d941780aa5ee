"""Options: one way to declare them and one check, for run options and attack options alike.

An option is a field of a dataclass (AuditOptions for a run, an attack's Options for its
`[attack.NAME]` table) declared with `option(...)`: its default, one line of help, and the values
it takes (low/high inclusive, above/below exclusive, choices, or a noise scale: 0 or at least
MIN_SCALE). Its type is the field's annotation (X, X | None, list[X], tuple[X, ...]). A run option
also says where it is set besides its TOML key: the CLI commands taking it as a flag, and whether
splitaudit.audit() takes it as a keyword (an attack option is set in its table only).

`checked` tests a value against both the annotation and the limits and returns it as the option
stores it; `option_rule` says in words which values fit, for error messages, help and the reference.
"""

from __future__ import annotations

import math
import operator
import types
import typing
from dataclasses import MISSING, Field, dataclass, field
from typing import Any

from splitaudit.core.errors import InputError

MAX_INT32 = 2**31 - 1  # sizes and counts beyond this overflow the int32 indices of torch kernels
MIN_SCALE = 1e-12  # a positive scale below this underflows float32 when squared (1/sigma^2 divides by 0)

RUN, SWEEP, CALIBRATE, CUTS = "run", "sweep", "calibrate", "cuts"
MEASURING = frozenset({RUN, SWEEP, CALIBRATE, CUTS})  # the commands that load a model and its data
AUDITING = frozenset({RUN, SWEEP, CUTS})  # ... and run attacks

NOUNS = {  # what a value of each type is called in a rule: one, and a list of them
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
    bool: ("true or false", "true or false values"),
    dict: ("a table", "tables"),
}
COMPARE = {">=": operator.ge, ">": operator.gt, "<": operator.lt, "<=": operator.le}


@dataclass(frozen=True)
class OptionSpec:
    """An option's help and the values it takes; for a run option, where it is set.

    low/high: inclusive limits, above/below: exclusive ones (an integer with no upper limit stops
    at MAX_INT32); choices: the values a string takes; scale: a noise scale, 0 or from MIN_SCALE up
    (a smaller one underflows float32 when squared). Where a run option is set: commands, the CLI
    commands taking it as a flag (--name-with-dashes, or `flag`); help_for, a command's own help
    where it differs; api, whether splitaudit.audit() takes it as a keyword (those that say how
    reports are written belong to AuditResult.write instead); metavar; is_path, the flag names a
    file; required_in, the commands that need it. The flag's type comes from the annotation. An
    attack option is set in its `[attack.NAME]` table (or --attack-option): its where-fields keep
    their defaults and nothing reads them."""

    help: str
    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple = ()
    scale: bool = False
    commands: frozenset[str] = AUDITING
    api: bool = True
    help_for: tuple[tuple[str, str], ...] = ()
    flag: str | None = None
    metavar: str | None = None
    is_path: bool = False
    required_in: frozenset[str] = frozenset()

    def help_in(self, command: str) -> str:
        return dict(self.help_for).get(command, self.help)


def option(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, **spec: Any) -> Any:
    """A dataclass field that is an option (`spec`: OptionSpec's fields but help)."""
    return field(default=default, default_factory=factory, metadata={"option": OptionSpec(help, **spec)})


def option_spec(f: Field) -> OptionSpec:
    return f.metadata["option"]


def checked(name: str, f: Field, hint: Any, value: Any) -> Any:
    """`value` as option `f` (annotated `hint`) stores it: an int as a float for a number, a list's
    items each checked. InputError "NAME must be RULE, got VALUE" (the offending item of a list)
    when it does not fit: a bool is never a number, nan and inf never fit."""
    fits, stored = _fit(option_spec(f), hint, value)
    if not fits:
        raise InputError(f"{name} must be {option_rule(f, hint)}, got {stored!r:.60}")
    return stored


def option_rule(f: Field, hint: Any) -> str:
    """The values option `f` (annotated `hint`) takes, in words."""
    spec, (item, sequence) = option_spec(f), _item_type(hint)
    return f"a list of {_item_rule(spec, item, plural=True)}" if sequence else _item_rule(spec, item, plural=False)


def _item_type(hint: Any) -> tuple[Any, type | None]:
    """(the type of one value, list or tuple when the option holds several); None is the default
    that depends on the run, never a value to check."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return typing.get_args(hint)[0], origin
    return origin or hint, None


def _fit(spec: OptionSpec, hint: Any, value: Any) -> tuple[bool, Any]:
    """(whether `value` fits, the value as stored or else the offending value)."""
    if value is None:
        return _optional(hint), value
    item, sequence = _item_type(hint)
    if sequence is None:
        return _fit_item(spec, item, value)
    stored = []
    for each in value if isinstance(value, list | tuple) else [value]:  # one value is a one-item list
        fits, kept = _fit_item(spec, item, each)
        if not fits:
            return False, kept
        stored.append(kept)
    return True, sequence(stored)


def _optional(hint: Any) -> bool:
    """Whether the annotation admits None (X | None)."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _fit_item(spec: OptionSpec, kind: type, value: Any) -> tuple[bool, Any]:
    """(whether one value fits its type and limits, the value as stored)."""
    if isinstance(value, bool) != (kind is bool):
        return False, value
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or (kind is float and not math.isfinite(value)):
        return False, value
    if spec.choices:
        return value in spec.choices, value
    if spec.scale and value == 0:
        return True, value
    return all(COMPARE[sign](value, limit) for sign, limit in _bounds(spec, kind).items()), value


def _bounds(spec: OptionSpec, kind: type) -> dict[str, float]:
    """{sign: limit} of the limits a value is checked against, lower ones first: a scale's low is
    MIN_SCALE (0 apart), and an integer with no upper limit stops at MAX_INT32 (batch_size=1e20 is
    no batch size)."""
    low = MIN_SCALE if spec.scale else spec.low
    high = MAX_INT32 if kind is int and spec.high is None and spec.below is None else spec.high
    limits = {">=": low, ">": spec.above, "<": spec.below, "<=": high}
    return {sign: limit for sign, limit in limits.items() if limit is not None}


def _item_rule(spec: OptionSpec, kind: type, plural: bool) -> str:
    """The values one item takes, in words: its type, then its limits or choices."""
    if spec.choices:
        return "one of " + ", ".join(repr(c) for c in spec.choices)
    noun = NOUNS[kind][plural]
    bounds = " and ".join(
        f"{sign} {limit if isinstance(limit, int) else format(limit, 'g')}"
        for sign, limit in _bounds(spec, kind).items()
    )
    if spec.scale:
        return f"{noun}, each 0 or {bounds}" if plural else f"0 or {noun} {bounds}"
    return f"{noun} {bounds}" if bounds else noun
