"""Dependencies point one way: every module of the package sits in one layer, imports only its own
layer or lower ones, and no imports form a cycle. Read from the source (tests/import_graph.py),
imports inside functions included, so a lazy import cannot hide an upward dependency.

Reports read only the result: they import the core (errors, the result's schema, safe paths),
the verdicts recomputed from a result's own numbers (gate, recommend) and each other, never an
attack or the engine, so `splitaudit render` and `compare` load no torch.

A new module must be placed in LAYERS below; the test names it until it is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from import_graph import Edge, cycles, import_graph, package_modules

# Lowest first. A module may import modules of its own layer and of the layers before it.
LAYERS: list[tuple[str, set[str]]] = [
    ("core", {"errors", "safety", "memory", "threads", "config", "registries", "input_space", "result", "version"}),
    # Pure tensor functions: they know nothing of models or data files, and the context and the
    # token space use their seeded draws and trace types, so they sit below the inputs.
    (
        "estimators",
        {
            "estimators",
            "estimators.bounds",
            "estimators.jacobian",
            "estimators.methods",
            "estimators.mean_trace",
            "estimators.prior",
            "estimators.structured",
            "token_information",
        },
    ),
    (
        "inputs",
        {
            "data",
            "onnx_graph",
            "stochastic",
            "raw_model",
            "torchscript_loading",
            "onnx_loading",
            "model_checks",
            "models",
            "tokens",
            "token_models",
            "context",
            "sample_models",
            "sample_models.build",
            "sample_models.text_sample",
        },
    ),
    (
        "attacks",
        {
            "attacks",
            "attacks.base",
            "attacks.nets",
            "attacks.cluster_naming",
            "attacks.plateau",
            "attacks.token_relaxation",
            "attacks.features",
            "attacks.reconstruction",
            "attacks.text_metrics",
            "attacks.attribute",
            "attacks.decoder",
            "attacks.finetune",
            "attacks.kmeans",
            "attacks.optimization",
            "attacks.sdar",
            "attacks.sdar_training",
            "attacks.token_inversion",
        },
    ),
    ("stages", {"leakage", "bound_check", "calibration", "token_statement", "utility", "cost", "gate", "recommend"}),
    ("execution", {"tasks", "executor", "process_pool", "ray_executor", "recipe"}),
    ("engine", {"pipeline", "sweep"}),
    (
        "reports",
        {
            "reports",
            "reports.charts",
            "reports.compare",
            "reports.consistency",
            "reports.files",
            "reports.formatting",
            "reports.junit",
            "reports.sarif",
            "reports.sweep",
            "reports.terminal",
            "reports.tokens",
            "reports.view",
            "reports.view_attacks",
            "reports.view_bounds",
            "reports.view_elements",
            "reports.view_summary",
            "reports.view_verdict",
            "reports.writer",
        },
    ),
    ("api", {"", "api", "cli", "__main__"}),  # "": the package itself, whose lazy attributes are the API
]


def _qualified(short: str) -> str:
    return "splitaudit" + (f".{short}" if short else "")


# What a report may import besides the core and other reports: pure functions of a result's numbers.
RESULT_FUNCTIONS = {"splitaudit.gate", "splitaudit.recommend"}

LAYER_OF = {_qualified(m): index for index, (_, members) in enumerate(LAYERS) for m in members}


def _where(edge: Edge) -> str:
    return f"{edge.source} imports {edge.target} (line {edge.line})"


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_graph()


def test_every_module_is_in_exactly_one_layer():
    modules = set(package_modules())
    placed = [_qualified(m) for _, members in LAYERS for m in members]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    assert not modules - set(placed), f"modules in no layer (add them to LAYERS): {sorted(modules - set(placed))}"
    assert not set(placed) - modules, f"LAYERS names modules that do not exist: {sorted(set(placed) - modules)}"


def test_no_import_points_up_a_layer(edges):
    upward = [
        f"{_where(e)}: {LAYERS[LAYER_OF[e.source]][0]} -> {LAYERS[LAYER_OF[e.target]][0]}"
        for e in edges
        if LAYER_OF.get(e.target, -1) > LAYER_OF.get(e.source, len(LAYERS))  # unplaced: the test above
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def _members(layer: str) -> set[str]:
    return {_qualified(m) for name, members in LAYERS if name == layer for m in members}


def test_reports_read_only_the_result(edges):
    readable = _members("core") | _members("reports") | RESULT_FUNCTIONS
    reaching = [_where(e) for e in edges if e.source in _members("reports") and e.target not in readable]
    assert not reaching, "reports reaching past the result:\n" + "\n".join(reaching)
    assert RESULT_FUNCTIONS <= set(LAYER_OF)


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
        "from splitaudit import errors, cli\n"
        "if TYPE_CHECKING:\n"
        "    from splitaudit.context import AuditContext\n"
        "def late():\n"
        "    import splitaudit.pipeline\n"
        "    from splitaudit.sweep import run_sweep\n"
    )
    known = {"splitaudit", "splitaudit.errors", "splitaudit.cli", "splitaudit.context", "splitaudit.pipeline"}
    known |= {"splitaudit.sweep"}
    found = {(e.target, e.type_only) for e in module_edges("splitaudit.m", source, known)}
    assert found == {
        ("splitaudit.errors", False),
        ("splitaudit.cli", False),
        ("splitaudit.context", True),
        ("splitaudit.pipeline", False),
        ("splitaudit.sweep", False),
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
