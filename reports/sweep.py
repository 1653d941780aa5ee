"""The sweep report (sweep.html, sweep.md, the terminal summary), read from sweep.json alone.

The recommendation comes first, in words a reviewer can sign; then the frontier (one row per
audited sigma), the two charts (bounds and attack MSEs; label-attack advantage and utility,
both against sigma) and a section per point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from splitaudit.core.registries import BOUNDS, GATED_BOUND
from splitaudit.core.result import sweep_json_schema
from splitaudit.reports import charts
from splitaudit.reports.documents import Document, write_document
from splitaudit.reports.formatting import is_finite, mean_std, number, text
from splitaudit.reports.terminal import _wrap
from splitaudit.reports.view import DATA_LABELS, MODEL_LABELS, RUN_LABELS, subtitle
from splitaudit.reports.view_attacks import attack_title, overview_table
from splitaudit.reports.view_elements import Figure, Figures, Item, Table, facts_table, section
from splitaudit.reports.view_provenance import ProvenanceView, provenance_view
from splitaudit.reports.view_summary import utility_words
from splitaudit.reports.view_verdict import QUICK_ALERT, gate_table, headline, verdict_class

ORIGIN_WORDS = {"grid": "grid", "calibrated": "calibrated for the target", "around-calibrated": "near the calibrated"}


@dataclass
class PointView:
    sigma: str
    anchor: str
    recommended: bool
    bounds: Table
    attacks: Table | None
    utility: str
    notes: list[str]


@dataclass
class SweepView:
    title: str
    subtitle: str
    verdict_class: str
    headline: str
    alerts: list[str]
    summary: list[Item]
    frontier: Table
    gate: Table | None
    mse_chart: Figure | None
    utility_chart: Figure | None
    points: list[PointView]
    model: Table | None
    data: Table | None
    run: Table | None
    figures: list[Figure]
    provenance: ProvenanceView | None = None


def _points(sweep: dict) -> list[dict]:
    return [p for p in sweep.get("points") or [] if isinstance(p, dict)]


def build_sweep_view(sweep: dict, with_figures: bool = True) -> SweepView:
    """Everything the sweep pages show; with_figures=False skips matplotlib (terminal summary)."""
    figures = Figures(with_figures)
    points = _points(sweep)
    sigmas = [p.get("noise_sigma") for p in points]
    mse_chart = (
        figures.add(
            "sweep-mse", "Bound and attack MSEs against the noise sigma", charts.sweep_mse_chart, *_mse_series(sweep)
        )
        if points
        else None
    )
    advantages, utility = _utility_series(points)
    utility_chart = (
        figures.add(
            "sweep-utility",
            "Label-attack advantage and utility against the noise sigma",
            charts.sweep_utility_chart,
            sigmas,
            advantages,
            utility,
        )
        if points and (advantages or utility)
        else None
    )
    rec_index = section(sweep, "recommendation").get("point_index")
    return SweepView(
        title="splitaudit noise sweep",
        subtitle=_subtitle(sweep),
        verdict_class=verdict_class(sweep),
        headline=headline(sweep),
        alerts=_alerts(sweep),
        summary=_summary(sweep),
        frontier=_frontier(sweep),
        gate=gate_table(sweep),
        mse_chart=mse_chart,
        utility_chart=utility_chart,
        points=[_point_view(p, i == rec_index) for i, p in enumerate(points)],
        model=facts_table(sweep.get("model") or {}, MODEL_LABELS),
        data=facts_table(sweep.get("data") or {}, DATA_LABELS),
        run=facts_table(
            {**(sweep.get("run") or {}), "version": (sweep.get("tool") or {}).get("version")},
            {**RUN_LABELS, "executor": "executor", "version": "splitaudit version"},
        ),
        figures=figures.made,
        provenance=provenance_view(sweep),
    )


def _subtitle(sweep: dict) -> str:
    sigmas = ", ".join(number(p.get("noise_sigma")) for p in _points(sweep))
    return subtitle({**sweep, "noise_sigma": f"{{{sigmas}}}"})  # "noise σ = {0, 0.1, ...}"


def recommendation_words(sweep: dict) -> Item:
    """The recommendation as one sentence a reviewer can sign, or plainly why there is none."""
    rec = section(sweep, "recommendation")
    sigma = rec.get("noise_sigma")
    if not is_finite(sigma):
        return Item(
            "Recommendation",
            "No noise σ can be recommended: " + str(rec.get("reason") or "no reason given") + ".",
            "bad",
        )
    point = _points(sweep)[rec["point_index"]]
    smoothing = (sweep.get("prior") or {}).get("smoothing")
    condition = (
        f" (for inputs smoothed with noise τ = {number(smoothing)}, as the bound assumes)"
        if is_finite(smoothing) and smoothing > 0
        else ""
    )
    words = (
        f"Add Gaussian noise with σ = {number(sigma)} to the embeddings. This guarantees that no attacker "
        f"reconstructs inputs with a mean squared error below {number(rec.get(GATED_BOUND.key))} per dimension"
        f"{condition}, meeting the target {number(rec.get('target_mse'))}."
    )
    checked = [
        attack_title(n, a)
        for n, a in (point.get("attacks") or {}).items()
        if a.get("kind") == "reconstruction" and a.get("status") == "ok"
    ]
    words += (
        f" At this σ the attacks confirm it: {', '.join(checked)} stay above the bound."
        if checked
        else " No reconstruction attack was run at this σ, so the bound was not checked empirically."
    )
    loss = rec.get("utility_loss")
    utility = point.get("utility") or {}
    if is_finite(loss):
        words += (
            f" It costs {number(loss)} task accuracy ({number(utility.get('clean_accuracy'))} → "
            f"{number(utility.get('accuracy'))}, {utility.get('source')})."
        )
    else:
        words += f" Its cost in accuracy is unknown ({utility.get('reason') or 'not measured'})."
    tone = "good"
    if rec.get("meets_utility") is False:
        words += (
            f" That is MORE than the allowed utility loss {number(rec.get('max_utility_loss'))}: the target "
            "bound cannot be met within the utility limit."
        )
        tone = "bad"
    elif rec.get("meets_utility"):
        words += f" That is within the allowed utility loss {number(rec.get('max_utility_loss'))}."
    return Item("Recommendation", words, tone)


def _summary(sweep: dict) -> list[Item]:
    items = [recommendation_words(sweep)]
    target = (
        f"{GATED_BOUND.name} bound MSE ≥ {number(sweep.get('target_mse'))} ({sweep.get('target_source')}); "
        "the bound holds against any attacker that knows the data distribution (Maeng et al., NeurIPS 2023)."
    )
    items.append(Item("Target", target))
    auto = sweep.get("auto_sigma") or {}
    if auto.get("requested"):
        items.append(
            Item(
                "Calibrated σ",
                f"σ = {number(auto.get('sigma'))} and points around it were added to the grid."
                if is_finite(auto.get("sigma"))
                else f"No σ could be calibrated: {auto.get('reason')}.",
                "info" if is_finite(auto.get("sigma")) else "warn",
            )
        )
    inversions = inversion_words(_points(sweep))
    if inversions is not None:
        items.append(inversions)
    clean = sweep.get("utility_clean") or {}
    items.append(
        Item(
            "Utility",
            utility_words(clean)
            if clean.get("status") != "ok"
            else f"Measured as the {clean.get('description')}; without noise it is "
            f"{mean_std(clean.get('accuracy'), clean.get('accuracy_std'))}.",
        )
    )
    return items


def inversion_words(points: list[dict]) -> Item | None:
    """Token sweeps: where the sequential inversion recovers fewer tokens than the learned one, and why
    (None when the two did not both run at any sigma)."""
    compared = [(p, p["inversions"]) for p in points if isinstance(p.get("inversions"), dict)]
    if not compared:
        return None
    weaker = [(p, c) for p, c in compared if c.get("weaker")]
    if not weaker:
        return Item(
            "Text inversions",
            "The sequential inversion (Nikolaou et al., ICLR 2026) recovers at least as many tokens as the learned "
            f"inversion at every audited σ, within sampling error (token accuracy, sequential against learned: "
            f"{_accuracies(compared)}).",
        )
    reasons = dict.fromkeys(r for _, c in weaker for r in c.get("reasons") or [])
    return Item(
        "Text inversions",
        f"The sequential inversion (Nikolaou et al., ICLR 2026) recovers fewer tokens than the learned inversion "
        f"at {_accuracies(weaker)} (token accuracy, sequential against learned, beyond sampling error), so there "
        f"the learned inversion is the measure of what an attacker recovers. Why: {'; '.join(reasons)}.",
        "warn",
    )


def _accuracies(compared: list[tuple[dict, dict]]) -> str:
    return "; ".join(
        f"σ = {number(p.get('noise_sigma'))}: {number(c.get('sequential'))} against {number(c.get('learned'))}"
        for p, c in compared
    )


def _inversion_note(comparison: dict) -> str:
    """A point's comparison of the two text inversions, in one sentence."""
    words = (
        f"Sequential inversion token accuracy {number(comparison.get('sequential'))} against the learned "
        f"inversion's {number(comparison.get('learned'))} (difference within ±{number(comparison.get('margin'))} is "
        "sampling error)"
    )
    if comparison.get("weaker"):
        return f"{words}: the sequential search is weaker here, because {'; '.join(comparison.get('reasons') or [])}."
    return f"{words}: the sequential search is at least as strong."


