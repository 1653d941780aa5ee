"""Two audits side by side (e.g. before and after a defence): bounds, each attack, deltas."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from splitaudit.core.errors import InputError
from splitaudit.core.registries import BOUNDS, result_kind
from splitaudit.core.safety import display_path
from splitaudit.reports import charts
from splitaudit.reports.documents import Document, write_document
from splitaudit.reports.formatting import is_finite, is_number, number, signed
from splitaudit.reports.view import subtitle
from splitaudit.reports.view_attacks import attack_title
from splitaudit.reports.view_elements import METRIC_LABELS, Figure, Figures, Table, outcome
from splitaudit.reports.view_verdict import headline
from splitaudit.reports.writer import load_result
from splitaudit.verdicts.regression import Z, baseline_summary, compare_to_baseline

# What makes two audits comparable: the same model (file and shapes) and the same data. A defence
# usually changes the model file, so a difference is stated, never refused.
MODEL_FACTS = (("path", "model file"), ("input_shape", "input shape"), ("output_shape", "embedding shape"))
DATA_FACTS = (
    ("aux_path", "aux data"),
    ("target_path", "target data"),
    ("n_aux", "aux samples"),
    ("n_target", "target samples"),
    ("classes", "classes"),
)


@dataclass
class ComparisonView:
    title: str
    warnings: list[str]
    audits: Table
    bounds: Table | None
    attacks: Table | None
    chart: Figure | None
    figures: list[Figure]
    regression: Table | None = None
    regression_verdict: str = ""


def _get(result: dict, *keys):
    for key in keys:
        result = result.get(key) if isinstance(result, dict) else None
    return result


def _verdict(before, after, higher_is_safer: bool) -> str:
    """Whether the change favours the defender."""
    if not (is_number(before) and is_number(after)) or math.isnan(before) or math.isnan(after):
        return ""
    if before == after:
        return "same"
    return "better" if (after > before) == higher_is_safer else "worse"


def _delta_row(label: str, before, after, higher_is_safer: bool) -> list[str]:
    delta = after - before if is_finite(before) and is_finite(after) else None
    return [label, number(before), number(after), signed(delta), _verdict(before, after, higher_is_safer)]


def _bounds(before: dict, after: dict) -> Table | None:
    rows = [
        _delta_row(label, _get(before, *keys), _get(after, *keys), safer)
        for label, keys, safer in (
            *((f"{bound.name} bound MSE", ("bounds", key), True) for key, bound in BOUNDS.items()),
            ("mean dFIL", ("dfil", "mean"), False),
            ("noise σ", ("noise_sigma",), True),
        )
        if _get(before, *keys) is not None or _get(after, *keys) is not None
    ]
    return Table(["", "before", "after", "change", "for privacy"], rows) if rows else None


def _attack_rows(before: dict, after: dict) -> tuple[list[list[str]], list[str]]:
    rows, classes = [], []
    names = list(dict.fromkeys([*(_get(before, "attacks") or {}), *(_get(after, "attacks") or {})]))
    for name in names:
        a, b = _get(before, "attacks", name) or {}, _get(after, "attacks", name) or {}
        metric = a.get("primary_metric") or b.get("primary_metric") or ""
        if a.get("status") != "ok" or b.get("status") != "ok":
            status = f"before {a.get('status', 'absent')}, after {b.get('status', 'absent')}"
            rows.append([name, status, "", "", "", "", "", ""])
            classes.append("failed" if "failed" in status else "skipped")
            continue
        mb, ma = _get(a, "metrics", metric), _get(b, "metrics", metric)
        adv_b, adv_a = a.get("advantage"), b.get("advantage")
        delta = ma - mb if is_finite(ma) and is_finite(mb) else None
        rows.append(
            [
                name,
                METRIC_LABELS.get(metric, metric),
                number(mb),
                number(ma),
                signed(delta),
                number(adv_b),
                number(adv_a),
                _attack_verdict(a, b),
            ]
        )
        classes.append("inconclusive" if "inconclusive" in (outcome(a), outcome(b)) else "")
    return rows, classes


def _attack_verdict(before: dict, after: dict) -> str:
    """Whether the attack's advantage moved for privacy; unreadable where one run did not learn."""
    unlearned = [when for when, a in (("before", before), ("after", after)) if outcome(a) == "inconclusive"]
    if unlearned:
        return f"not comparable: it did not learn {' and '.join(unlearned)}"
    return _verdict(before.get("advantage"), after.get("advantage"), higher_is_safer=False)


def check_comparable(before: dict, after: dict, sources: tuple[str, str]) -> None:
    """Only two report.json files compare (a sweep or a cuts audit has no single bound or attack table)."""
    for document, source in zip((before, after), sources):
        kind = result_kind(document)
        if kind.side_by_side:
            raise InputError(
                f"{source} is a {kind.name}.json; compare takes two report.json files of splitaudit run "
                f"({kind.side_by_side})"
            )


