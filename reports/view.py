"""The view-model: everything a report shows, read from the result object once.

HTML, Markdown and the terminal summary all render this view, so each number is formatted
in one place. Figures carry PNG bytes; each writer decides how to reference them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from splitaudit.registries import BOUNDS, GATED_BOUND
from splitaudit.reports import charts
from splitaudit.reports.formatting import (
    advantage_words,
    is_finite,
    is_number,
    mean_std,
    number,
    shape,
    signed,
    text,
)
from splitaudit.reports.tokens import position_words, sentence_rows, token_statement_words
from splitaudit.result import default_baseline_name

METRIC_LABELS = {
    "accuracy": "accuracy",
    "nmi": "NMI",
    "ari": "ARI",
    "auc": "AUC",
    "mse": "MSE",
    "psnr": "PSNR (dB)",
    "ssim": "SSIM",
}
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
SHAPE_KEYS = {"input_shape", "output_shape", "sample_shape"}
MAX_LIST_FACT = 16  # longer lists (per-sample values, indices) are charts or tables, not facts
NOT_FACTS = {"per_sample", "notes", "leakiest", "warnings"}


@dataclass
class Figure:
    """A chart or image grid; `src` is filled in by the writer (data URI or file name)."""

    name: str
    alt: str
    png: bytes
    src: str = ""


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    row_classes: list[str] = field(default_factory=list)  # status per row, for colouring


@dataclass
class Item:
    """One line of the executive summary; tone is good, bad, warn or info."""

    label: str
    text: str
    tone: str = "info"


@dataclass
class AttackView:
    name: str
    title: str
    kind: str
    status: str
    reason: str
    assumptions: str
    metrics: Table | None = None
    advantage: str = ""
    runs: str = ""
    series: Table | None = None  # a dict-valued metric against its parameter (fine-tune's accuracy by k)
    series_chart: Figure | None = None
    series_title: str = ""
    reconstructions: Figure | None = None
    examples: Table | None = None
    details: Table | None = None
    beats_bound: bool = False
    comparison: str = ""
    untrained: bool = False  # ran, but FAILED to train (Attack.training_failure)


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


def build_view(result: dict, with_figures: bool = True) -> ReportView:
    """The whole report's content; with_figures=False skips matplotlib (terminal summary)."""
    figures = Figures(with_figures)
    attacks = _attacks(result)
    bounds = _bounds(result, figures)
    model = _section(result, "model")
    return ReportView(
        title="splitaudit leakage report",
        subtitle=subtitle(result),
        passed=bool(_gate(result).get("passed", False)),
        verdict_class=verdict_class(result),
        headline=headline(result),
        reasons=[str(r) for r in _gate(result).get("reasons") or []],
        alerts=_alerts(result, attacks),
        summary=_summary(result, attacks),
        overview=_overview(attacks),
        gate=_gate_table(result),
        bounds=None if bounds.is_empty() else bounds,
        attacks=[_attack_view(name, a, result, figures) for name, a in attacks.items()],
        model=_facts(model, MODEL_LABELS),
        warnings=[str(w) for w in model.get("warnings") or []],
        data=_facts(_section(result, "data"), DATA_LABELS),
        run=_facts(
            {**_section(result, "run"), "version": _section(result, "tool").get("version")},
            {**RUN_LABELS, "version": "splitaudit version"},
        ),
        not_run=_not_run(attacks),
        figures=figures.made,
    )


