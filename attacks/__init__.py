"""The attack battery: one module per attack, registered here by its CLI name.

Modules (and torch) are imported on first use so that `splitaudit --help` stays fast.

Adding an attack: write one module here with one `Attack` subclass (see attacks/base.py) that
sets `name`, `kind`, `primary_metric`, `title`, `baseline_name`, `metrics`, `needs`,
`input_kinds` (when it is not built for every kind of input), `assumptions`, an `Options`
dataclass of `option(...)` fields when it takes options, and implements `run_seed`; then add
one line to REGISTRY below. The CLI (--attacks), option checking, the report's words (each
result entry carries them) and the conformance suite (tests/test_attack_contract.py, which runs
each attack on a tiny context of every input kind it declares) all read the registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitaudit.core.errors import InputError
from splitaudit.core.registries import resolve

if TYPE_CHECKING:
    from splitaudit.attacks.base import Attack
    from splitaudit.context.audit_context import AuditContext

# CLI name -> (module, class name), the module imported on first use; the order is the report's order.
REGISTRY: dict[str, tuple[str, str]] = {
    name: (f"splitaudit.attacks.{module}", cls)
    for name, module, cls in (
        ("fine-tune", "finetune", "FineTuneAttack"),
        ("kmeans", "kmeans", "KMeansAttack"),
        ("attribute", "attribute", "AttributeAttack"),
        ("decoder", "decoder", "DecoderAttack"),
        ("optimization", "optimization", "OptimizationAttack"),
        ("sdar", "sdar", "SDARAttack"),
        ("token-inversion", "token_inversion", "TokenInversionAttack"),
        ("sequential-inversion", "sequential_inversion", "SequentialInversionAttack"),
    )
}


def attack_names() -> tuple[str, ...]:
    """The registered attacks' names, in the report's order (read when asked: the registry is the list)."""
    return tuple(REGISTRY)


def attack_class(name: str) -> type["Attack"]:
    """The class registered under `name` (its module is imported now)."""
    return resolve(REGISTRY[name])


def get_attack(name: str) -> "Attack":
    """A fresh instance of the attack registered under `name`."""
    return attack_class(name)()


def selected_attacks(names: list[str]) -> list[str]:
    """Expand all/none and check names against the registry, keeping the registry's order."""
    if names in (["all"], ["*"]):
        return list(attack_names())
    if names in (["none"], []):
        return []
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise InputError(f"unknown attack {unknown[0]!r}; choose from all, none, {', '.join(attack_names())}")
    return [n for n in attack_names() if n in names]


def check_attack_request(names: list[str], options: dict[str, dict]) -> None:
    """Raise InputError for an attack name or an attack option no registered attack takes: with the
    run options' own checks (AuditOptions.validate), what the CLI and the API refuse before any file
    is read or any output folder claimed."""
    selected_attacks(names)
    check_attack_options(options)


def check_attack_options(options: dict[str, dict]) -> None:
    """Raise InputError for an option naming no attack, a key its attack does not take (a
    misspelt option would otherwise be ignored) or a value outside its declared type and range,
    before anything is computed."""
    for name, table in options.items():
        if name not in REGISTRY:
            raise InputError(f"attack option for unknown attack {name!r}; attacks: {', '.join(attack_names())}")
        attack_class(name).parse_options(table)


def check_attack_inputs(ctx: "AuditContext", names: list[str]) -> None:
    """Raise InputError for a selected attack's option the loaded data cannot use (e.g. a TV prior
    on tabular rows) before any attack runs, rather than as that attack's failure."""
    for name in names:
        get_attack(name).check_inputs(ctx)


__all__ = [
    "REGISTRY",
    "attack_class",
    "attack_names",
    "check_attack_inputs",
    "check_attack_options",
    "check_attack_request",
    "get_attack",
    "selected_attacks",
]
