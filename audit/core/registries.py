"""The plugin families besides attacks (attacks/__init__.py), by name: the bounds, the Jacobian-trace
methods, the prior estimators, the model formats, the report formats and the result kinds.

Torch-free and in the core layer, so that the options (config.py), the CLI's choices, the result's
schema (result.py) and the reports all read their names and words from here. The code of each
entry lives with its family (the prior's score-matching loss in estimators/prior.py, a format's
writer in reports/writer.py, a model format's loader in audit/inputs/formats/, a bound's formula in
estimators/bounds.py, a trace method's computation in estimators/jacobian.py or structured.py), found
by the entry's name. Adding a member is one line here and its code there; the family's conformance
suite (tests/test_bounds.py, tests/test_trace_methods.py, tests/test_prior.py, tests/test_formats.py,
tests/test_model_formats.py, tests/test_result_kinds.py) runs every entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from splitaudit.core.errors import InputError


def by_name(*entries) -> dict:
    """A registry: its entries by their `name`, in the order given (the order lists and lookups follow)."""
    return {entry.name: entry for entry in entries}


def resolve(reference: tuple[str, str]):
    """What a registry entry names as (module, attribute), its module imported now: the entries stay
    torch-free and the code they name loads when first used."""
    module, name = reference
    return getattr(import_module(module), name)


@dataclass(frozen=True)
class Bound:
    """A lower bound on an attacker's reconstruction MSE per input dimension, 1 / (dFIL + J/d)
    with or without the prior term (estimators/bounds.py: bound_mse), and everything the audit
    writes and says of it: one entry here is the whole bound.

    key: its value in the result's bounds section (`{key}_point`: at the estimate of E[dFIL]
    rather than the upper end of its interval). audience: who it holds against, in a few words
    (charts, tables, the calibration's words); holds_against: in full. gated: the bound
    --fail-under-mse gates on, attacks are checked against, and a sweep's recommended sigma must
    reach (exactly one is). inverse: (module, function) of the noise that makes it equal a target,
    (E||J||_F^2 / d, target MSE[, J/d where it uses the prior]) -> estimators.bounds.Calibration,
    written to the calibration section as `sigma_key` (and `{sigma_key}_point`); the gated bound's
    is what `--auto-sigma` and `cuts` solve. numbers: (module, function) of the other numbers it
    writes beside its value, estimators.bounds.BoundInputs -> {key: value}, their keys and types in
    `number_keys`; stderr_key: the one of them that is its standard error.
    """

    name: str
    key: str
    formula: str
    audience: str
    holds_against: str
    uses_prior: bool
    chart_color: str
    inverse: tuple[str, str]
    sigma_key: str
    gated: bool = False
    numbers: tuple[str, str] | None = None
    number_keys: tuple[tuple[str, object], ...] = ()
    stderr_key: str | None = None

    @property
    def slug(self) -> str:
        """Its name in the result's words (the calibration's `bound`): van_trees_mse -> van-trees."""
        return self.key.removesuffix("_mse").replace("_", "-")

    @property
    def label(self) -> str:
        """The bound's name with its audience: a chart's legend, a table's row."""
        return f"{self.name} bound ({self.audience})"


BOUNDS_MODULE = "splitaudit.estimators.bounds"
BOUNDS: dict[str, Bound] = {
    bound.key: bound
    for bound in (
        Bound(
            "van Trees",
            "van_trees_mse",
            "1 / (mean dFIL + J(π)/d)",
            "any attacker",
            "any attacker, including one who knows the data distribution",
            uses_prior=True,
            chart_color="#2f855a",
            inverse=(BOUNDS_MODULE, "sigma_for_van_trees"),
            sigma_key="sigma",
            gated=True,
            numbers=(BOUNDS_MODULE, "van_trees_numbers"),
            number_keys=(("van_trees_stderr", float), ("van_trees_stam_mse", float | None)),
            stderr_key="van_trees_stderr",
        ),
        Bound(
            "Cramér-Rao",
            "cramer_rao_mse",
            "1 / mean dFIL",
            "unbiased attackers",
            "unbiased attackers (no prior knowledge)",
            uses_prior=False,
            chart_color="#805ad5",
            inverse=(BOUNDS_MODULE, "sigma_for_unbiased"),
            sigma_key="sigma_unbiased",
            numbers=(BOUNDS_MODULE, "cramer_rao_numbers"),
            number_keys=(("cramer_rao_mse_leakiest", float),),
        ),
    )
}
GATED_BOUND = next(bound for bound in BOUNDS.values() if bound.gated)  # also the bound noise is calibrated for


