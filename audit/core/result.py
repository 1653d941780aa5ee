"""The result object (report.json): its shape per section, its version, and its JSON Schema.

Producers (pipeline, leakage, attacks, gate) keep building plain dicts; the TypedDicts below
say what those dicts hold, and `json_schema()` turns them into the JSON Schema that every
report.json written must satisfy (`splitaudit schema` prints it). A float field may also hold
the strings "inf", "-inf" or "nan": that is how report.json stores non-finite numbers.

To add a key: add it to the section's TypedDict (`NotRequired[...]` when not every run writes
it), run `python -m splitaudit.core.result > audit/report.schema.json`, and let the test on real
pipeline output prove that the producer writes it.
"""

import json
import sys
import types
from functools import lru_cache
from importlib.resources import files
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from splitaudit.core.input_space import InputKind
from splitaudit.core.registries import BOUNDS, GATED_BOUND, PRIORS, resolve, result_kind

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - exercised on Python 3.10 only (typing.TypedDict ignores NotRequired there)
    from typing_extensions import NotRequired, TypedDict

SCHEMA_VERSION = 6
READABLE_VERSIONS = (5, 6)  # older report.json files that render and compare read (upgraded())
SCHEMA_FILE = "report.schema.json"
NON_FINITE_PATTERN = "^(inf|-inf|nan)$"


class Tool(TypedDict):
    """The program that wrote the report."""

    name: str
    version: str


class TaskRecord(TypedDict):
    """One task of the executor: an attack's seed at a noise sigma, and its wall time."""

    attack: str
    seed: int
    noise_sigma: float
    status: Literal["ok", "failed"]
    seconds: float
    attempts: int
    worker: str


class ShardSummary(TypedDict):
    """The dFIL traces' Jacobian-product shards when they ran on the executor's workers."""

    tasks: int
    seconds: float
    retried: int


class Run(TypedDict):
    """When, where and how the audit ran."""

    started: str
    seconds: float | None
    device: str
    seed: int
    quick: bool
    seeds: list[int]
    python: str
    torch: str
    executor: NotRequired[Literal["local", "ray"]]
    workers: NotRequired[int]
    task_timeout: NotRequired[float | None]
    tasks: NotRequired[list[TaskRecord]]
    dfil_shards: NotRequired[ShardSummary]


class Model(TypedDict):
    """The audited bottom model as loaded and checked on real inputs."""

    path: str
    format: str
    input_shape: list[int]
    output_shape: list[int]
    gradient_mode: Literal["autograd", "finite-difference"]
    parity_max_abs_err: float | None
    stochastic: bool
    mode: NotRequired[Literal["saved", "eval", "train"]]  # --model-mode the model was audited in
    training_modules: NotRequired[list[str]]  # its submodules in training mode ("" is the root module)
    warnings: list[str]
    providers: list[str]


class TextFile(TypedDict):
    """A raw-text data file (.txt/.jsonl) as tokenised: its truncation and padding declared."""

    format: Literal["txt", "jsonl"]
    tokenizer: str  # the tokenizer's class (a transformers tokenizer, or tokenizers.Tokenizer)
    tokenizer_source: Literal["checkpoint", "vocab"]  # the checkpoint folder's, or --vocab's tokenizer.json
    lines: int
    texts: int  # non-empty lines (jsonl: objects with a non-empty text)
    empty_lines_skipped: int
    max_length: int  # --max-length
    limit: int  # the tokens a text keeps: --max-length, the model's context window where smaller, or aux's T
    limit_source: Literal["max-length", "context-window", "aux-length"]
    length: int  # T: the tokens every text has after truncation and right-padding
    longest: int  # tokens of the longest text before truncation (special tokens included)
    truncated: int  # texts longer than the limit, cut by the tokenizer's own truncation
    padded: int  # texts shorter than T, padded with pad_id and masked out
    pad_id: int


class TextData(TypedDict):
    """Raw-text data files by role; a target split from the aux file has no entry of its own."""

    aux: NotRequired[TextFile]
    target: NotRequired[TextFile]


