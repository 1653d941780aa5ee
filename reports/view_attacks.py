"""Each attack as a report shows it: the overview table of all attacks, one section per attack
(metrics against the baseline, advantage, seeds, series over a parameter, reconstructions and
examples), and the table of attacks that did not run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from splitaudit.core.result import default_baseline_name
from splitaudit.reports import charts
from splitaudit.reports.formatting import advantage_words, is_finite, mean_std, number, signed
from splitaudit.reports.tokens import position_words, sentence_rows
from splitaudit.reports.view_elements import (
    METRIC_LABELS,
    OUTCOME_WORDS,
    Figure,
    Figures,
    Table,
    attack_entries,
    facts_table,
    outcome,
    ran_ok,
    section,
)


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
    outcome: str = ""  # view_elements.outcome: leakage, no-advantage, inconclusive (ok attacks only)
    outcome_words: str = ""


def overview_table(attacks: dict[str, dict]) -> Table | None:
    """One row per attack: its outcome, its result against its baseline, and the advantage (an attack
    that did not learn has none to show: it measured nothing)."""
    if not attacks:
        return None
    rows, classes = [], []
    for name, attack in attacks.items():
        state = outcome(attack)
        if state == "inconclusive":
            rows.append(
                [name, OUTCOME_WORDS[state], _result_cell(attack), _result_cell(attack, "baseline"), "did not learn"]
            )
        elif ran_ok(attack):
            at = f" at {attack['advantage_at']}" if attack.get("advantage_at") else ""
            cells = [_result_cell(attack), _result_cell(attack, "baseline"), signed(attack.get("advantage")) + at]
            rows.append([name, OUTCOME_WORDS[state], *cells])
        else:
            rows.append([name, state.upper(), attack.get("reason") or "no reason given", "", ""])
        classes.append(state)
    return Table(["attack", "outcome", "result", "baseline", "advantage"], rows, classes)


def _result_cell(attack: dict, source: str = "metrics") -> str:
    metric = attack.get("primary_metric", "")
    value = (attack.get(source) or {}).get(metric)
    std = (attack.get(source + "_std") or {}).get(metric)
    return f"{METRIC_LABELS.get(metric, metric)} {mean_std(value, std)}"


def not_run_table(attacks: dict[str, dict]) -> Table | None:
    rows = [
        [name, str(a.get("status", "unknown")).upper(), str(a.get("reason") or "no reason given")]
        for name, a in attacks.items()
        if not ran_ok(a)
    ]
    return Table(["attack", "status", "reason"], rows, [r[1].lower() for r in rows]) if rows else None


def outcome_sentence(attack: dict, state: str) -> str:
    """What the outcome means, as the papers read it (DESIGN.md section 13)."""
    if state == "inconclusive":
        return (
            f"INCONCLUSIVE: the attack did not learn ({attack.get('failed_to_train') or 'no reason given'}). "
            "It measured nothing: this is neither evidence of leakage nor of privacy."
        )
    if state == "no-advantage" and attack.get("baseline_role") == "raw-input":
        return (
            f"No advantage: the attack did no better than {attack.get('baseline_name') or 'its raw-input baseline'}, "
            "which uses no information from the model: no leakage beyond the raw-input baseline, perfect "
            "protection against this attack in the sense of Zheng et al. (IJCAI 2024)."
        )
    if state == "no-advantage":
        return "No advantage: the attack did no better than it does without the model's embeddings."
    return "Leakage found: the attack does better with the model's embeddings than without them."


def attack_view(name: str, attack: dict, result: dict, figures: Figures) -> AttackView:
    view = AttackView(
        name=name,
        title=attack_title(name, attack),
        kind=str(attack.get("kind", "")),
        status=str(attack.get("status", "unknown")),
        reason=str(attack.get("reason") or ""),
        assumptions=str(attack.get("assumptions") or ""),
    )
    if not ran_ok(attack):
        return view
    view.metrics = _metrics_table(name, attack)
    basis = f" Taken as {attack['advantage_basis']}." if attack.get("advantage_basis") else ""
    view.advantage = (
        f"Advantage {mean_std(attack.get('advantage'), attack.get('advantage_std'))}: "
        f"{advantage_words(view.kind, attack.get('advantage'))}.{basis}"
    )
    view.outcome = outcome(attack)
    view.outcome_words = OUTCOME_WORDS[view.outcome]
    view.advantage = outcome_sentence(attack, view.outcome) + " " + view.advantage
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
            f"{name}-reconstructions",
            f"{name}: originals and reconstructions",
            charts.reconstructions_chart,
            examples,
            str(section(result, "data").get("input_kind", "")),
        )
        view.examples = Table(
            ["example", "target index", "MSE"],
            [[str(e.get("label", "")), number(e.get("index")), number(e.get("mse"))] for e in examples],
        )
    if sentence_rows(attack):
        view.examples = Table(["original sentence", "reconstruction"], sentence_rows(attack))
    view.details = facts_table({k: v for k, v in (attack.get("details") or {}).items() if k != "tokens"}, {})
    view.comparison = " ".join(filter(None, [_query_access_note(name, attack, result), position_words(attack)]))
    view.beats_bound = name in (section(result, "bounds").get("violated_by") or [])
    return view


def _query_access_note(name: str, attack: dict, result: dict) -> str:
    """For an attack without query access, what the query-access attack on the same data gets."""
    reference = attack.get("query_access_reference")
    other = attack_entries(result).get(reference) if reference else None
    if not (other and ran_ok(other)):
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