@dataclass(frozen=True)
class TraceMethod:
    """A way to compute ||J(x)||_F^2 per sample, the numerator of dFIL.

    side: the products it takes, "inputs" (J v, forward mode), "outputs" (J^T u, reverse mode) or
    "differences" (J v by central differences, black-box); the run-time cross-check
    (estimators/mean_trace.py) takes the other AD side's products, so that the check is independent
    of the method. compute: (module, function) (f, x, TraceOptions, Plan) -> TraceEstimate. products:
    (module, function) (f, x, Plan) -> its products per sample where it is exact and applies to
    (f, x), else None: the cost model "auto" picks the fewest by, in the registry's order on ties.
    """

    name: str
    side: str
    description: str
    compute: tuple[str, str]
    products: tuple[str, str]

    @property
    def differentiates(self) -> bool:
        """Whether the method needs autograd (every side but differences)."""
        return self.side != "differences"


JACOBIAN_MODULE, STRUCTURED_MODULE = "splitaudit.estimators.jacobian", "splitaudit.estimators.structured"
TRACE_METHODS: dict[str, TraceMethod] = by_name(
    TraceMethod(
        "forward",
        "inputs",
        "exact: one forward-mode product per input dimension (d per sample)",
        (JACOBIAN_MODULE, "forward_trace"),
        (JACOBIAN_MODULE, "forward_products"),
    ),
    TraceMethod(
        "reverse",
        "outputs",
        "exact: one reverse-mode product per output dimension (m per sample)",
        (JACOBIAN_MODULE, "reverse_trace"),
        (JACOBIAN_MODULE, "reverse_products"),
    ),
    TraceMethod(
        "hutchinson",
        "inputs",
        "random Rademacher probes (forward mode, reverse where forward mode does not work) until the "
        "standard error is the asked fraction of the mean",
        (JACOBIAN_MODULE, "hutchinson_trace"),
        (JACOBIAN_MODULE, "never_exact"),
    ),
    TraceMethod(
        "finite-difference",
        "differences",
        "central differences over the input basis (random probes when d is large) at two steps, whose "
        "disagreement bounds the truncation error; forward passes only (black-box models)",
        (JACOBIAN_MODULE, "finite_difference_trace"),
        (JACOBIAN_MODULE, "never_exact"),
    ),
    TraceMethod(  # colours either side; "inputs" so that its cross-check takes reverse-mode probes, which
        # every differentiable model has (forward mode may be missing)
        "structured",
        "inputs",
        "exact: one product per colour of the outputs (or inputs) no two of which share a dependency, "
        "where the model has local structure (convolutions, per-position layers)",
        (STRUCTURED_MODULE, "structured_trace"),
        (STRUCTURED_MODULE, "structured_products"),
    ),
)


@dataclass(frozen=True)
class PriorMethod:
    """An estimator of the prior term J(pi)/d of the van Trees bound.

    function: (module, name) of its score-matching loss when it trains a score network, else of its
    closed-form fit (x, smoothing) -> PriorEstimate (no training cost, no progress bar).
    needs_noise: the loss is defined only on noise-smoothed inputs, so without --smoothing it
    smooths a little itself (and says so in the prior's notes).
    """

    name: str
    description: str
    function: tuple[str, str]
    trains: bool = True
    needs_noise: bool = False


