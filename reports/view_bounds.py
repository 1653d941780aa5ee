"""The bounds section: the bounds' table and chart against the reconstruction attacks, the dFIL
facts and histogram, the leakiest samples, the prior's facts, and whether an attack beat a bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitaudit.core.registries import BOUNDS
from splitaudit.reports import charts
from splitaudit.reports.formatting import is_finite, is_number, number
from splitaudit.reports.view_elements import (
    Figure,
    Figures,
    Table,
    attack_entries,
    collected_notes,
    facts_table,
    ran_ok,
    records_table,
    section,
)

DFIL_LABELS = {
    "mean": "mean dFIL",
    "median": "median dFIL",
    "max": "max dFIL",
    "method": "Jacobian method",
    "stderr": "standard error",
}
PRIOR_LABELS = {
    "method": "prior estimator",
    "smoothing": "randomized smoothing τ",
    "J_over_d": "prior term J(π)/d",
    "stam_limit": "Stam limit 1/τ²",
    "validity": "validity",
    "valid": "estimate valid",
}


@dataclass
class BoundsView:
    bounds: Table | None
    dfil: Table | None
    dfil_chart: Figure | None
    dfil_note: str
    leakiest: Table | None
    prior: Table | None
    notes: list[str]
    chart: Figure | None
    violated_by: list[str]
    violation_causes: list[str] = field(default_factory=list)  # as the leakage stage recorded them

    def is_empty(self) -> bool:
        return not any(
            [self.bounds, self.dfil, self.dfil_chart, self.dfil_note, self.leakiest, self.prior, self.notes, self.chart]
        )


def bounds_view(result: dict, figures: Figures) -> BoundsView:
    bounds, dfil, prior = section(result, "bounds"), section(result, "dfil"), section(result, "prior")
    per_sample = [v for v in dfil.get("per_sample") or [] if is_number(v)]
    finite = [v for v in per_sample if math.isfinite(v)]
    chart = figures.add("dfil", "Histogram of per-sample dFIL", charts.dfil_histogram, finite) if finite else None
    note = ""
    if per_sample and len(finite) < len(per_sample):
        note = f"dFIL is infinite for {len(per_sample) - len(finite)} of {len(per_sample)} samples" + (
            " (σ = 0: a noiseless encoder)." if result.get("noise_sigma") == 0 else "."
        )
    return BoundsView(
        bounds=_bounds_table(bounds),
        dfil=facts_table(dfil, DFIL_LABELS),
        dfil_chart=chart,
        dfil_note=note,
        leakiest=records_table(dfil.get("leakiest")),
        prior=facts_table(prior, PRIOR_LABELS),
        notes=collected_notes(dfil, prior, bounds),
        chart=_bounds_chart(result, figures),
        violated_by=[str(v) for v in bounds.get("violated_by") or []],
        violation_causes=[str(c) for c in bounds.get("violation_causes") or []],
    )


def _bounds_table(bounds: dict) -> Table | None:
    rows = [
        [bound.name, number(bounds[key]), bound.holds_against, bound.formula]
        for key, bound in BOUNDS.items()
        if key in bounds
    ]
    return Table(["bound", "MSE at least", "holds against", "formula"], rows) if rows else None


def _bounds_chart(result: dict, figures: Figures) -> Figure | None:
    violated = set(section(result, "bounds").get("violated_by") or [])
    bars = [
        charts.MseBar(
            name,
            a["metrics"]["mse"],
            (a.get("metrics_std") or {}).get("mse", 0.0) or 0.0,
            (a.get("baseline") or {}).get("mse"),
            name in violated,
        )
        for name, a in attack_entries(result).items()
        if ran_ok(a) and a.get("kind") == "reconstruction" and is_finite((a.get("metrics") or {}).get("mse"))
    ]
    if not bars:
        return None
    bounds = section(result, "bounds")
    return figures.add(
        "bounds",
        "Reconstruction attacks' MSE against the bounds",
        charts.bounds_chart,
        bars,
        [charts.BoundLine(bound.label, bounds.get(key), bound.chart_color) for key, bound in BOUNDS.items()],
    )
