"""The attack battery: one module per attack, registered here by its CLI name.

Modules are imported on first use so that `splitaudit --help` stays fast.
"""
from __future__ import annotations

from importlib import import_module

from splitaudit.attacks.base import Attack, SeedOutcome

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


__all__ = ["ATTACK_NAMES", "REGISTRY", "Attack", "SeedOutcome", "get_attack"]
