"""The contract every attack follows (one module per attack, one class each).

An attack declares what it needs from the inputs, runs once per seed, and returns its metrics
and the matching baseline (what an attacker achieves without the bottom model). `Attack.run`
turns that into the result entry: skipped with a reason, failed with a reason, or ok with the
mean and std over seeds and the advantage over the baseline (paper 000, Def. 1).
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from splitaudit.context import AuditContext

NEEDS = {"labels", "attribute", "gradients"}


@dataclass
class SeedOutcome:
    """One seed's result. metrics/baseline values are numbers or dicts of numbers."""

    metrics: dict[str, Any]
    baseline: dict[str, Any]
    examples: list[dict] = field(default_factory=list)  # reconstructions shown in the report
    details: dict[str, Any] = field(default_factory=dict)  # extra JSON-ready facts (first seed's)


class Attack(ABC):
    """Base class: subclasses set the class attributes and implement `run_seed`."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "label" (accuracy, higher is better) or "reconstruction" (MSE)
    primary_metric: ClassVar[str]
    needs: ClassVar[frozenset[str]] = frozenset()
    assumptions: ClassVar[str] = ""  # what the attacker is assumed to hold, for the report
    advantage_basis: ClassVar[str] = ""  # how `advantage` is taken, when not at the headline metric
    option_names: ClassVar[frozenset[str]] = frozenset()  # the keys its [attack.NAME] table takes

    @abstractmethod
    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        """Run the attack once with this seed."""

    def missing(self, ctx: AuditContext) -> str | None:
        """Why the attack cannot run on these inputs, or None when it can."""
        if "labels" in self.needs and (ctx.aux.y is None or ctx.target.y is None):
            return "the data has no labels (npz 'y', --label-column, or an image folder's class names)"
        if "labels" in self.needs and self.kind == "label" and len(ctx.aux.y.unique()) < 2:
            return "the labels hold a single class: a label attack would be trivially right, so it is not run"
        if "attribute" in self.needs and (ctx.aux.attr is None or ctx.target.attr is None):
            return "the data has no sensitive attribute (npz 'attr' or --attr-column)"
        if "attribute" in self.needs and len(ctx.aux.attr.unique()) < 2:
            return "the sensitive attribute takes a single value: inferring it would be trivially right"
        if "gradients" in self.needs and not ctx.encoder.differentiable:
            return "needs gradients of the model, and it runs black-box (see the model warnings)"
        return None

    def advantage(self, metrics: dict, baseline: dict) -> float:
        """Accuracy gain over the baseline; for MSE, the fraction of the baseline error removed."""
        attack, base = metrics[self.primary_metric], baseline[self.primary_metric]
        if self.kind == "reconstruction":
            return 1.0 - attack / base if base > 0 else 0.0
        return attack - base

    def run(self, ctx: AuditContext) -> dict:
        """The result entry for report.json (never raises for a failure inside the attack)."""
        reason = self.missing(ctx)
        if reason:
            return self.skipped(reason)
        start = time.perf_counter()
        try:
            outcomes = [self.run_seed(ctx, seed) for seed in ctx.seeds]
        except Exception as exc:  # an attack's failure is reported, not fatal to the audit
            return self.failed(f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
        return self.summarize(ctx.seeds, outcomes, time.perf_counter() - start)

    def header(self) -> dict[str, Any]:
        """The entry's fields that do not depend on a run."""
        entry: dict[str, Any] = {"kind": self.kind, "assumptions": self.assumptions,
                                 "primary_metric": self.primary_metric}
        if self.advantage_basis:
            entry["advantage_basis"] = self.advantage_basis
        return entry

    def skipped(self, reason: str) -> dict:
        return {**self.header(), "status": "skipped", "reason": reason}

    def failed(self, reason: str, seconds: float) -> dict:
        return {**self.header(), "status": "failed", "reason": reason[:500], "seconds": seconds}

    def summarize(self, seeds: list[int], outcomes: list[SeedOutcome], seconds: float) -> dict:
        """The ok entry from every seed's outcome (the executor runs seeds as separate tasks)."""
        metrics, metrics_std = aggregate([o.metrics for o in outcomes])
        baseline, baseline_std = aggregate([o.baseline for o in outcomes])
        advantages = [self.advantage(o.metrics, o.baseline) for o in outcomes]
        return {
            **self.header(), "status": "ok", "reason": "",
            "metrics": metrics, "metrics_std": metrics_std,
            "baseline": baseline, "baseline_std": baseline_std,
            "advantage": float(np.mean(advantages)), "advantage_std": float(np.std(advantages)),
            "seeds": list(seeds), "seconds": seconds,
            "examples": outcomes[0].examples, "details": outcomes[0].details,
        }


def aggregate(runs: list[dict]) -> tuple[dict, dict]:
    """Mean and std across seeds, key by key (nested dicts recurse; non-finite values kept)."""
    means, stds = {}, {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(first, dict):
            means[key], stds[key] = aggregate(values)
        else:
            arr = np.asarray(values, dtype=float)
            means[key] = float(arr.mean())
            stds[key] = float(arr.std()) if np.all(np.isfinite(arr)) else math.nan
    return means, stds
