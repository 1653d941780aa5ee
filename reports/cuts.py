"""The cuts report (cuts.html, cuts.md, the terminal summary), read from cuts.json alone.

The recommended split point comes first, in words a designer can act on; then one row per audited
cut (what the client pays, the noise each cut needs, the bound at it and what the real top model
keeps of the task), a chart of those against depth, and a section per cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitaudit.core.registries import GATED_BOUND
from splitaudit.core.result import cuts_json_schema
from splitaudit.reports import charts
from splitaudit.reports.formatting import is_finite, mean_std, number, text
from splitaudit.reports.sweep import PointView, _point_view, document_summary, write_document_reports
from splitaudit.reports.view import DATA_LABELS, RUN_LABELS
from splitaudit.reports.view_elements import Figure, Figures, Item, Table, facts_table, section
from splitaudit.reports.view_provenance import ProvenanceView, provenance_view
from splitaudit.reports.view_verdict import QUICK_ALERT, gate_table, headline, verdict_class

SIGMA_WORDS = {"calibrated": "calibrated", "--noise-sigma": "given", "uncalibrated": "none reaches the target"}
MODEL_LABELS = {"path": "whole model", "input_name": "input", "output_name": "output", "params": "parameters"}


@dataclass
class CutsView:
    title: str
    subtitle: str
    verdict_class: str
    headline: str
    alerts: list[str]
    summary: list[Item]
    table: Table
    gate: Table | None
    chart: Figure | None
    cuts: list[PointView]
    model: Table | None
    data: Table | None
    run: Table | None
    figures: list[Figure]
    provenance: ProvenanceView | None = None


def _cuts(document: dict) -> list[dict]:
    return [c for c in document.get("cuts") or [] if isinstance(c, dict)]


def build_cuts_view(document: dict, with_figures: bool = True) -> CutsView:
    """Everything the cuts pages show; with_figures=False skips matplotlib (terminal summary)."""
    figures = Figures(with_figures)
    cuts = _cuts(document)
    chart = (
        figures.add("cuts", "Noise, bound, accuracy and client cost against the cut's depth", cuts_chart, document)
        if cuts
        else None
    )
    rec_index = section(document, "recommendation").get("cut_index")
    model = dict(document.get("model") or {})
    model["flops"] = _count(model.get("flops"))
    return CutsView(
        title="splitaudit: where to split",
        subtitle=_subtitle(document),
        verdict_class=verdict_class(document),
        headline=headline(document),
        alerts=_alerts(document),
        summary=_summary(document),
        table=_table(document),
        gate=gate_table(document),
        chart=chart,
        cuts=[_cut_view(c, i == rec_index) for i, c in enumerate(cuts)],
        model=facts_table(model, {**MODEL_LABELS, "flops": "FLOPs per sample"}),
        data=facts_table(document.get("data") or {}, DATA_LABELS),
        run=facts_table(
            {**(document.get("run") or {}), "version": (document.get("tool") or {}).get("version")},
            {
                **RUN_LABELS,
                "executor": "executor",
                "workers": "cuts audited side by side",
                "version": "splitaudit version",
            },
        ),
        figures=figures.made,
        provenance=provenance_view(document),
    )


def _subtitle(document: dict) -> str:
    model = document.get("model") or {}
    parts = [Path(str(model.get("path") or "unknown model")).name, f"{len(_cuts(document))} cuts"]
    started = (document.get("run") or {}).get("started")
    return " · ".join(parts + ([str(started)] if started else []))


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else number(value)


def recommendation_words(document: dict) -> Item:
    """The recommended cut as one sentence, or plainly that none qualifies and what would."""
    rec = section(document, "recommendation")
    if rec.get("cut_index") is None:
        return Item("Recommendation", f"No cut can be recommended: {rec.get('reason') or 'no reason given'}.", "bad")
    return Item("Recommendation", f"Split at {rec.get('cut')}: {rec.get('reason')}.", "good")


def _summary(document: dict) -> list[Item]:
    whole = document.get("whole_accuracy") or {}
    sigma = document.get("noise_sigma")
    items = [
        recommendation_words(document),
        Item(
            "Target",
            f"{GATED_BOUND.name} bound MSE ≥ {number(document.get('target_mse'))} ({document.get('target_source')}), "
            f"with at most {number(document.get('max_accuracy_loss'))} task accuracy lost to the noise; each cut "
            + ("at its calibrated σ." if sigma is None else f"at the given σ = {number(sigma)}."),
        ),
        Item(
            "Whole model",
            f"accuracy {number(whole.get('accuracy'))} on {whole.get('n')} target samples (onnxruntime)"
            if whole.get("status") == "ok"
            else f"accuracy not measured: {whole.get('reason')}",
        ),
        Item(
            "Cuts",
            "A cut is a tensor every path from the input to the output passes through; at each, bottom then top "
            "was checked to give the whole model's output. Client cost: the bottom's parameters, its FLOPs per "
            "sample (2 × multiply-accumulates of Conv, ConvTranspose, MatMul and Gemm) and the embedding's bytes.",
        ),
    ]
    return items


def _alerts(document: dict) -> list[str]:
    alerts = []
    for cut in _cuts(document):
        violated = (cut.get("bounds") or {}).get("violated_by")
        if violated:
            alerts.append(f"The bound at {cut.get('name')} is beaten by {text(violated)}: no guarantee there.")
        failed = [n for n, a in (cut.get("attacks") or {}).items() if a.get("status") == "failed"]
        if failed:
            alerts.append(f"INCOMPLETE AUDIT at {cut.get('name')}: {text(failed)} failed.")
    if (document.get("run") or {}).get("quick"):
        alerts.append(QUICK_ALERT)
    return alerts


def _table(document: dict) -> Table:
    """One row per audited cut, shallowest first."""
    rec_index = section(document, "recommendation").get("cut_index")
    rows, classes = [], []
    for i, cut in enumerate(_cuts(document)):
        bounds, utility = cut.get("bounds") or {}, cut.get("utility") or {}
        rows.append(
            [
                str(cut.get("name")) + (" ★" if i == rec_index else ""),
                str(cut.get("op")),
                "×".join(str(s) for s in cut.get("shape") or []),
                _count(cut.get("params")),
                _count(cut.get("flops")),
                _count(cut.get("bytes_sent")),
                number((cut.get("dfil") or {}).get("trace_over_d")),
                f"{number(cut.get('noise_sigma'))} ({SIGMA_WORDS.get(cut.get('sigma_source'), '')})",
                number(bounds.get(GATED_BOUND.key)) + (" BEATEN" if bounds.get("violated_by") else ""),
                mean_std(utility.get("accuracy"), utility.get("accuracy_std")),
                number(utility.get("loss")),
            ]
        )
        classes.append("failed" if bounds.get("violated_by") else ("ok" if i == rec_index else ""))
    headers = [
        "cut",
        "op",
        "embedding",
        "client params",
        "client FLOPs",
        "bytes sent",
        "dFIL at σ=1",
        "σ",
        f"{GATED_BOUND.name} MSE",
        "accuracy at σ",
        "accuracy loss",
    ]
    return Table(headers, rows, classes)


def _cut_view(cut: dict, recommended: bool) -> PointView:
    """A cut's section: the sweep point's view, titled by the cut."""
    view = _point_view(cut, recommended)
    name = str(cut.get("name"))
    view.sigma = f"{name} (σ = {number(cut.get('noise_sigma'))})"
    view.anchor = "cut-" + "".join(c if c.isalnum() else "-" for c in name)[:60]
    bottom = cut.get("bottom") or {}
    view.notes = [
        f"bottom then top against the whole model: max |difference| {number(cut.get('parity_max_abs_err'))}; "
        f"the bottom's gradients: {bottom.get('gradient_mode')} (converter parity "
        f"{number(bottom.get('parity_max_abs_err'))})",
        *(str(w) for w in bottom.get("warnings") or []),
        *view.notes,
    ]
    return view


def cuts_chart(document: dict) -> bytes:
    """Four panels against the cut's depth: the noise σ each cut is audited at; its dFIL at σ = 1 when
    every cut is calibrated to the target (the bound then equals it everywhere), else the bound at the
    given σ with the target; the top model's accuracy at that σ (the whole model's as a line); and the
    client's cost."""
    cuts = _cuts(document)
    x = list(range(len(cuts)))
    labels = [_tail(c.get("name")) for c in cuts]
    whole = (document.get("whole_accuracy") or {}).get("accuracy")
    target = document.get("target_mse")
    with charts.plt.rc_context(charts.STYLE):
        fig, axes = charts.plt.subplots(nrows=4, sharex=True, figsize=(6.5, 7.2))
        _line(axes[0], x, [c.get("noise_sigma") for c in cuts], "noise σ at the cut", log=True)
        if document.get("noise_sigma") is None:  # every cut calibrated to the target: its leakage before noise differs
            _line(axes[1], x, [(c.get("dfil") or {}).get("trace_over_d") for c in cuts], "dFIL at σ = 1", log=True)
        else:
            _line(
                axes[1],
                x,
                [(c.get("bounds") or {}).get(GATED_BOUND.key) for c in cuts],
                f"{GATED_BOUND.name} MSE",
                True,
            )
        if document.get("noise_sigma") is not None and is_finite(target) and target > 0:
            axes[1].axhline(
                target, color=charts.TARGET_COLOR, linestyle="--", linewidth=1, label=f"target {target:.3g}"
            )
            axes[1].legend(frameon=False, fontsize=7)
        _line(axes[2], x, [(c.get("utility") or {}).get("accuracy") for c in cuts], "accuracy at σ")
        if is_finite(whole):
            axes[2].axhline(whole, color="black", linestyle=":", linewidth=1, label=f"whole model {whole:.3g}")
            axes[2].legend(frameon=False, fontsize=7)
        _line(axes[3], x, [c.get("flops") for c in cuts], "client FLOPs", log=True)
        right = axes[3].twinx()
        right.spines["right"].set_visible(True)
        _line(right, x, [c.get("bytes_sent") for c in cuts], "bytes sent", log=True, color=charts.BASELINE_COLOR)
        axes[3].set_xticks(x, labels, rotation=35, ha="right")
        axes[3].set_xlabel("cut (shallow → deep)")
        return charts._png(fig)


