"""The compact summary printed at the end of `splitaudit run`."""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from splitaudit.reports.view import build_view

WIDTH = 100


def terminal_summary(result: dict) -> str:
    """Verdict, alerts, the summary lines and the attacks table (no figures are drawn)."""
    view = build_view(result, with_figures=False)
    lines = [view.headline]
    lines += [_wrap("! " + alert) for alert in view.alerts]
    lines += [_wrap(f"{item.label}: {item.text}") for item in view.summary if item.label != "Verdict"]
    if view.overview:
        rows = [row[:2] + [_short(row[2])] + row[3:] for row in view.overview.rows]
        lines.append(tabulate(rows, headers=view.overview.headers, disable_numparse=True))
    if not view.passed:
        lines.append(_wrap("gate: " + "; ".join(view.reasons)))
    return "\n".join(lines)


def _wrap(line: str) -> str:
    return textwrap.fill(line, WIDTH, subsequent_indent="  ")


def _short(cell: str, width: int = 60) -> str:
    return cell if len(cell) <= width else cell[: width - 1] + "…"
