"""The attack battery: one module per attack, registered here by its CLI name.

Modules are imported on first use so that `splitaudit --help` stays fast.
"""
from __future__ import annotations

from importlib import import_module

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.errors import InputError

# CLI name -> (module in splitaudit.attacks, class name); the order is the report's order.
REGISTRY: dict[str, tuple[str, str]] = {
    "fine-tune": ("finetune", "FineTuneAttack"),
    "kmeans": ("kmeans", "KMeansAttack"),
    "attribute": ("attribute", "AttributeAttack"),
    "decoder": ("decoder", "DecoderAttack"),
    "optimization": ("optimization", "OptimizationAttack"),
    "sdar": ("sdar", "SDARAttack"),
}
ATTACK_NAMES = tuple(REGISTRY)


def get_attack(name: str) -> Attack:
    """A fresh instance of the attack registered under `name`."""
    module, cls = REGISTRY[name]
    return getattr(import_module(f"splitaudit.attacks.{module}"), cls)()


def check_attack_options(options: dict[str, dict]) -> None:
    """Raise InputError for an option naming no attack, or a key its attack does not take
    (a misspelt option would otherwise be ignored and the audit run on its default)."""
    for name, table in options.items():
        if name not in REGISTRY:
            raise InputError(f"attack option for unknown attack {name!r}; attacks: {', '.join(ATTACK_NAMES)}")
        known = get_attack(name).option_names
        unknown = sorted(set(table) - known)
        if unknown:
            takes = ", ".join(sorted(known)) or "no options"
            raise InputError(f"attack {name!r} has no option {unknown[0]!r}; it takes {takes}")


__all__ = ["ATTACK_NAMES", "REGISTRY", "Attack", "SeedOutcome", "check_attack_options", "get_attack"]