def _tail(name, chars: int = 24) -> str:
    """The end of a tensor name (where exporters put what distinguishes one cut from the next), on one
    line, with '$' escaped so that matplotlib never reads it as mathtext."""
    name = " ".join(str(name).split())
    name = name if len(name) <= chars else "…" + name[-(chars - 1) :]
    return name.replace("$", r"\$")


def _line(ax, x: list[int], values: list, label: str, log: bool = False, color: str = charts.ATTACK_COLOR) -> None:
    keep = [i for i, v in enumerate(values) if is_finite(v) and (v > 0 or not log)]
    ax.plot([x[i] for i in keep], [values[i] for i in keep], marker="o", color=color, linewidth=1.2, markersize=4)
    ax.set_ylabel(label, color=color)
    if log and keep:
        ax.set_yscale("log")


def write_cuts_reports(document: dict, out_dir: Path, formats: list[str]) -> list[Path]:
    """cuts.json / .html / .md / .junit.xml (as asked) in out_dir; returns the paths written."""
    return write_document_reports(document, out_dir, formats, "cuts", cuts_json_schema(), build_cuts_view)


def cuts_summary(document: dict) -> str:
    """The verdict, the recommendation and the table of cuts, for the terminal."""
    view = build_cuts_view(document, with_figures=False)
    return document_summary(document, view, view.summary[:3], view.table)