def differences(before: dict, after: dict) -> list[str]:
    """What differs between the two audits' models and data, one sentence each: the rows compare
    numbers of different things where these differ."""
    found = []
    for section, facts in (("model", MODEL_FACTS), ("data", DATA_FACTS)):
        for key, label in facts:
            old, new = _get(before, section, key), _get(after, section, key)
            if old != new:
                shown = [str(v) if isinstance(v, list) else number(v) for v in (old, new)]
                found.append(f"the audits differ in {label}: {shown[0]} before, {shown[1]} after")
    return found


def regression(before: dict, after: dict) -> tuple[Table, str, list[str]]:
    """The regression gate's test of `after` against `before` as `run --baseline` decides it
    (splitaudit.verdicts.regression): its table, its verdict in one line, and the inputs that differ."""
    comparison = compare_to_baseline(baseline_summary(before, "before"), after)
    rows, classes = [], []
    bound = comparison["bound"]
    named = [("bound", f"{bound['name']} bound MSE", bound)] + [
        (r["name"], "advantage", r) for r in comparison["attacks"]
    ]
    for name, quantity, row in named:
        if not row["comparable"]:
            rows.append([name, quantity, "", "", "", "", f"not comparable: {row['reason']}"])
            classes.append("skipped")
            continue
        verdict = "REGRESSED" if row["regressed"] else "within noise"
        cells = [number(row[k]) for k in ("baseline", "current", "worse_by", "allowed")]
        rows.append([name, quantity, *cells, verdict])
        classes.append("failed" if row["regressed"] else "")
    regressed = [r[0] for r, c in zip(rows, classes) if c == "failed"]
    verdict = (
        f"REGRESSION beyond noise: {', '.join(regressed)} (the test of run --baseline)"
        if regressed
        else "no regression beyond noise (the test of run --baseline)"
    )
    headers = ["", "quantity", "before", "after", "worse by", f"allowed ({Z} x combined stderr)", "verdict"]
    return Table(headers, rows, classes), verdict, comparison["input_differences"]


def read_baseline(path: str) -> dict:
    """run --baseline: an earlier report.json, read as render reads it (schema and consistency checked),
    and the numbers of it the regression test reads (splitaudit.verdicts.regression.baseline_summary)."""
    document = load_result(Path(path))
    if document.get("kind") is not None:
        raise InputError(
            f"--baseline {display_path(path)} is a {document['kind']}.json; a baseline is a report.json of splitaudit run"
        )
    return baseline_summary(document, display_path(path))


def build_comparison(before: dict, after: dict, with_figures: bool = True) -> ComparisonView:
    figures = Figures(with_figures)
    regression_rows, regression_verdict, input_differences = regression(before, after)
    rows, classes = _attack_rows(before, after)
    audits = Table(
        ["", "before", "after"],
        [
            ["audit", subtitle(before), subtitle(after)],
            ["verdict", headline(before), headline(after)],
            ["model file", number(_get(before, "model", "path")), number(_get(after, "model", "path"))],
        ],
    )
    ok = [r for r in rows if r[5]]
    chart = (
        figures.add(
            "advantage",
            "Each attack's advantage before and after",
            charts.advantage_comparison_chart,
            [attack_title(r[0], _get(after, "attacks", r[0]) or _get(before, "attacks", r[0]) or {}) for r in ok],
            [_get(before, "attacks", r[0], "advantage") for r in ok],
            [_get(after, "attacks", r[0], "advantage") for r in ok],
        )
        if ok
        else None
    )
    return ComparisonView(
        title="splitaudit comparison",
        warnings=differences(before, after) + input_differences,
        audits=audits,
        bounds=_bounds(before, after),
        attacks=Table(
            ["attack", "metric", "before", "after", "change", "advantage before", "advantage after", "for privacy"],
            rows,
            classes,
        )
        if rows
        else None,
        chart=chart,
        figures=figures.made,
        regression=regression_rows,
        regression_verdict=regression_verdict,
    )


def write_comparison(before: dict, after: dict, out_dir: Path, formats: list[str]) -> list[Path]:
    """comparison.html / comparison.md (and comparison.json with the tables) in out_dir."""
    document = Document(
        "comparison", {"before": before, "after": after}, lambda: build_comparison(before, after), None, comparison_json
    )
    return write_document(document, out_dir, formats)


def comparison_json(view) -> dict:
    """The comparison's tables and warnings, as comparison.json holds them."""
    tables = {"audits": view.audits, "bounds": view.bounds, "attacks": view.attacks}
    content = {k: {"headers": t.headers, "rows": t.rows} for k, t in tables.items() if t}
    return {**content, "warnings": view.warnings}