class Data(TypedDict):
    """The auxiliary (attacker's) and target (victims') data."""

    aux_path: str
    target_path: str | None
    n_aux: int
    n_target: int
    classes: int | None
    class_names: list[str] | None
    has_labels: bool
    has_attr: bool
    input_kind: InputKind  # the input space's kind (splitaudit.core.input_space): what the reports draw
    is_image: bool  # input_kind == "image"
    in_unit_range: bool
    sample_shape: list[int]
    text: NotRequired[TextData]  # raw text (.txt/.jsonl) tokenised by the audit


class LeakySample(TypedDict):
    """A target sample whose embedding carries the most Fisher information."""

    index: int
    dfil: float
    jacobian_sq_norm: float


class TraceCheck(TypedDict):
    """The run-time cross-check of the Jacobian traces against independent random products."""

    performed: bool
    reason: NotRequired[str]
    samples: NotRequired[int]
    probes_per_sample: NotRequired[int]
    mode: NotRequired[Literal["forward", "reverse", "finite-difference"]]
    method_sum: NotRequired[float]
    check_sum: NotRequired[float]
    check_stderr: NotRequired[float]
    tolerance: NotRequired[float]
    passed: NotRequired[bool]
    fd_step: NotRequired[float]


class FiniteDifference(TypedDict):
    """A black-box dFIL: central differences at step and coarse_step (= 4 step) on the same
    directions, their difference as the truncation error, and the pilot ladder that chose the step."""

    step: float
    coarse_step: float
    relative_error: float
    dfil_error: float
    bounded: bool
    pilot_steps: list[float]
    pilot_changes: list[float]


class Dfil(TypedDict):
    """Fisher information leakage per input dimension (Maeng et al., NeurIPS 2023)."""

    mean: float
    median: float
    max: float
    min: float
    stderr: float
    method: str
    exact: bool
    products_per_sample: int
    noise_sigma: float
    smoothing: float
    trace_over_d: float
    n_samples: int
    n_target: int
    leakiest: list[LeakySample]
    per_sample: list[float]
    per_sample_stderr: NotRequired[list[float]]
    target_index: list[int]
    notes: list[str]
    mean_ci: NotRequired[list[float]]
    ci_level: NotRequired[float]
    mean_upper: NotRequired[float]
    rtol: NotRequired[float]
    relative_stderr: NotRequired[float]
    jacobian_products: NotRequired[int]
    n_candidates: NotRequired[int]
    self_check: NotRequired[TraceCheck]
    approximate: NotRequired[bool]
    finite_difference: NotRequired[FiniteDifference]


class Prior(TypedDict):
    """The prior term J(pi)/d of the van Trees bound and its sanity checks."""

    method: Literal[tuple(PRIORS)]
    smoothing: float
    J_over_d: float
    J_over_d_used: float
    stderr: float
    valid: bool
    stam_limit: float | None
    gaussian_floor: float | None
    notes: list[str]
    details: dict[str, Any]


def _bounds_section() -> type:
    """The bounds section's TypedDict: each registered bound's key (at the upper end of E[dFIL]'s
    interval), its `_point` key (at the estimate) and the other numbers it declares, from
    registries.BOUNDS, so a new bound needs no line here; then the keys every run writes besides."""
    per_bound: dict[str, Any] = {}
    for bound in BOUNDS.values():
        per_bound[bound.key] = float
        per_bound.update(bound.number_keys)
        per_bound[f"{bound.key}_point"] = NotRequired[float]
    section = TypedDict(
        "Bounds",
        {
            **per_bound,
            "mean_guess_mse": float,
            "violated_by": list[str],
            "violation_causes": NotRequired[list[str]],
            "notes": list[str],
            "dfil_used": NotRequired[float],
        },
    )
    section.__doc__ = "Lower bounds on any attacker's reconstruction MSE per input dimension."
    return section


Bounds = _bounds_section()


class TokenStatement(TypedDict):
    """Token inputs: ceilings on any attacker's token accuracy and exact-sentence match from the
    information the noisy hidden states carry (generalised Fano; estimators/token_information.py)."""

    embedding_dim: int
    vocab_size: int
    noise_sigma: float
    hidden_coordinates: int
    samples: int
    information_nats: float
    information_nats_point: float
    position_blind_guess: list[float]
    sentence_blind_guess: float | None
    position_ceiling: list[float]
    token_accuracy_ceiling: float
    exact_match_ceiling: float
    informative_from_sigma: float | None
    assumptions: list[str]
    compared_with: list[str]
    violated_by: list[str]


