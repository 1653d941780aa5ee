"""Dependencies point one way: every module of the package sits in one layer, imports only its own
layer or lower ones, and no imports form a cycle. Read from the source (tests/import_graph.py),
imports inside functions included, so a lazy import cannot hide an upward dependency.

Reports read only the result: they import the core (errors, the result's schema, safe paths),
the verdicts recomputed from a result's own numbers (gate, recommendations, regression) and each other, never an
attack or the engine, so `splitaudit render` and `compare` load no torch.

A module's layer is the subpackage it sits in (audit/core, audit/inputs, ...; attacks/, estimators/,
reports/ are theirs); only the API's modules sit in the package itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from import_graph import Edge, cycles, import_graph, package_modules

# Lowest first: each layer and the subpackages (folders) that hold it. A module may import modules
# of its own layer and of the layers before it.
LAYERS: list[tuple[str, set[str]]] = [
    ("core", {"core"}),
    # Pure functions of a result's own numbers (gate, recommendations, regression), which reports recompute.
    ("verdicts", {"verdicts"}),
    # Pure tensor functions: they know nothing of models or data files (and the inputs and the
    # context compute no estimate: test_loading_and_the_context_estimate_nothing).
    ("estimators", {"estimators"}),
    ("inputs", {"inputs", "sample_models"}),
    ("context", {"context"}),  # built from the inputs, read by every attack and stage
    ("attacks", {"attacks"}),
    ("stages", {"stages"}),
    ("execution", {"execution"}),
    ("engine", {"engine"}),
    ("reports", {"reports"}),
    ("api", {"", "api", "cli", "ci", "__main__"}),  # "": the package itself, whose lazy attributes are the API
]
PLACE = {folder: index for index, (_, folders) in enumerate(LAYERS) for folder in folders}


def layer_of(module: str) -> int | None:
    """The layer of `splitaudit.FOLDER.module`: its folder's (None for a module outside them)."""
    parts = module.split(".")[1:]
    return PLACE.get(parts[0] if parts else "")


LAYER_OF = {module: layer for module in package_modules() if (layer := layer_of(module)) is not None}


def _where(edge: Edge) -> str:
    return f"{edge.source} imports {edge.target} (line {edge.line})"


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_graph()


def test_every_module_sits_in_a_layers_folder():
    unplaced = sorted(set(package_modules()) - set(LAYER_OF))
    assert not unplaced, f"modules outside the layers' folders (move them into one): {unplaced}"
    assert len(PLACE) == sum(len(folders) for _, folders in LAYERS), "a folder is in two layers"
    assert set(LAYER_OF.values()) == set(range(len(LAYERS))), "a layer without modules"


def test_no_import_points_up_a_layer(edges):
    upward = [
        f"{_where(e)}: {LAYERS[LAYER_OF[e.source]][0]} -> {LAYERS[LAYER_OF[e.target]][0]}"
        for e in edges
        if LAYER_OF.get(e.target, -1) > LAYER_OF.get(e.source, len(LAYERS))  # unplaced: the test above
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_loading_and_the_context_estimate_nothing(edges):
    """Opening models and data (inputs) and holding them for the attacks (context) is one job, estimating
    is another: neither imports an estimator (the token table's prior term is estimators/prior.py's)."""
    estimators = _members("estimators")
    crossing = [
        _where(e) for e in edges if e.target in estimators and e.source in _members("inputs") | _members("context")
    ]
    assert not crossing, "\n".join(crossing)


def _members(layer: str) -> set[str]:
    index = [name for name, _ in LAYERS].index(layer)
    return {module for module, placed in LAYER_OF.items() if placed == index}


def test_reports_read_only_the_result(edges):
    readable = _members("core") | _members("verdicts") | _members("reports")
    reaching = [_where(e) for e in edges if e.source in _members("reports") and e.target not in readable]
    assert not reaching, "reports reaching past the result:\n" + "\n".join(reaching)


def test_no_import_cycles(edges):
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_graph_reader_sees_lazy_and_type_only_imports(tmp_path):
    """The reader must not miss an import inside a function, and must keep type-only ones apart
    (a checker that missed the first kind could never fail on a lazy upward import)."""
    from import_graph import module_edges

    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from splitaudit.core import errors\n"
        "from splitaudit import cli\n"
        "if TYPE_CHECKING:\n"
        "    from splitaudit.context.audit_context import AuditContext\n"
        "def late():\n"
        "    import splitaudit.engine.pipeline\n"
        "    from splitaudit.engine.sweep import run_sweep\n"
    )
    known = {
        "splitaudit",
        "splitaudit.core.errors",
        "splitaudit.cli",
        "splitaudit.context.audit_context",
        "splitaudit.engine.pipeline",
    }
    known |= {"splitaudit.engine.sweep"}
    found = {(e.target, e.type_only) for e in module_edges("splitaudit.m", source, known)}
    assert found == {
        ("splitaudit.core.errors", False),
        ("splitaudit.cli", False),
        ("splitaudit.context.audit_context", True),
        ("splitaudit.engine.pipeline", False),
        ("splitaudit.engine.sweep", False),
    }


def test_cycles_are_found_over_run_time_edges_only():
    ring = [Edge("a", "b", 1, False), Edge("b", "c", 1, False), Edge("c", "a", 1, False), Edge("c", "d", 1, False)]
    assert cycles(ring) == [["a", "b", "c"]]
    assert cycles([Edge("a", "b", 1, False), Edge("b", "a", 1, True)]) == []


FIXTURES = Path(__file__).parent / "fixtures"
# `splitaudit render` and `compare` in a fresh interpreter, then whether torch was ever imported.
RENDER_WITHOUT_TORCH = """
import sys
from splitaudit import cli
for argv in (["render", sys.argv[1], "--out", sys.argv[3]], ["compare", sys.argv[1], sys.argv[2], "--out", sys.argv[3]]):
    try:
        cli.main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
print("torch imported:", "torch" in sys.modules)
"""


def test_render_and_compare_import_no_torch(tmp_path):
    """Re-rendering a saved report reads the result only: no attack, no estimator, no torch."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            RENDER_WITHOUT_TORCH,
            str(FIXTURES / "image_audit.json"),
            str(FIXTURES / "sigma0_audit.json"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch imported: False" in done.stdout
    assert (tmp_path / "report.html").is_file() and (tmp_path / "comparison.html").is_file()


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages setuptools installs: a subpackage missing there imports from a
    source checkout (the editable install) and is absent from a wheel, so `pip install .` breaks."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(
        tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {module.rsplit(".", 1)[0] for module, path in package_modules().items() if path.name != "__init__.py"}
    assert folders <= listed, f"add to pyproject.toml's packages: {sorted(folders - listed)}"