class Figures:
    """Makes figures only when asked to, and remembers them for the writer."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.made: list[Figure] = []

    def add(self, name: str, alt: str, draw, *args) -> Figure | None:
        if not self.enabled:
            return None
        figure = Figure(name=name, alt=alt, png=draw(*args))
        self.made.append(figure)
        return figure


def _section(result: dict, key: str) -> dict:
    value = result.get(key)
    return value if isinstance(value, dict) else {}


def _gate(result: dict) -> dict:
    return _section(result, "gate")


def _attacks(result: dict) -> dict[str, dict]:
    return {name: a for name, a in _section(result, "attacks").items() if isinstance(a, dict)}


def _ok(attack: dict) -> bool:
    return attack.get("status") == "ok"


def _trained(attack: dict) -> bool:
    """An ok attack that did not FAIL to train (Attack.training_failure): only its numbers measure leakage."""
    return _ok(attack) and not attack.get("failed_to_train")


QUICK_ALERT = (
    "QUICK RUN: fewer seeds, epochs and iterations, so the attacks are under-trained and each "
    "measures only a lower bound on the leakage; a model that looks private here may leak under full settings."
)


def subtitle(result: dict) -> str:
    model = _section(result, "model")
    name = PurePath(str(model.get("path"))).name if model.get("path") else "unknown model"
    run = _section(result, "run")
    parts = [name, f"noise σ = {number(result.get('noise_sigma'))}"]
    if run.get("started"):
        parts.append(str(run["started"]))
    return " · ".join(parts)


CAUSE_WORDS = {
    "incomplete": "the audit is incomplete",
    "attack-failed-to-train": "an attack FAILED to train (its result is not evidence of privacy)",
    "bound-too-low": "the provable bound is too low",
    "bound-untrusted": "the provable bound cannot be trusted",
    "bound-approximate": "the provable bound rests on an approximate dFIL",
    "prior-untrusted": "the provable bound rests on a failed prior estimate",
    "bound-missing": "no provable bound was computed",
    "attack-mse-too-low": "an attack reconstructs too well",
    "no-reconstruction-attack": "no reconstruction attack ran",
    "advantage-too-high": "an attack's advantage is above the cap",
    "utility-loss-too-high": "the recommended noise costs too much accuracy",
    "utility-loss-missing": "the utility loss was not measured",
    "no-recommendation": "no noise sigma can be recommended",
}


def _failure_kind(check: dict) -> str:
    """A failed check's cause, as the gate recorded it, in a few words."""
    return CAUSE_WORDS.get(check["cause"], str(check.get("message", "")))


def _failed_checks(result: dict) -> list[dict]:
    return [c for c in _gate(result).get("checks") or [] if isinstance(c, dict) and not c.get("passed")]


THRESHOLD_KEYS = ("fail_under_mse", "fail_under_attack_mse", "max_advantage", "max_utility_loss")


def thresholds_set(result: dict) -> bool:
    """Whether any pass/fail threshold was asked for (otherwise "passed" only means "complete")."""
    return any(is_number(_gate(result).get(key)) for key in THRESHOLD_KEYS)


def verdict_class(result: dict) -> str:
    """pass / fail, or neutral for a complete audit that had no thresholds to meet."""
    if not _gate(result).get("passed"):
        return "fail"
    return "pass" if thresholds_set(result) else "neutral"


def headline(result: dict) -> str:
    """The verdict in one line; a quick run says so (its attacks only bound the leakage from below)."""
    words = _verdict_headline(result)
    return words + " [QUICK RUN: lower bounds on leakage]" if _section(result, "run").get("quick") else words


def _verdict_headline(result: dict) -> str:
    gate = _gate(result)
    if not gate:
        return "NO VERDICT: the result has no gate section"
    if gate.get("passed"):
        if not thresholds_set(result):
            return "AUDIT COMPLETE: no pass/fail thresholds were set; read the findings below"
        return "PASSED: every gate check passed"
    kinds = [_failure_kind(c) for c in _failed_checks(result)]
    return "FAILED: " + ("; ".join(dict.fromkeys(kinds)) or "the gate did not pass")


def _verdict_text(result: dict) -> str:
    """Failed: the gate's reasons. Passed: which thresholds were met."""
    gate = _gate(result)
    reasons = [str(r) for r in gate.get("reasons") or []]
    if not gate.get("passed"):
        return "Failed: " + ("; ".join(reasons) if reasons else "no reason given") + "."
    met = [
        f"{label} {number(gate[key])}"
        for key, label in (
            ("fail_under_mse", "provable bound MSE ≥"),
            ("fail_under_attack_mse", "best attack MSE ≥"),
            ("max_advantage", "every attack's advantage ≤"),
        )
        if is_number(gate.get(key))
    ]
    if not met:
        return "The audit is complete. No CI thresholds were set (see --fail-under-mse, --max-advantage)."
    return "The audit is complete and meets every threshold: " + "; ".join(met) + "."