PRIOR_MODULE = "splitaudit.estimators.prior"
PRIORS: dict[str, PriorMethod] = by_name(
    PriorMethod(
        "ssm",
        "sliced score matching with variance reduction (Song et al., UAI 2019)",
        (PRIOR_MODULE, "ssm_vr_loss"),
    ),
    PriorMethod(
        "dsm",
        "denoising score matching (Vincent, Neural Computation 2011)",
        (PRIOR_MODULE, "dsm_loss"),
        needs_noise=True,
    ),
    PriorMethod(
        "gaussian",
        "an isotropic Gaussian fit: the lowest J any prior of that spread has",
        (PRIOR_MODULE, "gaussian_prior"),
        trains=False,
    ),
)


@dataclass(frozen=True)
class ModelFormat:
    """A kind of bottom model splitaudit opens: its name (report.json's `model.format`), what it is,
    how a file is recognised as one, and its loader (module, class: a subclass of
    audit/inputs/model_format.py's ModelLoader, imported when first used). A file is opened by the
    first format whose loader recognises it, in the registry's order; one that none recognises by
    the `fallback` format, whose loader then says what is wrong with it. `folds_batch_norm`: its
    exporters fold batch norm into the convolutions before it, which SDAR's simulator of the bottom
    gets back (attacks/parts/nets.py)."""

    name: str
    description: str
    recognised_by: str
    loader: tuple[str, str]
    fallback: bool = False
    folds_batch_norm: bool = False


FORMATS_MODULE = "splitaudit.inputs.formats"
MODEL_FORMATS: dict[str, ModelFormat] = by_name(
    ModelFormat(
        "huggingface",
        "a Hugging Face checkpoint folder (safetensors), cut after block --split-layer",
        "a folder with a config.json",
        (f"{FORMATS_MODULE}.hf_checkpoint", "CheckpointFolder"),
    ),
    ModelFormat(
        "onnx",
        "an ONNX graph, converted to torch for gradients and run by onnxruntime",
        "the suffix .onnx; any file no other format recognises",
        (f"{FORMATS_MODULE}.onnx", "OnnxGraph"),
        fallback=True,
        folds_batch_norm=True,
    ),
    ModelFormat(
        "exported",
        "a torch.export program (.pt2)",
        "the suffix .pt2, or a zip archive in torch.export's layout",
        (f"{FORMATS_MODULE}.exported", "ExportedProgram"),
    ),
    ModelFormat(
        "torchscript",
        "a TorchScript archive (torch.jit.save)",
        "the suffixes .pt, .pth, .ts, .jit, .torchscript, or any other zip archive",
        (f"{FORMATS_MODULE}.torchscript", "TorchScriptArchive"),
    ),
)


@dataclass(frozen=True)
class ResultKind:
    """A kind of result document: a run's report ("report", whose JSON has no `kind` field), a sweep, a
    cuts audit. Each names, as (module, function) imported when first used: its JSON Schema (`schema`:
    () -> dict), its writer for `splitaudit render` (`writer`: (document, out_dir, formats) -> files
    written), what contradicts its own numbers (`problem`: (document, legacy) -> the first problem or
    None, reports/consistency.py), its gate decided anew from its numbers (`gate`: document -> gate)
    and its points measured again by `splitaudit verify --recompute`
    (`remeasure`: (options, document, config) -> [(point, mean dFIL)]). `side_by_side`: why `compare`
    refuses it ("" where it compares two of them)."""

    name: str
    schema: tuple[str, str]
    writer: tuple[str, str]
    problem: tuple[str, str]
    gate: tuple[str, str]
    remeasure: tuple[str, str]
    side_by_side: str = ""