def _calibration_section() -> type:
    """The calibration section's TypedDict: the gated bound's sigma (`sigma`, whether one exists and
    why), every other registered bound's `sigma_key`, each with its `_point` twin (at the estimate of
    E[dFIL]), from registries.BOUNDS; then what they were solved from."""
    others = {bound.sigma_key: float | None for bound in BOUNDS.values() if not bound.gated}
    at_estimate = {f"{bound.sigma_key}_point": NotRequired[float | None] for bound in BOUNDS.values()}
    section = TypedDict(
        "Calibration",
        {
            "target_mse": float,
            "target_source": str,
            "bound": Literal[GATED_BOUND.slug],
            "sigma": float | None,
            "feasible": bool,
            "reason": str,
            **others,
            "trace_over_d": float,
            "J_over_d": float,
            "smoothing": float,
            "trace_over_d_upper": NotRequired[float],
            **at_estimate,
            "sigma_basis": NotRequired[str],
        },
    )
    section.__doc__ = f"The noise sigma that makes the {GATED_BOUND.name} bound reach a target MSE."
    return section


Calibration = _calibration_section()


class BoundCheck(TypedDict):
    """A reconstruction attack's MSE against the van Trees bound."""

    van_trees_mse: float
    margin: float
    violated: bool


Metrics = dict[str, Union[float, dict[str, float]]]


class Series(TypedDict):
    """The report's words for a metric measured against a parameter (a dict-valued metric)."""

    title: str  # the section's heading and the chart's title
    key: str  # the table's first column: the parameter
    axis: str  # the chart's x axis: the parameter
    value: str  # the chart's y axis: the metric


# "raw-input": the baseline uses information the attacker does not get from the model (k-means or
# training from scratch on raw inputs): doing no better is the finding "no advantage", Zheng et al.'s
# (IJCAI 2024) perfect protection. "floor": what the attack reaches on its own (the mean guess, the
# majority class): ending worse means it did not learn, and measured nothing.
BaselineRole = Literal["raw-input", "floor"]
# An ok attack: leakage found (advantage > 0), no advantage (<= 0), or inconclusive (it did not learn).
Outcome = Literal["leakage", "no-advantage", "inconclusive"]


class Attack(TypedDict):
    """One attack's entry: skipped or failed with a reason, or ok with its numbers over seeds.
    Its words (title, baseline_name, series) travel with it so that a report renders from the
    result alone; reports written before they did fall back to the attack's name."""

    kind: Literal["label", "reconstruction"]
    title: NotRequired[str]
    baseline_name: NotRequired[str]  # what the baseline is, in words
    baseline_role: NotRequired[BaselineRole]  # what doing no better than the baseline means
    query_access_reference: NotRequired[str]  # the attack with query access on the same data, to set beside
    series: NotRequired[dict[str, Series]]  # words for its dict-valued metrics, by metric name
    assumptions: str
    primary_metric: str
    advantage_basis: NotRequired[str]
    status: Literal["ok", "skipped", "failed"]
    reason: str
    metrics: NotRequired[Metrics]
    metrics_std: NotRequired[Metrics]
    baseline: NotRequired[Metrics]
    baseline_std: NotRequired[Metrics]
    advantage: NotRequired[float]
    advantage_std: NotRequired[float]
    advantage_at: NotRequired[str]  # where the advantage is largest, when taken over a sweep (fine-tune: "k=1")
    seeds: NotRequired[list[int]]
    seconds: NotRequired[float]
    examples: NotRequired[list[dict[str, Any]]]
    details: NotRequired[dict[str, Any]]
    bound_check: NotRequired[BoundCheck]
    outcome: NotRequired[Outcome]  # an ok attack's reading (Attack.inconclusive_reason, attacks.base.outcome_of)
    # Why an ok attack did not learn (outcome "inconclusive"): worse than its floor baseline, or its own
    # training signal did not improve.
    failed_to_train: NotRequired[str]
    # When the seeds' spread is as wide as the distance to the baseline.
    spread_warning: NotRequired[str]


def outcome_of(advantage: float, inconclusive_reason: str) -> Outcome:
    """An ok attack's outcome: it did not learn (a reason is given), found leakage, or found none."""
    if inconclusive_reason:
        return "inconclusive"
    return "leakage" if advantage > 0 else "no-advantage"