def _alerts(result: dict, attacks: dict[str, dict]) -> list[str]:
    """Problems a reader must not miss: failed attacks, an untrustworthy bound, a quick run."""
    alerts = [
        f"INCOMPLETE AUDIT: the {name} attack failed ({a.get('reason') or 'no reason given'}); "
        "its leakage is not measured in this report."
        for name, a in attacks.items()
        if a.get("status") == "failed"
    ]
    violated = _section(result, "bounds").get("violated_by") or []
    if violated:
        causes = _section(result, "bounds").get("violation_causes") or []
        alerts.append(
            f"The provable bound is not trustworthy: {text(violated)} reconstructed inputs better than "
            "it allows, so its assumptions do not hold here" + (f" ({'; '.join(causes)})." if causes else ".")
        )
    alerts += [
        f"ATTACK FAILED: {name} failed to train ({a['failed_to_train']}). Its result measures no leakage "
        "and is not evidence of privacy."
        for name, a in attacks.items()
        if _ok(a) and a.get("failed_to_train")
    ]
    alerts += [f"{name}: {a['spread_warning']}." for name, a in attacks.items() if _ok(a) and a.get("spread_warning")]
    if _section(result, "run").get("quick"):
        alerts.append(QUICK_ALERT)
    return alerts


def _summary(result: dict, attacks: dict[str, dict]) -> list[Item]:
    tone = {"pass": "good", "fail": "bad"}.get(verdict_class(result), "info")
    items = [Item("Verdict", _verdict_text(result), tone)]
    items.append(_protection(result, attacks))
    items.append(_strongest(attacks))
    calibration = _section(result, "calibration")
    if calibration:
        items.append(_recommended_noise(calibration, result.get("noise_sigma")))
    if _section(result, "utility"):
        items.append(Item("Utility", utility_words(_section(result, "utility")), "info"))
    if _section(result, "tokens"):
        items.append(Item("In tokens", token_statement_words(_section(result, "tokens")), "info"))
    return items


def utility_words(utility: dict) -> str:
    """Task accuracy at the audited noise, its loss against sigma = 0, and how it was measured."""
    if utility.get("status") != "ok":
        return f"Not measured: {utility.get('reason') or 'no reason given'}."
    words = f"task accuracy {mean_std(utility.get('accuracy'), utility.get('accuracy_std'))}"
    if is_finite(utility.get("loss")) and utility.get("noise_sigma") != 0:
        words += f", {number(utility['loss'])} below the {number(utility.get('clean_accuracy'))} it has without noise"
    return (
        f"At σ = {number(utility.get('noise_sigma'))}: {words} ({utility.get('description') or utility.get('source')})."
    )


def _mean_guess_mse(attacks: dict[str, dict]) -> float | None:
    """The mean-guess MSE that every reconstruction attack reports as its baseline."""
    values = [
        a["baseline"]["mse"]
        for a in attacks.values()
        if _ok(a) and a.get("kind") == "reconstruction" and is_finite((a.get("baseline") or {}).get("mse"))
    ]
    return values[0] if values else None


def _protection(result: dict, attacks: dict[str, dict]) -> Item:
    """The provable bound in plain words (or plainly: nothing is guaranteed)."""
    bounds = _section(result, "bounds")
    bound = bounds.get(GATED_BOUND.key)
    sigma = result.get("noise_sigma")
    if not is_number(bound):
        return Item("Provable protection", f"Not computed: the result holds no {GATED_BOUND.name} bound.", "warn")
    if bound <= 0 or not math.isfinite(bound):
        cause = (
            "the embeddings are sent without noise (σ = 0), so the Fisher information is infinite"
            if sigma == 0
            else "the Fisher information is infinite"
        )
        return Item(
            "Provable protection",
            f"Nothing is guaranteed: {cause} and the provable bound is 0. "
            "An attacker may in principle recover the inputs exactly.",
            "bad",
        )
    smoothing = _section(result, "prior").get("smoothing")
    words = (
        f"No attacker can reconstruct inputs with a mean squared error below {number(bound)} "
        f"(per input dimension, on average over inputs like the audited data; {GATED_BOUND.name} bound"
    )
    words += (
        f", for inputs smoothed with noise τ = {number(smoothing)})."
        if is_finite(smoothing) and smoothing > 0
        else ")."
    )
    guess = _mean_guess_mse(attacks)
    if guess is not None:
        words += f" For scale: guessing the average input gives MSE {number(guess)}."
    violated = bounds.get("violated_by") or []
    if violated:
        return Item(
            "Provable protection", words + f" But {text(violated)} beat this bound, so it cannot be trusted.", "bad"
        )
    return Item("Provable protection", words, "info")


