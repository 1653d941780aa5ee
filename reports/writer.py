"""Write and read result files: strict JSON (non-finite numbers as strings), HTML, Markdown."""
from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup, escape
from tabulate import tabulate

from splitaudit.errors import InputError
from splitaudit.reports.view import Figure, Table, build_view
from splitaudit.result import SCHEMA_VERSION, first_error
NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|#])")


def to_strict_json(value):
    """Replace inf/nan by the strings "inf"/"-inf"/"nan" so that any JSON parser reads the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): to_strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_strict_json(v) for v in value]
    return value


def from_strict_json(value):
    """Inverse of to_strict_json."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    if isinstance(value, dict):
        return {k: from_strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_strict_json(v) for v in value]
    return value


def load_result(path: Path) -> dict:
    """Read a report.json written by splitaudit; InputError names the first place it breaks the schema."""
    try:
        return checked_result(json.loads(Path(path).read_text(encoding="utf-8")), str(path))
    except FileNotFoundError as exc:
        raise InputError(f"report not found: {path}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not a splitaudit report.json (invalid JSON: {exc})") from exc
    except RecursionError as exc:
        raise InputError(f"{path} is not a splitaudit report.json (nested too deeply)") from exc


def checked_result(stored, source: str) -> dict:
    """A report.json document (as stored) checked against the schema, with its numbers restored."""
    if not isinstance(stored, dict) or "schema_version" not in stored:
        raise InputError(f"{source} is not a splitaudit report.json (no schema_version)")
    if stored["schema_version"] != SCHEMA_VERSION:
        raise InputError(f"{source} is a report of schema version {stored['schema_version']!r}; this splitaudit "
                         f"reads version {SCHEMA_VERSION} (rerun the audit, or render it with the version that wrote it)")
    error = first_error(stored)
    if error:
        raise InputError(f"{source}: {error}")
    return from_strict_json(stored)


def markdown_text(value) -> Markup:
    """Escape a value for Markdown: HTML entities for <>&" and backslashes for Markdown syntax."""
    if isinstance(value, Markup):
        return value
    return escape(MARKDOWN_SPECIAL.sub(r"\\\1", "" if value is None else str(value)))


def markdown_url(path: str) -> Markup:
    """A relative file path as a Markdown link target."""
    return Markup(quote(path))


def markdown_table(table: Table) -> Markup:
    """A GitHub-flavoured Markdown table with every cell escaped."""
    return Markup(tabulate([[markdown_text(c) for c in row] for row in table.rows],
                           headers=[markdown_text(h) for h in table.headers], tablefmt="github",
                           disable_numparse=True))


def html_environment() -> Environment:
    return Environment(loader=PackageLoader("splitaudit.reports", "templates"), autoescape=True,
                       undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def markdown_environment() -> Environment:
    """Autoescaped like HTML, but every interpolation also escapes Markdown syntax."""
    env = Environment(loader=PackageLoader("splitaudit.reports", "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, finalize=markdown_text)
    env.filters["md_table"] = markdown_table
    env.filters["md_url"] = markdown_url
    return env


def inline_figures(figures: list[Figure]) -> None:
    """Point each figure at a data URI, for a self-contained HTML file."""
    for figure in figures:
        figure.src = "data:image/png;base64," + base64.b64encode(figure.png).decode("ascii")


def save_figures(figures: list[Figure], out_dir: Path, folder: str) -> list[Path]:
    """Write each figure as a PNG in out_dir/folder and point it at its relative path."""
    paths = []
    if figures:
        (out_dir / folder).mkdir(parents=True, exist_ok=True)
    for figure in figures:
        path = out_dir / folder / f"{figure.name}.png"
        path.write_bytes(figure.png)
        figure.src = f"{folder}/{path.name}"
        paths.append(path)
    return paths


def render_pages(view, out_dir: Path, formats: list[str], stem: str) -> list[Path]:
    """Render `view` with templates STEM.html.j2 / STEM.md.j2 into out_dir (figures as needed)."""
    written = []
    if "html" in formats:
        inline_figures(view.figures)
        path = out_dir / f"{stem}.html"
        path.write_text(html_environment().get_template(f"{stem}.html.j2").render(v=view), encoding="utf-8")
        written.append(path)
    if "md" in formats:
        save_figures(view.figures, out_dir, f"{stem}_images")
        path = out_dir / f"{stem}.md"
        path.write_text(markdown_environment().get_template(f"{stem}.md.j2").render(v=view), encoding="utf-8")
        written.append(path)
    return written


def render_html(result: dict) -> str:
    """The self-contained HTML report as a string (figures inline)."""
    view = build_view(result)
    inline_figures(view.figures)
    return html_environment().get_template("report.html.j2").render(v=view)


def render_summary_html(result: dict) -> str:
    """A short HTML fragment (verdict, summary, attacks table) for notebooks; no figures."""
    return html_environment().get_template("summary.html.j2").render(v=build_view(result, with_figures=False))


def write_json(data: dict, path: Path) -> Path:
    path.write_text(json.dumps(to_strict_json(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def write_result_json(result: dict, path: Path) -> Path:
    """report.json, checked against the schema first: a result that breaks it is a bug, never written."""
    error = first_error(to_strict_json(result))
    if error:
        raise RuntimeError(f"the result breaks the report.json schema at {error}")
    return write_json(result, path)


def write_reports(result: dict, out_dir: Path, formats: list[str]) -> list[Path]:
    """Write report.json / .html / .md / .sarif (as asked) into out_dir; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_result_json(result, out_dir / "report.json")] if "json" in formats else []
    if "html" in formats or "md" in formats:
        written += render_pages(build_view(result), out_dir, formats, "report")
    if "sarif" in formats:
        from splitaudit.reports.sarif import write_sarif

        written.append(write_sarif(result, out_dir / "report.sarif"))
    return written
