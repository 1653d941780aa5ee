"""docs/reference.md is generated from the code (docs/generate.py): the committed file must be what the
CLI, the registries and the report schema say now, and a member added to a registry must appear in it.
The reader docs' links resolve."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from splitaudit.attacks import attack_names
from splitaudit.cli import cli
from splitaudit.core import registries
from splitaudit.core.registries import ModelFormat, PriorMethod, ReportFormat

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def generate():
    """docs/generate.py as a module (it is a script beside the docs, not part of the package)."""
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_is_current(generate):
    """The check CI runs: a changed option, attack or schema field without a regenerated reference fails."""
    assert generate.main(["--check"]) == 0, "docs/reference.md is stale: run python docs/generate.py"


def test_reference_names_every_command_attack_and_exit_code(generate):
    text = generate.render()
    for command in cli.commands:
        assert f"### `splitaudit {command}`" in text
    for name in attack_names():
        assert f"### `{name}`:" in text
    for code, _ in generate.EXIT_CODES:
        assert f"\n| {code} | " in text


def test_a_new_registry_member_shows_up(generate, monkeypatch):
    """Adding a report format, a prior or a model format is one registry line; the reference picks it up
    without other edits."""
    monkeypatch.setitem(
        registries.FORMATS,
        "toy",
        ReportFormat("toy", "a toy format | with a pipe", frozenset({"report"}), ("test_formats", "write_toy")),
    )
    monkeypatch.setitem(
        registries.PRIORS, "toyprior", PriorMethod("toyprior", "a toy prior", ("toy", "fit"), trains=False)
    )
    monkeypatch.setitem(
        registries.MODEL_FORMATS, "toymodel", ModelFormat("toymodel", "a toy model", "the suffix .toy", ("toy", "Toy"))
    )
    text = generate.render()
    assert "| `toymodel` | a toy model | the suffix .toy |" in text
    assert "| `toy` | a toy format \\| with a pipe | report |  |" in text
    assert "| `toyprior` | a toy prior | no |" in text


def test_check_fails_on_a_stale_reference(generate, monkeypatch, tmp_path):
    stale = tmp_path / "reference.md"
    stale.write_text("# an old reference\n", encoding="utf-8")
    monkeypatch.setattr(generate, "REFERENCE", stale)
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0
    assert stale.read_text(encoding="utf-8") == generate.render()


def test_schema_rows_walk_objects_arrays_and_named_keys(generate):
    """Every field path of a small schema, with its type words, required marks and descriptions."""
    schema = {
        "properties": {
            "a": {
                "type": "object",
                "description": "an object",
                "required": ["b"],
                "properties": {"b": {"enum": [1, 2]}},
            },
            "c": {"type": "array", "items": {"type": "object", "properties": {"d": {"type": ["number", "null"]}}}},
            "e": {
                "type": "object",
                "additionalProperties": {"type": "object", "properties": {"f": {"type": "string"}}},
            },
        },
        "required": ["a"],
    }
    assert list(generate.schema_rows(schema, "")) == [
        ("`a`", "object, required", "an object"),
        ("`a.b`", "one of `1`, `2`, required", ""),
        ("`c`", "array of object", ""),
        ("`c[].d`", "number or null", ""),
        ("`e`", "object", ""),
        ("`e.NAME`", "object", ""),
        ("`e.NAME.f`", "string", ""),
    ]


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


READER_DOCS = ["README.md", "REFERENCES.md", "benchmarks/README.md", "benchmarks/RESULTS.md"] + [
    f"docs/{p.name}" for p in sorted(DOCS.glob("*.md"))
]


@pytest.mark.parametrize("name", READER_DOCS)
def test_every_relative_link_and_anchor_resolves(name):
    """A moved section or file must not leave a reader at a dead link."""
    source = ROOT / name
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.exists(), f"{name}: {target} names no file"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked.read_text(encoding="utf-8")), f"{name}: {target} names no heading"


def test_benchmarks_readme_lists_every_script():
    """benchmarks/README.md says what each script measures and how to run it: a new script is listed there."""
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if f"`{p.name}`" not in readme]
    assert not missing, f"benchmarks/README.md does not list {', '.join(missing)}"