def _strongest(attacks: dict[str, dict]) -> Item:
    """The attack with the largest advantage among those that trained (a failed one proves nothing)."""
    ran = {n: a for n, a in attacks.items() if _trained(a) and is_finite(a.get("advantage"))}
    untrained = [n for n, a in attacks.items() if _ok(a) and a.get("failed_to_train")]
    if not ran:
        if untrained:
            return Item(
                "Strongest attack",
                f"No attack trained: {text(untrained)} FAILED to train, which is not evidence of privacy.",
                "bad",
            )
        return Item("Strongest attack", "No attack produced a result.", "warn" if attacks else "info")
    name = max(ran, key=lambda n: ran[n]["advantage"])
    attack = ran[name]
    metric = attack.get("primary_metric", "")
    value = (attack.get("metrics") or {}).get(metric)
    base = (attack.get("baseline") or {}).get(metric)
    words = (
        f"{attack_title(name, attack)}: {METRIC_LABELS.get(metric, metric)} {number(value)} "
        f"against {number(base)} for its baseline; "
        f"{advantage_words(attack.get('kind', ''), attack['advantage'])}."
    )
    return Item("Strongest attack", words, "bad" if attack["advantage"] > 0 else "good")


def _smoothing_condition(calibration: dict) -> str:
    smoothing = calibration.get("smoothing")
    return f", for inputs smoothed with noise τ = {number(smoothing)}" if is_finite(smoothing) and smoothing > 0 else ""


def _recommended_noise(calibration: dict, current: Any) -> Item:
    target = number(calibration.get("target_mse"))
    sigma = calibration.get("sigma")
    now = f" (currently σ = {number(current)})" if is_number(current) else ""
    if calibration.get("feasible") is False or not is_finite(sigma):
        reason = calibration.get("reason") or "the prior alone lets an attacker do better"
        return Item(
            "Recommended noise", f"No amount of embedding noise can guarantee MSE ≥ {target}: {reason}.", "warn"
        )
    words = (
        f"Gaussian noise with σ = {number(sigma)} on the embeddings guarantees MSE ≥ {target} "
        f"against any attacker{_smoothing_condition(calibration)}{now}."
    )
    if is_finite(calibration.get("sigma_unbiased")):
        words += f" Against unbiased attackers only, σ = {number(calibration['sigma_unbiased'])} would suffice."
    return Item("Recommended noise", words, "info")


def _result_cell(attack: dict, source: str = "metrics") -> str:
    metric = attack.get("primary_metric", "")
    value = (attack.get(source) or {}).get(metric)
    std = (attack.get(source + "_std") or {}).get(metric)
    return f"{METRIC_LABELS.get(metric, metric)} {mean_std(value, std)}"


def _overview(attacks: dict[str, dict]) -> Table | None:
    if not attacks:
        return None
    rows, classes = [], []
    for name, attack in attacks.items():
        status = str(attack.get("status", "unknown"))
        if _ok(attack) and attack.get("failed_to_train"):
            status = "failed"
            rows.append(
                [name, "FAILED TO TRAIN", _result_cell(attack), _result_cell(attack, "baseline"), "no evidence"]
            )
        elif _ok(attack):
            rows.append(
                [name, status, _result_cell(attack), _result_cell(attack, "baseline"), signed(attack.get("advantage"))]
            )
        else:
            rows.append([name, status.upper(), attack.get("reason") or "no reason given", "", ""])
        classes.append(status)
    return Table(["attack", "status", "result", "baseline", "advantage"], rows, classes)


def _gate_table(result: dict) -> Table | None:
    checks = [c for c in _gate(result).get("checks") or [] if isinstance(c, dict)]
    if not checks:
        return None
    rows = [
        [
            str(c.get("name", "")),
            "passed" if c.get("passed") else "FAILED",
            number(c.get("value")),
            number(c.get("threshold")),
            str(c.get("message", "")),
        ]
        for c in checks
    ]
    return Table(
        ["check", "result", "value", "threshold", "detail"],
        rows,
        ["ok" if c.get("passed") else "failed" for c in checks],
    )


def _facts(section: dict, labels: dict[str, str]) -> Table | None:
    """A two-column table: known keys in label order, then any other scalar keys as they are named."""
    keys = [k for k in labels if k in section] + [k for k in section if k not in labels]
    rows = []
    for key in keys:
        value = section[key]
        if key in NOT_FACTS or isinstance(value, dict) or value is None or value == "":
            continue
        if isinstance(value, list) and (not value or len(value) > MAX_LIST_FACT or isinstance(value[0], (dict, list))):
            continue
        rows.append([labels.get(key, key.replace("_", " ")), shape(value) if key in SHAPE_KEYS else text(value)])
    return Table(["", ""], rows) if rows else None


