"""Write and read result files: strict JSON (non-finite numbers as strings), HTML, Markdown."""
from __future__ import annotations

import json
import math
from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape

from splitaudit.errors import InputError

SCHEMA_VERSION = 1
NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


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
    """Read a report.json written by splitaudit, checking its schema version."""
    try:
        result = from_strict_json(json.loads(Path(path).read_text()))
    except FileNotFoundError as exc:
        raise InputError(f"report not found: {path}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not a splitaudit report.json (invalid JSON: {exc})") from exc
    if not isinstance(result, dict) or result.get("schema_version") != SCHEMA_VERSION:
        raise InputError(f"{path} is not a splitaudit report.json of schema version {SCHEMA_VERSION}")
    return result


def _environment() -> Environment:
    return Environment(loader=PackageLoader("splitaudit.reports", "templates"),
                       autoescape=select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True)


def write_reports(result: dict, out_dir: Path, formats: list[str]) -> list[Path]:
    """Write report.json / report.html / report.md into out_dir; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if "json" in formats:
        path = out_dir / "report.json"
        path.write_text(json.dumps(to_strict_json(result), indent=2, allow_nan=False) + "\n")
        written.append(path)
    env = _environment()
    for fmt, template in (("html", "report.html.j2"), ("md", "report.md.j2")):
        if fmt in formats:
            path = out_dir / f"report.{fmt}"
            path.write_text(env.get_template(template).render(r=result))
            written.append(path)
    return written