def default_baseline_name(kind: str) -> str:
    """An attack's baseline in words when it declares none: the mean guess for reconstruction."""
    return "guessing the average input" if kind == "reconstruction" else "baseline"


CheckCause = Literal[
    "complete",
    "incomplete",
    "attack-inconclusive",
    "bound-met",
    "bound-missing",
    "bound-untrusted",
    "bound-approximate",
    "prior-untrusted",
    "bound-too-low",
    "attack-mse-met",
    "no-reconstruction-attack",
    "attack-mse-too-low",
    "advantage-within-cap",
    "advantage-too-high",
    "utility-loss-within-cap",
    "utility-loss-too-high",
    "utility-loss-missing",
    "no-recommendation",
    "baseline-same-inputs",
    "baseline-other-inputs",
    "regression-within",
    "regression-not-comparable",
    "regression-bound",
    "regression-leakage",
]
Severity = Literal["none", "note", "warning", "error"]


class GateCheck(TypedDict):
    """One pass/fail check, decided once by the gate: why it passed or failed, and how much it matters."""

    name: str
    passed: bool
    value: float | None
    threshold: float | None
    message: str
    cause: CheckCause
    severity: Severity


class BaselineAttack(TypedDict):
    """What the regression test reads of one attack of the baseline."""

    status: str | None
    outcome: str | None
    advantage: float | None
    advantage_se: float | None  # advantage_std / sqrt(seeds); None for one seed


class BaselineFile(TypedDict):
    role: str
    sha256: str


class Baseline(TypedDict):
    """--baseline: what the regression test reads of the earlier report (splitaudit.verdicts.regression),
    kept so that the gate is recomputable from this report alone."""

    source: str
    fingerprint: str | None
    files: list[BaselineFile]
    noise_sigma: float | None
    bound: float | None  # van_trees_mse_point (else van_trees_mse)
    bound_se: float | None
    attacks: dict[str, BaselineAttack]


class Gate(TypedDict):
    """The CI gate: the thresholds asked for and each check's verdict."""

    fail_under_mse: float | None
    fail_under_attack_mse: float | None
    max_advantage: float | None
    strict: bool  # --strict: every inconclusive attack fails the gate
    passed: bool
    reasons: list[str]
    checks: list[GateCheck]
    baseline: NotRequired[Baseline]  # --baseline: the earlier report's numbers the regression checks used


class Utility(TypedDict):
    """Task accuracy under the noise: the top model's, or a probe's (source), and its drop from sigma = 0."""

    source: Literal["top-model", "probe"]
    description: str
    noise_sigma: float
    status: Literal["ok", "skipped"]
    reason: str
    accuracy: float | None
    accuracy_std: float | None
    seeds: NotRequired[list[int]]
    clean_accuracy: NotRequired[float | None]
    loss: NotRequired[float | None]


InputRole = Literal["model", "model-external-data", "top-model", "aux", "target", "vocab", "config"]


class InputDigest(TypedDict):
    """One file (or folder) the audit read, by its SHA-256 (splitaudit.inputs.digests)."""

    role: InputRole
    path: str  # as given (external data: in the model's folder)
    kind: Literal["file", "folder"]
    sha256: str  # a folder's: over the sorted `sha256sum` lines of the files under it
    bytes: int
    files: NotRequired[int]  # a folder's file count
    location: NotRequired[str]  # ONNX external data: the name the graph gives, relative to the model's folder


class Provenance(TypedDict):
    """What was audited, by what, where, how and when (splitaudit.engine.provenance); `splitaudit
    verify` checks files against it."""

    fingerprint: str  # 12 hex digits over the files' roles and digests and splitaudit's version
    files: list[InputDigest]
    in_memory: list[str]  # inputs given in memory (Python API): no file to verify
    versions: dict[str, str | None]
    converter: str | None  # the converter whose module was audited (ONNX), None for none
    platform: str
    device: str
    device_name: str
    seed: int
    seeds: list[int]
    options: dict[str, Any]
    command_line: list[str] | None  # None from the Python API
    started: str
    ended: str