def _records(items: Any) -> Table | None:
    """A list of dicts (e.g. the leakiest samples) as a table with the union of their keys."""
    records = [i for i in items or [] if isinstance(i, dict)]
    if not records:
        return None
    keys = list(dict.fromkeys(k for r in records for k in r))
    return Table([k.replace("_", " ") for k in keys], [[number(r.get(k)) for k in keys] for r in records])


def _notes(*sections: dict) -> list[str]:
    notes = []
    for section in sections:
        value = section.get("notes")
        notes.extend([str(n) for n in value] if isinstance(value, list) else [str(value)] if value else [])
    return notes


def _bounds(result: dict, figures: Figures) -> BoundsView:
    bounds, dfil, prior = _section(result, "bounds"), _section(result, "dfil"), _section(result, "prior")
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
        dfil=_facts(dfil, DFIL_LABELS),
        dfil_chart=chart,
        dfil_note=note,
        leakiest=_records(dfil.get("leakiest")),
        prior=_facts(prior, PRIOR_LABELS),
        notes=_notes(dfil, prior, bounds),
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
    violated = set(_section(result, "bounds").get("violated_by") or [])
    bars = [
        charts.MseBar(
            name,
            a["metrics"]["mse"],
            (a.get("metrics_std") or {}).get("mse", 0.0) or 0.0,
            (a.get("baseline") or {}).get("mse"),
            name in violated,
        )
        for name, a in _attacks(result).items()
        if _ok(a) and a.get("kind") == "reconstruction" and is_finite((a.get("metrics") or {}).get("mse"))
    ]
    if not bars:
        return None
    bounds = _section(result, "bounds")
    return figures.add(
        "bounds",
        "Reconstruction attacks' MSE against the bounds",
        charts.bounds_chart,
        bars,
        [charts.BoundLine(bound.label, bounds.get(key), bound.chart_color) for key, bound in BOUNDS.items()],
    )


def _attack_view(name: str, attack: dict, result: dict, figures: Figures) -> AttackView:
    view = AttackView(
        name=name,
        title=attack_title(name, attack),
        kind=str(attack.get("kind", "")),
        status=str(attack.get("status", "unknown")),
        reason=str(attack.get("reason") or ""),
        assumptions=str(attack.get("assumptions") or ""),
    )
    if not _ok(attack):
        return view
    view.metrics = _metrics_table(name, attack)
    basis = f" Taken as {attack['advantage_basis']}." if attack.get("advantage_basis") else ""
    view.advantage = (
        f"Advantage {mean_std(attack.get('advantage'), attack.get('advantage_std'))}: "
        f"{advantage_words(view.kind, attack.get('advantage'))}.{basis}"
    )
    view.untrained = bool(attack.get("failed_to_train"))
    if view.untrained:
        view.advantage = (
            f"The attack FAILED to train ({attack['failed_to_train']}): this measures no leakage and is "
            f"not evidence of privacy. {view.advantage}"
        )
    if attack.get("spread_warning"):
        view.advantage += f" Note: {attack['spread_warning']}."
    seeds = attack.get("seeds") or []
    view.runs = {0: "", 1: "one seed, so no spread"}.get(len(seeds), f"mean ± std over {len(seeds)} seeds")
    if is_finite(attack.get("seconds")):
        view.runs += ("; " if view.runs else "") + f"took {attack['seconds']:.1f} s"
    view.series_title, view.series, view.series_chart = _series(name, attack, figures)
    examples = [e for e in attack.get("examples") or [] if isinstance(e, dict) and "original" in e]
    if examples:
        view.reconstructions = figures.add(
            f"{name}-reconstructions", f"{name}: originals and reconstructions", charts.reconstructions_chart, examples
        )
        view.examples = Table(
            ["example", "target index", "MSE"],
            [[str(e.get("label", "")), number(e.get("index")), number(e.get("mse"))] for e in examples],
        )
    if sentence_rows(attack):
        view.examples = Table(["original sentence", "reconstruction"], sentence_rows(attack))
    view.details = _facts({k: v for k, v in (attack.get("details") or {}).items() if k != "tokens"}, {})
    view.comparison = " ".join(filter(None, [_query_access_note(name, attack, result), position_words(attack)]))
    view.beats_bound = name in (_section(result, "bounds").get("violated_by") or [])
    return view