def _alerts(sweep: dict) -> list[str]:
    alerts = []
    beaten = [p for p in _points(sweep) if (p.get("bounds") or {}).get("violated_by")]
    if beaten:
        where = "; ".join(f"σ = {number(p.get('noise_sigma'))} by {text(p['bounds']['violated_by'])}" for p in beaten)
        causes = (beaten[0].get("bounds") or {}).get("violation_causes") or []
        alerts.append(
            f"The {GATED_BOUND.name} bound is beaten ({where}), so it is no guarantee at those σ"
            + (f" ({'; '.join(causes)})." if causes else ".")
        )
    for point in _points(sweep):
        failed = [n for n, a in (point.get("attacks") or {}).items() if a.get("status") == "failed"]
        if failed:
            alerts.append(f"INCOMPLETE AUDIT at σ = {number(point.get('noise_sigma'))}: {text(failed)} failed.")
    if (sweep.get("run") or {}).get("quick"):
        alerts.append(QUICK_ALERT)
    return alerts


def _best_reconstruction(point: dict) -> tuple[str, float] | None:
    measured = {
        n: a["metrics"]["mse"]
        for n, a in (point.get("attacks") or {}).items()
        if a.get("status") == "ok"
        and a.get("kind") == "reconstruction"
        and is_finite((a.get("metrics") or {}).get("mse"))
    }
    if not measured:
        return None
    name = min(measured, key=measured.get)
    return name, measured[name]


