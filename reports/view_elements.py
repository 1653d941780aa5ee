"""The building blocks every report view is made of (figures, tables, summary lines), and the
readers that take a result's sections apart without trusting their shape (a section that is not a
dict reads as empty). Tables of facts, records and notes are generic: any section can use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitaudit.core.result import outcome_of
from splitaudit.reports.formatting import is_finite, number, shape, text

METRIC_LABELS = {
    "accuracy": "accuracy",
    "nmi": "NMI",
    "ari": "ARI",
    "auc": "AUC",
    "mse": "MSE",
    "psnr": "PSNR (dB)",
    "ssim": "SSIM",
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


def section(result: dict, key: str) -> dict:
    value = result.get(key)
    return value if isinstance(value, dict) else {}


def gate_section(result: dict) -> dict:
    return section(result, "gate")


def attack_entries(result: dict) -> dict[str, dict]:
    return {name: a for name, a in section(result, "attacks").items() if isinstance(a, dict)}


def ran_ok(attack: dict) -> bool:
    return attack.get("status") == "ok"


# An attack's reading in the report's words (core.result.Outcome, or its status when it did not run).
OUTCOME_WORDS = {"leakage": "leakage", "no-advantage": "no advantage", "inconclusive": "INCONCLUSIVE"}


def outcome(attack: dict) -> str:
    """An ok attack's outcome as stored (derived for results built before it was), else its status."""
    if not ran_ok(attack):
        return str(attack.get("status", "unknown"))
    advantage = attack.get("advantage")
    return attack.get("outcome") or outcome_of(
        advantage if is_finite(advantage) else 0.0, attack.get("failed_to_train", "")
    )


def trained(attack: dict) -> bool:
    """An ok attack that learned (not inconclusive): only its numbers measure leakage or its absence."""
    return ran_ok(attack) and outcome(attack) != "inconclusive"


def facts_table(section: dict, labels: dict[str, str]) -> Table | None:
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


def records_table(items: Any) -> Table | None:
    """A list of dicts (e.g. the leakiest samples) as a table with the union of their keys."""
    records = [i for i in items or [] if isinstance(i, dict)]
    if not records:
        return None
    keys = list(dict.fromkeys(k for r in records for k in r))
    return Table([k.replace("_", " ") for k in keys], [[number(r.get(k)) for k in keys] for r in records])


def collected_notes(*sections: dict) -> list[str]:
    notes = []
    for section in sections:
        value = section.get("notes")
        notes.extend([str(n) for n in value] if isinstance(value, list) else [str(value)] if value else [])
    return notes