def _query_access_note(name: str, attack: dict, result: dict) -> str:
    """For an attack without query access, what the query-access attack on the same data gets."""
    reference = attack.get("query_access_reference")
    other = _attacks(result).get(reference) if reference else None
    if not (other and _ok(other)):
        return ""
    ours, theirs = (attack.get("metrics") or {}).get("mse"), (other.get("metrics") or {}).get("mse")
    if not (is_finite(ours) and is_finite(theirs) and theirs > 0):
        return ""
    return (
        f"What query access is worth: the {reference} attack, which can run the bottom model, "
        f"reaches MSE {number(theirs)}; this attack, which cannot, {number(ours)} "
        f"({ours / theirs:.2g}x the error)."
    )


def _metrics_table(name: str, attack: dict) -> Table | None:
    metrics, baseline = attack.get("metrics") or {}, attack.get("baseline") or {}
    metrics_std, baseline_std = attack.get("metrics_std") or {}, attack.get("baseline_std") or {}
    rows = [
        [
            METRIC_LABELS.get(k, k),
            mean_std(v, metrics_std.get(k)),
            mean_std(baseline.get(k), baseline_std.get(k)) if k in baseline else "—",
        ]
        for k, v in metrics.items()
        if not isinstance(v, dict)
    ]
    averaged, averaged_std = metrics.get("k_query"), metrics_std.get("k_query") or {}
    if isinstance(averaged, dict):  # --queries K: the same attack on the mean of K sends of each input
        queries = (attack.get("details") or {}).get("queries", "k")
        rows += [
            [f"{METRIC_LABELS.get(k, k)}, mean of {queries} queries", mean_std(v, averaged_std.get(k)), "—"]
            for k, v in averaged.items()
        ]
    return Table(["metric", "attack", f"baseline: {baseline_words(attack)}"], rows) if rows else None


def attack_title(name: str, attack: dict) -> str:
    """The report's heading for an attack: the title its entry carries (its name in older reports)."""
    return str(attack.get("title") or name)


def baseline_words(attack: dict) -> str:
    """What an attack's baseline is, in the words its entry carries (older reports: by its kind)."""
    return str(attack.get("baseline_name") or default_baseline_name(str(attack.get("kind", ""))))


def _series(name: str, attack: dict, figures: Figures) -> tuple[str, Table | None, Figure | None]:
    """(heading, table, chart) of the attack's dict-valued metric METRIC_by_KEY (fine-tune's
    accuracy by k), in the words its entry's `series` gives (older reports: the metric's name)."""
    metrics = attack.get("metrics") or {}
    metric = next((m for m, v in metrics.items() if "_by_" in m and isinstance(v, dict) and v), None)
    if metric is None:
        return "", None, None
    measured, key = metric.split("_by_", 1)
    words = {"title": f"{measured} against {key}", "key": key, "axis": key, "value": measured}
    words.update(((attack.get("series") or {}).get(metric)) or {})
    values = metrics[metric]
    keys = sorted(values, key=lambda k: float(k) if str(k).replace(".", "", 1).isdigit() else math.inf)
    std = (attack.get("metrics_std") or {}).get(metric) or {}
    base = (attack.get("baseline") or {}).get(metric) or {}
    base_std = (attack.get("baseline_std") or {}).get(metric) or {}
    table = Table(
        [words["key"], f"attack {measured}", f"baseline {measured}"],
        [[str(k), mean_std(values[k], std.get(k)), mean_std(base.get(k), base_std.get(k))] for k in keys],
    )
    if not all(str(k).replace(".", "", 1).isdigit() and is_finite(values[k]) for k in keys):
        return words["title"], table, None
    has_base = all(is_finite(base.get(k)) for k in keys)
    chart = figures.add(
        f"{name}-{metric.replace('_', '-')}",
        words["title"],
        charts.series_chart,
        keys,
        [values[k] for k in keys],
        [_num(std.get(k)) for k in keys],
        [base[k] for k in keys] if has_base else [],
        [_num(base_std.get(k)) for k in keys],
        "baseline: " + baseline_words(attack),
        words["axis"],
        words["value"],
    )
    return words["title"], table, chart


def _num(value: Any) -> float:
    return float(value) if is_finite(value) else 0.0


def _not_run(attacks: dict[str, dict]) -> Table | None:
    rows = [
        [name, str(a.get("status", "unknown")).upper(), str(a.get("reason") or "no reason given")]
        for name, a in attacks.items()
        if not _ok(a)
    ]
    return Table(["attack", "status", "reason"], rows, [r[1].lower() for r in rows]) if rows else None
