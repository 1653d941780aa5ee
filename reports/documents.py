"""A result to write (a report, a sweep, cuts or a comparison) and the writers of its formats.

Each format of core/registries.py's FORMATS names its writer: a function taking a Document and the
output folder and returning the file it wrote. write_document writes the formats asked for in the
registry's order, the JSON last (a complete JSON file then always belongs with complete pages).
Adding a format is its writer and one registry line; the writers of a document kind's pages read
its view, built once on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from splitaudit.core.registries import FORMATS, resolve


@dataclass
class Document:
    """What a writer needs: the kind (the files' stem and the templates' name), the result itself,
    how to build its view, its JSON schema (None: the report's), and for a document whose JSON is not
    the result itself (a comparison's tables) that JSON from the view."""

    kind: str
    data: dict
    build_view: Callable[[], object] = field(repr=False)
    schema: dict | None = None
    json_from_view: Callable[[object], dict] | None = None

    @cached_property
    def view(self):
        return self.build_view()


def write_document(document: Document, out_dir: Path, formats: list[str]) -> list[Path]:
    """Each asked format of `document` in out_dir, the registry's order with the JSON last; the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = [name for name in FORMATS if name in formats and name != "json"] + (["json"] if "json" in formats else [])
    return [writer_of(name)(document, out_dir) for name in order]


def writer_of(name: str) -> Callable[[Document, Path], Path]:
    """The writer FORMATS[name] registers (its module imported now)."""
    return resolve(FORMATS[name].writer)