class Result(TypedDict):
    """A splitaudit report: everything the HTML, Markdown, SARIF and terminal outputs show."""

    schema_version: Literal[SCHEMA_VERSION]
    tool: Tool
    run: Run
    model: Model
    data: Data
    noise_sigma: float
    dfil: Dfil
    prior: Prior
    bounds: Bounds
    calibration: Calibration
    attacks: dict[str, Attack]
    gate: Gate
    utility: NotRequired[Utility]
    tokens: NotRequired[TokenStatement]
    provenance: NotRequired[Provenance]


# --- sweep.json (splitaudit sweep) ----------------------------------------------------------


class SweepRun(Run):
    """The run, and where its audit points were computed."""

    executor: str


class InversionComparison(TypedDict):
    """Token bottoms: the sequential inversion's token accuracy against the learned inversion's at one
    sigma; weaker when the learned one is higher by more than the margin (1.96 standard errors of the
    difference), with what in the sequential search explains it."""

    sequential: float
    learned: float
    margin: float
    sequential_sentences: int
    learned_sentences: int
    weaker: bool
    reasons: list[str]


class SweepPoint(TypedDict):
    """One audited noise sigma: its sections as in report.json, and where the sigma came from."""

    noise_sigma: float
    origin: Literal["grid", "calibrated", "around-calibrated"]
    dfil: Dfil
    bounds: Bounds
    attacks: dict[str, Attack]
    utility: Utility
    inversions: NotRequired[InversionComparison]  # where both sequential and learned inversion ran


class AutoSigma(TypedDict):
    """--auto-sigma: the calibrated sigma added to the grid (None when none reaches the target)."""

    requested: bool
    sigma: float | None
    factors: list[float]
    reason: str


class Recommendation(TypedDict):
    """The smallest audited sigma whose van Trees bound reaches the target and that no attack beats."""

    target_mse: float
    max_utility_loss: float | None
    noise_sigma: float | None
    point_index: int | None
    van_trees_mse: float | None
    utility_loss: float | None
    meets_utility: bool | None
    reason: str


class SweepGate(Gate):
    """The gate of a sweep: the run's thresholds at the recommended sigma, and the utility cap."""

    max_utility_loss: float | None


class Sweep(TypedDict):
    """A splitaudit sweep (sweep.json): one audit point per noise sigma and a recommended sigma."""

    schema_version: Literal[SCHEMA_VERSION]
    kind: Literal["sweep"]
    tool: Tool
    run: SweepRun
    model: Model
    data: Data
    noise_sigmas: list[float]
    auto_sigma: AutoSigma
    target_mse: float
    target_source: str
    max_utility_loss: float | None
    prior: Prior
    calibration: Calibration
    utility_clean: Utility
    points: list[SweepPoint]
    recommendation: Recommendation
    gate: SweepGate
    provenance: NotRequired[Provenance]


@lru_cache(maxsize=1)
def sweep_json_schema() -> dict:
    """The JSON Schema of sweep.json, generated from `Sweep` (sweep.json is checked against it
    when written and read; `splitaudit schema` prints report.json's)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"splitaudit sweep.json, schema_version {SCHEMA_VERSION}",
        **_schema_of(Sweep),
    }


# --- cuts.json (splitaudit cuts) ------------------------------------------------------------


class CandidateCut(TypedDict):
    """A tensor every input-to-output path of the whole model passes through, and the client's cost there."""

    name: str
    op: str  # the operator that writes it
    depth: int  # its writer's index in the graph's node order
    flops: int
    params: int


class WholeModel(TypedDict):
    """The whole model that was cut, and every candidate cut found in its graph."""

    path: str
    format: Literal["onnx", "exported"]  # exported: a torch.export program, cut in its graph written as ONNX
    input_name: str
    output_name: str
    input_shape: list[int]
    params: int
    flops: int  # 2 x multiply-accumulates of Conv, ConvTranspose, MatMul, Gemm per sample
    candidates: list[CandidateCut]


class BottomModel(TypedDict):
    """How the bottom at a cut loaded (as report.json's model section says it)."""

    gradient_mode: Literal["autograd", "finite-difference"]
    parity_max_abs_err: float | None
    warnings: list[str]


class WholeAccuracy(TypedDict):
    """The whole model's accuracy on the labelled target data, by onnxruntime."""

    status: Literal["ok", "skipped"]
    accuracy: float | None
    n: int
    reason: str


