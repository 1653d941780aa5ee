"""Writes docs/reference.md from the code it describes: the commands and their options from the click
CLI, the attacks and their options from the attack registry, the bounds, priors, trace methods and
report formats from their registries, the options' TOML keys from AuditOptions, the exit codes from
the CLI, and the report.json fields from the shipped JSON Schema. A new plugin, option or field
therefore shows up in the reference by running this script, and tests/test_docs.py fails while the
committed file is stale.

    python docs/generate.py           # rewrite docs/reference.md
    python docs/generate.py --check   # exit 1 when docs/reference.md differs from what the code says
"""

from __future__ import annotations

import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import click

from splitaudit.attacks import attack_class, attack_names
from splitaudit.attacks.base import options_help
from splitaudit.cli import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, cli
from splitaudit.core.config import HINTS, SOURCE_FIELDS, AuditOptions, option_flag
from splitaudit.core.options import option_rule, option_spec
from splitaudit.core.registries import BOUNDS, FORMATS, MODEL_FORMATS, PRIORS, TRACE_METHODS
from splitaudit.core.result import default_baseline_name, shipped_schema

REFERENCE = Path(__file__).with_name("reference.md")
SIDES = {"inputs": "J v (forward mode)", "outputs": "Jᵀ u (reverse mode)", "differences": "J v by finite differences"}

# The CLI's exit codes (cli.py's constants) in words; 0 is click's return for a finished command.
EXIT_CODES = (
    (0, "the command finished and every gate passed"),
    (EXIT_GATE_FAILED, "a gate failed (the reports are still written and say which gate and by how much)"),
    (EXIT_BAD_INPUT, "bad usage or input: one line on stderr saying what is wrong (`--debug` shows a traceback)"),
    (EXIT_INTERNAL, "internal error (a bug: please report it with the `--debug` output)"),
    (EXIT_INTERRUPTED, "interrupted (SIGINT, Ctrl-C); the run's reports are absent or incomplete (no report.json)"),
    (EXIT_TERMINATED, "terminated (SIGTERM, e.g. `kill` or a CI job's time-out); as for 130"),
)


