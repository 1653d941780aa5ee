"""The view-model: everything a report shows, read from the result object once.

HTML, Markdown and the terminal summary all render this view, so each number is formatted
in one place. Figures carry PNG bytes; each writer decides how to reference them. The sections
are built in their own modules: view_verdict (headline, alerts, gate table), view_summary
(executive summary), view_bounds (bounds and dFIL) and view_attacks (one section per attack).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from splitaudit.reports.formatting import number
from splitaudit.reports.view_attacks import AttackView, attack_view, not_run_table, overview_table
from splitaudit.reports.view_bounds import BoundsView, bounds_view
from splitaudit.reports.view_elements import (
    Figure,
    Figures,
    Item,
    Table,
    attack_entries,
    facts_table,
    gate_section,
    section,
)
from splitaudit.reports.view_provenance import ProvenanceView, provenance_view
from splitaudit.reports.view_summary import summary_items
from splitaudit.reports.view_verdict import alert_lines, gate_table, headline, verdict_class

MODEL_LABELS = {
    "path": "model file",
    "format": "format",
    "input_shape": "input shape",
    "output_shape": "output (embedding) shape",
    "gradient_mode": "gradients",
    "parity_max_abs_err": "ONNX conversion error (max abs)",
    "stochastic": "stochastic encoder",
    "providers": "onnxruntime providers",
}
DATA_LABELS = {
    "aux_path": "auxiliary data (attacker's)",
    "target_path": "target data (victims')",
    "n_aux": "auxiliary samples",
    "n_target": "target samples",
    "classes": "classes",
    "class_names": "class names",
    "has_labels": "labels",
    "has_attr": "sensitive attribute",
    "input_kind": "kind of inputs",
    "is_image": "images",
    "in_unit_range": "values in [0, 1]",
    "sample_shape": "sample shape",
}
RUN_LABELS = {
    "started": "started",
    "seconds": "duration (s)",
    "device": "device",
    "seed": "seed",
    "seeds": "seeds averaged over",
    "quick": "quick smoke run",
    "python": "Python",
    "torch": "PyTorch",
}


@dataclass
class ReportView:
    title: str
    subtitle: str
    passed: bool
    verdict_class: str
    headline: str
    reasons: list[str]
    alerts: list[str]
    summary: list[Item]
    overview: Table | None
    gate: Table | None
    bounds: BoundsView | None
    attacks: list[AttackView]
    model: Table | None
    warnings: list[str]
    data: Table | None
    run: Table | None
    not_run: Table | None
    figures: list[Figure]
    provenance: ProvenanceView | None = None


def build_view(result: dict, with_figures: bool = True) -> ReportView:
    """The whole report's content; with_figures=False skips matplotlib (terminal summary)."""
    figures = Figures(with_figures)
    attacks = attack_entries(result)
    bounds = bounds_view(result, figures)
    model = section(result, "model")
    return ReportView(
        title="splitaudit leakage report",
        subtitle=subtitle(result),
        passed=bool(gate_section(result).get("passed", False)),
        verdict_class=verdict_class(result),
        headline=headline(result),
        reasons=[str(r) for r in gate_section(result).get("reasons") or []],
        alerts=alert_lines(result, attacks),
        summary=summary_items(result, attacks),
        overview=overview_table(attacks),
        gate=gate_table(result),
        bounds=None if bounds.is_empty() else bounds,
        attacks=[attack_view(name, a, result, figures) for name, a in attacks.items()],
        model=facts_table(model, MODEL_LABELS),
        warnings=[str(w) for w in model.get("warnings") or []],
        data=facts_table(section(result, "data"), DATA_LABELS),
        run=facts_table(
            {**section(result, "run"), "version": section(result, "tool").get("version")},
            {**RUN_LABELS, "version": "splitaudit version"},
        ),
        not_run=not_run_table(attacks),
        figures=figures.made,
        provenance=provenance_view(result),
    )


def subtitle(result: dict) -> str:
    model = section(result, "model")
    name = PurePath(str(model.get("path"))).name if model.get("path") else "unknown model"
    run = section(result, "run")
    parts = [name, f"noise σ = {number(result.get('noise_sigma'))}"]
    if run.get("started"):
        parts.append(str(run["started"]))
    return " · ".join(parts)