class Cut(TypedDict):
    """One audited cut: where it is, what the client pays there, and an audit point of its bottom."""

    name: str
    op: str
    depth: int
    shape: list[int]  # the embedding's per-sample shape
    params: int  # the bottom's weights
    flops: int  # the bottom's 2 x multiply-accumulates per sample
    bytes_sent: int  # per sample, float32
    parity_max_abs_err: float  # bottom then top against the whole model, by onnxruntime
    sigma_source: Literal["calibrated", "--noise-sigma", "uncalibrated"]
    noise_sigma: float
    dfil: Dfil
    bounds: Bounds
    calibration: Calibration
    attacks: dict[str, Attack]
    utility: Utility
    bottom: BottomModel
    seconds: float


class CutRecommendation(TypedDict):
    """The qualifying cut with the fewest client FLOPs (bound reached, unbeaten, accuracy loss in budget)."""

    target_mse: float
    max_accuracy_loss: float
    cut: str | None
    cut_index: int | None
    noise_sigma: float | None
    van_trees_mse: float | None
    accuracy_loss: float | None
    flops: int | None
    reason: str


class CutTaskRecord(TypedDict):
    """One cut as a task of the executor: where it ran and its wall time."""

    cut: str
    seconds: float
    attempts: int
    worker: str


class CutsRun(Run):
    """The run, and where its cuts were audited (each cut one task; its attacks and dFIL ran in that task)."""

    cut_tasks: NotRequired[list[CutTaskRecord]]


class Cuts(TypedDict):
    """A splitaudit cuts audit (cuts.json): one audit per cut of a whole model and a recommended cut."""

    schema_version: Literal[SCHEMA_VERSION]
    kind: Literal["cuts"]
    tool: Tool
    run: CutsRun
    model: WholeModel
    data: Data
    target_mse: float
    target_source: str
    max_accuracy_loss: float
    noise_sigma: float | None  # --noise-sigma, or None: each cut at its calibrated sigma
    prior: Prior
    whole_accuracy: WholeAccuracy
    cuts: list[Cut]
    recommendation: CutRecommendation
    gate: Gate
    provenance: NotRequired[Provenance]  # the whole model's and the data's digests (absent from older cuts.json)


@lru_cache(maxsize=1)
def cuts_json_schema() -> dict:
    """The JSON Schema of cuts.json, generated from `Cuts` (checked when written and read)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"splitaudit cuts.json, schema_version {SCHEMA_VERSION}",
        **_schema_of(Cuts),
    }


def schema_of_kind(kind) -> dict:
    """The schema a stored document of this `kind` is checked against (report.json's when it has none)."""
    return resolve(result_kind({"kind": kind}).schema)()


# --- JSON Schema ---------------------------------------------------------------------------
# A small generator over the typing constructs used above (about 40 lines) instead of a
# library such as pydantic: it encodes report.json's non-finite numbers as one flat
# {"type": [...], "pattern": ...} rule, so that a wrong value gets a one-level error.


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of report.json, generated from `Result`."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"splitaudit report.json, schema_version {SCHEMA_VERSION}",
        **_schema_of(Result),
    }