def cell(text: object) -> str:
    """One Markdown table cell: one line, pipes escaped (a choice list `[a|b]` must not split the row)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph as one line (where a module or class says what it is)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def commands_section() -> list[str]:
    """Each command as `splitaudit COMMAND --help` shows it: usage, what it does, its arguments and options."""
    lines = ["## Commands", ""]
    root = click.Context(cli, info_name="splitaudit")
    for name, command in cli.commands.items():
        ctx = click.Context(command, info_name=name, parent=root)
        usage = " ".join(["splitaudit", name, *command.collect_usage_pieces(ctx)])
        lines += [f"### `splitaudit {name}`", "", f"`{usage}`", "", " ".join((command.help or "").split()), ""]
        rows = [record for param in command.get_params(ctx) if (record := _param_row(param, ctx))]
        lines += table(("option", "what it does"), rows) + [""] if rows else []
    return lines


def _param_row(param: click.Parameter, ctx: click.Context) -> tuple[str, str] | None:
    """A parameter's row: its flags and value, then its help with click's [default: ...] and [required]."""
    if isinstance(param, click.Argument):
        return f"`{param.human_readable_name}`", "argument" if param.required else "argument (optional)"
    if "--help" in param.opts:  # every command has it; click's own words say enough
        return None
    flags, words = param.get_help_record(ctx)
    return f"`{flags}`", words


def options_section() -> list[str]:
    """The audit options: one name for the TOML file and the Python API, the flag, the commands,
    the values each takes (in its error message's words)."""
    rows = []
    for f in fields(AuditOptions):
        spec = option_spec(f)
        flag = f"`{option_flag(f)}`" if spec.commands else ""
        where = ", ".join(sorted(spec.commands)) or ("the MODEL argument" if f.name == "model" else "config file")
        rows.append((f"`{f.name}`", flag, where, "yes" if spec.api else "no", _default(f), _values(f)))
    intro = [
        "## Options in a config file and the Python API",
        "",
        "`--config FILE.toml` takes these keys at its top level (command-line flags win); attack options go",
        "in `[attack.NAME]` tables (below). `splitaudit.audit(...)` takes the keys marked *API* as keywords.",
        "",
    ]
    return intro + table(("key", "flag", "set in", "API", "default", "values"), rows) + [""]


def _values(f) -> str:
    """The values an option takes: its rule, or for a model or data option a path (the API also
    takes an object in memory there)."""
    if f.name in SOURCE_FIELDS:
        return "a path, or in the API a torch module (models) or arrays (data)"
    return option_rule(f, HINTS[f.name])


def _default(f) -> str:
    """A dataclass field's default in words."""
    if f.default is not MISSING:
        return "none" if f.default is None else f"`{f.default!r}`"
    return f"`{f.default_factory()!r}`" if f.default_factory is not MISSING else ""


def attacks_section() -> list[str]:
    """Each registered attack: where it comes from, what it needs, what it measures, its options."""
    lines = [
        "## Attacks",
        "",
        "`--attacks all`, `none` or a comma list of these names; options as `--attack-option NAME.KEY=VALUE`",
        "or an `[attack.NAME]` table in the config file.",
        "",
    ]
    for name in attack_names():
        attack = attack_class(name)
        module = sys.modules[attack.__module__]
        lines += [f"### `{name}`: {attack.title}", "", first_paragraph(module.__doc__), ""]
        options = [_option_item(line) for line in options_help(attack.Options)] or ["  - none"]
        lines += [f"- {label}: {value}" for label, value in _attack_facts(attack)] + ["- options:", *options, ""]
    return lines


def _option_item(line: str) -> str:
    """An attack option's line from options_help ("name: help; rule, default") as a list item."""
    name, words = line.split(": ", 1)
    return f"  - `{name}`: {words}"


def _attack_facts(attack) -> list[tuple[str, str]]:
    """What the report and the skip rules read off an attack class."""
    baseline = attack.baseline_name or default_baseline_name(attack.kind)
    return [
        ("kind", f"{attack.kind} (headline metric `{attack.primary_metric}`)"),
        ("metrics", ", ".join(f"`{m}`" for m in attack.metrics)),
        ("needs", ", ".join(sorted(attack.needs)) or "nothing beyond the model and aux data"),
        ("input kinds", ", ".join(sorted(attack.input_kinds))),
        ("baseline", f"{baseline} (role `{attack.baseline_role}`)"),
        ("attacker holds", " ".join(attack.assumptions.split()) or "the model's embeddings"),
    ]


def model_formats_section() -> list[str]:
    """The model formats a bottom model may come in (core/registries.py MODEL_FORMATS)."""
    rows = [(f"`{f.name}`", f.description, f.recognised_by) for f in MODEL_FORMATS.values()]
    intro = [
        "## Model formats",
        "",
        "What MODEL may be; a file is opened by the first format that recognises it, in this order",
        "(`model.format` in report.json). An in-memory torch module (the Python API) is `torch`.",
        "",
    ]
    return intro + table(("format", "what it is", "recognised by"), rows) + [""]


def bounds_section() -> list[str]:
    """The bounds (core/registries.py BOUNDS)."""
    rows = [(b.name, f"`{b.key}`", b.formula, b.holds_against, "yes" if b.gated else "") for b in BOUNDS.values()]
    intro = ["## Bounds", "", "Lower bounds on any attacker's reconstruction MSE per input dimension.", ""]
    return intro + table(("bound", "report.json key", "formula", "holds against", "gated"), rows) + [""]


def priors_section() -> list[str]:
    """The prior-term estimators (`--prior`)."""
    rows = [(f"`{p.name}`", p.description, "yes" if p.trains else "no") for p in PRIORS.values()]
    intro = ["## Priors (`--prior`)", "", "Estimators of the van Trees bound's prior term J(π)/d.", ""]
    return intro + table(("name", "what it is", "trains a score network"), rows) + [""]


def trace_methods_section() -> list[str]:
    """The Jacobian-trace methods (core/registries.py TRACE_METHODS)."""
    rows = [(f"`{m.name}`", SIDES[m.side], m.description) for m in TRACE_METHODS.values()]
    intro = [
        "## Jacobian-trace methods",
        "",
        "How dFIL's ||J||²_F is computed (`dfil.method` in report.json); `auto` takes the exact method with",
        "the fewest products for the model.",
        "",
    ]
    return intro + table(("method", "products", "what it computes"), rows) + [""]


def formats_section() -> list[str]:
    """The report formats (`--format`)."""
    rows = [
        (f"`{f.name}`", f.description, ", ".join(sorted(f.documents)), "yes" if f.default else "")
        for f in FORMATS.values()
    ]
    intro = ["## Report formats (`--format`)", ""]
    return intro + table(("format", "what it is", "documents", "written by default"), rows) + [""]


def exit_codes_section() -> list[str]:
    """The exit codes every command uses."""
    return ["## Exit codes", ""] + table(("code", "meaning"), list(EXIT_CODES)) + [""]


def schema_section() -> list[str]:
    """Every field of report.json with its type, from the schema `splitaudit schema` prints."""
    schema = shipped_schema()
    intro = [
        "## report.json fields",
        "",
        f"{schema['description']} ({schema['title']}; `splitaudit schema` prints the JSON Schema.)",
        "Numbers that are not finite are stored as the strings `inf`, `-inf` and `nan`. `NAME` stands for",
        "any key (an attack's name, a metric's); `[]` for an array's items. *required* fields are always present.",
        "",
    ]
    return intro + table(("field", "type", "what it is"), list(schema_rows(schema, ""))) + [""]


def schema_rows(node: dict, path: str) -> typing.Iterator[tuple[str, str, str]]:
    """(path, type, description) for each field under `node`, depth first in the schema's order."""
    required = set(node.get("required", ()))
    for key, child in node.get("properties", {}).items():
        field = f"{path}.{key}" if path else key
        mark = ", required" if key in required else ""
        yield f"`{field}`", _type_words(child) + mark, child.get("description", "")
        yield from _children(child, field)
    if isinstance(node.get("additionalProperties"), dict):
        child = node["additionalProperties"]
        field = f"{path}.NAME"
        yield f"`{field}`", _type_words(child), child.get("description", "")
        yield from _children(child, field)


def _children(node: dict, path: str) -> typing.Iterator[tuple[str, str, str]]:
    """The fields inside an object, or inside an array's items."""
    yield from schema_rows(node, path)
    items = node.get("items")
    if isinstance(items, dict) and ("properties" in items or "additionalProperties" in items):
        yield from schema_rows(items, f"{path}[]")


def _type_words(node: dict) -> str:
    """A schema node's type in a few words."""
    if "enum" in node:
        return "one of " + ", ".join(f"`{v}`" for v in node["enum"])
    if "anyOf" in node or "oneOf" in node:
        return " or ".join(_type_words(option) for option in node.get("anyOf", node.get("oneOf")))
    kinds = node.get("type", "any")
    words = " or ".join(kinds) if isinstance(kinds, list) else kinds
    if words == "array" and isinstance(node.get("items"), dict):
        words = f"array of {_type_words(node['items'])}"
    return words


def render() -> str:
    """The whole reference."""
    header = [
        "# splitaudit reference",
        "",
        "Generated by `python docs/generate.py` from the CLI, the registries and report.json's schema;",
        "do not edit by hand (tests/test_docs.py checks it is current). For examples see",
        "[usage.md](usage.md); for what the numbers mean, [concepts.md](concepts.md).",
        "",
    ]
    sections = (
        commands_section,
        options_section,
        model_formats_section,
        attacks_section,
        bounds_section,
        priors_section,
        trace_methods_section,
        formats_section,
        exit_codes_section,
        schema_section,
    )
    body = [line for section in sections for line in section()]
    return "\n".join(header + body).rstrip() + "\n"


def main(argv: list[str]) -> int:
    """Rewrite the reference, or with --check say whether it is current (exit 1 when stale)."""
    text = render()
    if "--check" in argv:
        current = REFERENCE.read_text(encoding="utf-8") if REFERENCE.exists() else ""
        if current != text:
            print(f"{REFERENCE} is stale: run python docs/generate.py", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