RESULT_KINDS: dict[str, ResultKind] = by_name(
    ResultKind(
        "report",
        ("splitaudit.core.result", "shipped_schema"),
        ("splitaudit.reports.writer", "write_reports"),
        ("splitaudit.reports.consistency", "report_problem"),
        ("splitaudit.reports.consistency", "recomputed_report_gate"),
        ("splitaudit.engine.verify", "measure_report_again"),
    ),
    ResultKind(
        "sweep",
        ("splitaudit.core.result", "sweep_json_schema"),
        ("splitaudit.reports.sweep", "write_sweep_reports"),
        ("splitaudit.reports.consistency", "sweep_problem"),
        ("splitaudit.reports.consistency", "recomputed_sweep_gate"),
        ("splitaudit.engine.verify", "measure_sweep_again"),
        side_by_side="a sweep already sets its sigmas side by side",
    ),
    ResultKind(
        "cuts",
        ("splitaudit.core.result", "cuts_json_schema"),
        ("splitaudit.reports.cuts", "write_cuts_reports"),
        ("splitaudit.reports.consistency", "cuts_problem"),
        ("splitaudit.reports.consistency", "recomputed_cuts_gate"),
        ("splitaudit.engine.cuts", "measure_cuts_again"),
        side_by_side="it already sets its cuts side by side",
    ),
)


def result_kind(document: dict) -> ResultKind:
    """The kind of a result document: its `kind` field's, a run's report where it has none (or an unknown one)."""
    kind = document.get("kind")
    return RESULT_KINDS.get(kind if isinstance(kind, str) else "", RESULT_KINDS["report"])


@dataclass(frozen=True)
class ReportFormat:
    """A file a result can be written as: its name (--format), what it is, the documents it
    renders ("report": splitaudit run and render; "sweep"; "cuts"; "comparison": splitaudit compare), its
    writer (module, function: reports/documents.py's Document and the output folder -> the file
    written, imported when first used), and whether run and sweep write it when --format is not given."""

    name: str
    description: str
    documents: frozenset[str]
    writer: tuple[str, str]
    default: bool = False


_ALL = frozenset({*RESULT_KINDS, "comparison"})  # every kind of result, and compare's side-by-side page
FORMATS: dict[str, ReportFormat] = by_name(
    ReportFormat(
        "html",
        "a self-contained web page",
        _ALL,
        ("splitaudit.reports.writer", "write_html_document"),
        default=True,
    ),
    ReportFormat(
        "md",
        "Markdown, its figures beside it",
        _ALL,
        ("splitaudit.reports.writer", "write_markdown_document"),
        default=True,
    ),
    ReportFormat(
        "json",
        "the result itself (report.json), checked against its schema",
        _ALL,
        ("splitaudit.reports.writer", "write_json_document"),
        default=True,
    ),
    ReportFormat(
        "sarif",
        "SARIF 2.1.0 findings for code-scanning tools",
        frozenset({"report"}),
        ("splitaudit.reports.sarif", "write_sarif_document"),
    ),
    ReportFormat(
        "junit",
        "the gate's checks as JUnit XML test cases",
        frozenset({"report", "sweep", "cuts"}),
        ("splitaudit.reports.junit", "write_junit_document"),
    ),
    ReportFormat(
        "pdf",
        "a PDF for a reviewer to sign: the HTML's content, provenance, sign-off",
        frozenset({"report"}),
        ("splitaudit.reports.pdf", "write_pdf_document"),
    ),
)
DEFAULT_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.default)


def formats_of(document: str) -> tuple[str, ...]:
    """The formats a document can be written in, in the registry's order."""
    return tuple(name for name, fmt in FORMATS.items() if document in fmt.documents)


def check_formats(formats: list[str], document: str) -> None:
    """InputError unless `formats` is a non-empty list of formats `document` can be written in."""
    allowed = formats_of(document)
    if not formats or any(f not in allowed for f in formats):
        raise InputError(
            f"--format takes a comma list of {', '.join(allowed)} for a {document}; got {','.join(formats)!r}"
        )