def _frontier(sweep: dict) -> Table:
    """One row per audited sigma: bounds, the best reconstruction, utility."""
    rec_index = section(sweep, "recommendation").get("point_index")
    rows, classes = [], []
    for i, point in enumerate(_points(sweep)):
        bounds, utility = point.get("bounds") or {}, point.get("utility") or {}
        best = _best_reconstruction(point)
        violated = bounds.get("violated_by") or []
        rows.append(
            [
                number(point.get("noise_sigma")) + (" ★" if i == rec_index else ""),
                ORIGIN_WORDS.get(point.get("origin"), str(point.get("origin") or "")),
                *(number(bounds.get(key)) for key in BOUNDS),
                f"{number(best[1])} ({best[0]})" if best else "—",
                "BEATEN by " + text(violated) if violated else ("holds" if best else "not checked"),
                mean_std(utility.get("accuracy"), utility.get("accuracy_std")),
                number(utility.get("loss")),
            ]
        )
        classes.append("failed" if violated else ("ok" if i == rec_index else ""))
    return Table(
        [
            "σ",
            "origin",
            *(f"{b.name} MSE" for b in BOUNDS.values()),
            "best attack MSE",
            "bound",
            "utility",
            "utility loss",
        ],
        rows,
        classes,
    )


def _mse_series(sweep: dict) -> tuple:
    points = _points(sweep)
    sigmas = [p.get("noise_sigma") for p in points]
    bounds = [
        (charts.SweepSeries(bound.label, [(p.get("bounds") or {}).get(key) for p in points]), bound.chart_color)
        for key, bound in BOUNDS.items()
    ]
    attacks = []
    for name in _attack_names(points, "reconstruction"):
        entries = [(p.get("attacks") or {}).get(name) or {} for p in points]
        attacks.append(
            charts.SweepSeries(
                name,
                [(e.get("metrics") or {}).get("mse") if e.get("status") == "ok" else None for e in entries],
                [(e.get("metrics_std") or {}).get("mse") for e in entries],
            )
        )
    guesses = [(p.get("bounds") or {}).get("mean_guess_mse") for p in points]
    mean_guess = next((g for g in guesses if is_finite(g)), None)
    return sigmas, bounds, attacks, mean_guess, sweep.get("target_mse")