def _schema_of(tp: Any) -> dict:
    if tp is Any:
        return {}
    if _is_typed_dict(tp):
        return _object_schema(tp)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return {"enum": list(args)}
    if origin is list:
        return {"type": "array", "items": _schema_of(args[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema_of(args[1])}
    if origin in (Union, types.UnionType):
        return _union_schema(args)
    return _scalar_schema(tp)


def _scalar_schema(tp: Any) -> dict:
    if tp is float:  # a number, or a non-finite one stored as a string
        return {"type": ["number", "string"], "pattern": NON_FINITE_PATTERN}
    names = {bool: "boolean", int: "integer", str: "string", type(None): "null"}
    if tp not in names:
        raise TypeError(f"no JSON Schema for {tp!r}")
    return {"type": names[tp]}


def _union_schema(args: tuple) -> dict:
    """X | None stays flat for scalars (one error message); other unions become anyOf."""
    parts = [_schema_of(a) for a in args]
    if all(set(p) <= {"type", "pattern"} for p in parts):
        merged: list[str] = []
        for p in parts:
            merged += [t for t in ([p["type"]] if isinstance(p["type"], str) else p["type"]) if t not in merged]
        patterns = {p["pattern"] for p in parts if "pattern" in p}
        return {"type": merged, **({"pattern": patterns.pop()} if len(patterns) == 1 else {})}
    return {"anyOf": parts}


def _object_schema(td: type) -> dict:
    hints = get_type_hints(td, include_extras=True)
    properties = {key: _schema_of(_strip_not_required(tp)) for key, tp in hints.items()}
    schema = {
        "type": "object",
        "properties": properties,
        "required": sorted(td.__required_keys__),
        "additionalProperties": False,
    }
    return {"description": " ".join((td.__doc__ or "").split()), **schema} if td.__doc__ else schema


def _strip_not_required(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is NotRequired else tp


def _is_typed_dict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


@lru_cache(maxsize=1)
def shipped_schema() -> dict:
    """The schema file installed with the package (a test keeps it equal to json_schema())."""
    return json.loads(files("splitaudit").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


# --- validation ---------------------------------------------------------------------------


def first_error(document: Any, schema: dict | None = None) -> str | None:
    """The first place where a report.json document (as stored: strict JSON) breaks the schema
    (report.json's unless another is given), as "/json/pointer: what was expected", or None."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    error = best_match(Draft202012Validator(schema or shipped_schema()).iter_errors(document))
    if error is None:
        return None
    pointer = "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in error.absolute_path)
    return f"{pointer}: {_expected(error)}"


def _expected(error) -> str:
    """A short reason in the reader's words, not the validator's."""
    value = error.validator_value
    if error.validator == "type":
        wanted = [value] if isinstance(value, str) else list(value)
        if "pattern" in error.schema:  # a number field: its strings are only "inf", "-inf", "nan"
            wanted.remove("string")
        return "expected " + " or ".join(wanted)
    if error.validator == "pattern":
        return f"expected number, got {error.instance!r}"
    if error.validator == "enum":
        return "expected one of " + ", ".join(json.dumps(v) for v in value)
    if error.validator == "required":
        return error.message.replace("is a required property", "is missing")
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return "unexpected key " + ", ".join(repr(k) for k in extra)
    return error.message


# --- older versions ------------------------------------------------------------------------

V5_RAW_INPUT_BASELINES = ("fine-tune", "kmeans")  # schema 5 stored no baseline_role
V5_WORSE_THAN_BASELINE = "it did worse than its baseline"  # schema 5's reason for any attack below its baseline


def upgraded(document: Any) -> Any:
    """A stored report.json or sweep.json of an older READABLE_VERSIONS version in the current shape,
    so that render and compare read it (anything else is returned as it is, for the schema to judge)."""
    if not isinstance(document, dict) or document.get("schema_version") != 5:
        return document
    document = json.loads(json.dumps(document))  # a copy: the caller's document stays as stored
    for attacks in [document.get("attacks")] + [p.get("attacks") for p in document.get("points") or []]:
        for name, entry in (attacks or {}).items():
            if isinstance(entry, dict) and entry.get("status") == "ok":
                _attack_from_v5(name, entry)
    gate = document.get("gate")
    if isinstance(gate, dict):  # readers decide it anew (reports.consistency.regated); here it only validates
        gate.setdefault("strict", False)
        for check in gate.get("checks") or []:
            if isinstance(check, dict) and check.get("cause") == "attack-failed-to-train":
                check["cause"] = "attack-inconclusive"
    document["schema_version"] = SCHEMA_VERSION
    return document


def _attack_from_v5(name: str, entry: dict) -> None:
    """Schema 5 called a raw-input baseline beaten a failure to train; it is the finding "no advantage"."""
    role = "raw-input" if name in V5_RAW_INPUT_BASELINES else "floor"
    reasons = [r for r in str(entry.get("failed_to_train", "")).split("; ") if r]
    if role == "raw-input":
        reasons = [r for r in reasons if not r.startswith(V5_WORSE_THAN_BASELINE)]
    entry.pop("failed_to_train", None)
    if reasons:
        entry["failed_to_train"] = "; ".join(reasons)
    entry["baseline_role"] = role
    advantage = entry.get("advantage")
    entry["outcome"] = outcome_of(advantage if isinstance(advantage, (int, float)) else 0.0, "; ".join(reasons))


if __name__ == "__main__":  # python -m splitaudit.core.result > audit/report.schema.json
    print(json.dumps(json_schema(), indent=1))