def _attack_names(points: list[dict], kind: str) -> list[str]:
    return list(
        dict.fromkeys(
            n
            for p in points
            for n, a in (p.get("attacks") or {}).items()
            if a.get("kind") == kind and a.get("status") == "ok"
        )
    )


def _utility_series(points: list[dict]) -> tuple[list[charts.SweepSeries], charts.SweepSeries | None]:
    advantages = []
    for name in _attack_names(points, "label"):
        entries = [(p.get("attacks") or {}).get(name) or {} for p in points]
        advantages.append(
            charts.SweepSeries(
                name,
                [e.get("advantage") if e.get("status") == "ok" else None for e in entries],
                [e.get("advantage_std") for e in entries],
            )
        )
    utilities = [p.get("utility") or {} for p in points]
    if not any(u.get("status") == "ok" for u in utilities):
        return advantages, None
    label = f"utility ({utilities[0].get('source')} accuracy)"
    return advantages, charts.SweepSeries(
        label, [u.get("accuracy") for u in utilities], [u.get("accuracy_std") for u in utilities]
    )


def _point_view(point: dict, recommended: bool) -> PointView:
    bounds = point.get("bounds") or {}
    dfil = point.get("dfil") or {}
    rows = [
        *(
            [f"{b.name} bound MSE ({b.audience})", mean_std(bounds.get(key), bounds.get(b.stderr_key))]
            if b.stderr_key
            else [f"{b.name} bound MSE ({b.audience})", number(bounds.get(key))]
            for key, b in BOUNDS.items()
        ),
        ["mean dFIL", mean_std(dfil.get("mean"), dfil.get("stderr"))],
        ["guessing the average input", number(bounds.get("mean_guess_mse"))],
        ["bound beaten by", text(bounds.get("violated_by") or None)],
    ]
    attacks = {n: a for n, a in (point.get("attacks") or {}).items() if isinstance(a, dict)}
    sigma = number(point.get("noise_sigma"))
    return PointView(
        sigma=sigma,
        anchor="sigma-" + "".join(c if c.isalnum() else "-" for c in sigma),
        recommended=recommended,
        bounds=Table(["", ""], rows),
        attacks=overview_table(attacks),
        utility=utility_words(point.get("utility") or {}),
        notes=[str(n) for n in bounds.get("notes") or []]
        + ([_inversion_note(point["inversions"])] if isinstance(point.get("inversions"), dict) else []),
    )


def write_sweep_reports(sweep: dict, out_dir: Path, formats: list[str]) -> list[Path]:
    """sweep.json / .html / .md / .junit.xml (as asked) in out_dir; returns the paths written."""
    return write_document_reports(sweep, out_dir, formats, "sweep", sweep_json_schema(), build_sweep_view)


def write_document_reports(
    document: dict, out_dir: Path, formats: list[str], stem: str, schema: dict, build: Callable
) -> list[Path]:
    """STEM.json / .html / .md / .junit.xml (as asked) of a sweep-like document (sweep.json, cuts.json)
    in out_dir, its pages from build(document); returns the paths written."""
    return write_document(Document(stem, document, lambda: build(document), schema), out_dir, formats)


def sweep_summary(sweep: dict) -> str:
    """The verdict, the recommendation and the frontier table, for the terminal."""
    view = build_sweep_view(sweep, with_figures=False)
    return document_summary(sweep, view, view.summary, view.frontier)


def document_summary(document: dict, view, items: list[Item], table: Table) -> str:
    """A sweep-like document's verdict, alerts, summary items and table, for the terminal."""
    lines = [view.headline] + [_wrap("! " + a) for a in view.alerts]
    lines += [_wrap(f"{item.label}: {item.text}") for item in items]
    lines.append(tabulate(table.rows, headers=table.headers, disable_numparse=True))
    gate = document.get("gate") or {}
    if not gate.get("passed", True):
        lines.append(_wrap("gate: " + "; ".join(str(r) for r in gate.get("reasons") or [])))
    return "\n".join(lines)
