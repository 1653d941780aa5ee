"""`splitaudit cuts`: audit every candidate split point of a whole model and recommend one.

The whole ONNX model's candidate cuts (splitaudit.inputs.onnx_cuts: the tensors every input-to-output
path passes through) are chosen; then, before any cut runs, what every cut shares is prepared once
beside the first cut's bottom: the data loaded and split, the whole model's accuracy, the cost
estimate (printed up front) and the prior term (it depends on the input data only). Each cut is
then one task on the executor (splitaudit.engine.cut_tasks: in this process, on `--workers N` local
processes, or on Ray), which cuts the model there, checks bottom then top against the whole model
and audits the bottom with `run`'s engine; a line is printed as each cut finishes. A worker holds
one cut at a time, so memory is that of the largest single cut's audit, not of all of them. The
recommendation and the gate (splitaudit.verdicts.recommend_cut) read only the cuts' numbers; the
provenance section records the whole model and the data, as report.json's does.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from splitaudit.context.audit_context import AuditContext, silent_progress
from splitaudit.core.config import DEFAULT_CUTS, AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.safety import require_regular_file
from splitaudit.engine.cut_tasks import (
    CutRefused,
    CutsRecipe,
    CutsWorkspace,
    CutTask,
    cut_options,
    input_dtype,
    model_inputs,
    write_halves,
)
from splitaudit.engine.pipeline import AuditEngine, SplitData, describe_data, describe_run, prepare_audit
from splitaudit.engine.provenance import Invocation, provenance_section
from splitaudit.engine.sweep import target_source
from splitaudit.estimators.prior import PriorEstimate
from splitaudit.execution.executor import local_workers, open_backend
from splitaudit.execution.tasks import TaskResult
from splitaudit.inputs.digests import InputFiles
from splitaudit.inputs.model_format import loader_for
from splitaudit.inputs.onnx_cuts import (
    CutPoint,
    WholeModel,
    candidate_cuts,
    load_whole_proto,
    open_whole_model,
    run_onnx,
    samples_per_batch,
    select_cuts,
    total_parameters,
)
from splitaudit.stages.cost import Clocks, CostEstimate, duration
from splitaudit.stages.leakage import prior_section, prior_term
from splitaudit.stages.utility import label_indices
from splitaudit.verdicts.gate import thresholds_of
from splitaudit.verdicts.recommend_cut import cuts_gate, recommend_cut

KIND = "cuts"

OPENING = "opening the bottom"  # a cut estimate's stage: its bottom written, converted and checked


@dataclass
class Preparation:
    """What every cut shares, prepared once before the first cut runs."""

    header: dict
    data: SplitData
    prior: PriorEstimate | None  # estimated last, after the plan is said
    whole_accuracy: dict
    device: torch.device
    workers: int  # local worker processes (1: every cut in this process)
    seeds: list[int]
    converter: str | None


def run_cuts(
    options: AuditOptions,
    progress: Callable[..., tqdm] = silent_progress,
    on_cost: Callable[[str], None] | None = None,
    invocation: Invocation | None = None,
) -> dict:
    """The whole cuts audit: cuts.json's content (candidates, one audit per chosen cut, the
    recommendation, the gate and the provenance) for validated `options` (AuditOptions.validate).
    on_cost receives the plan with its cost estimate before anything slow runs, then a line as
    each cut finishes."""
    started = datetime.now(timezone.utc)
    clock = time.perf_counter()
    invocation = invocation or Invocation()
    say = on_cost or (lambda _line: None)
    inputs = InputFiles.before_loading(options, invocation.config_file)
    with tempfile.TemporaryDirectory(prefix="splitaudit-cuts-") as folder:
        whole, check = _whole_model(options, Path(folder))
        candidates = candidate_cuts(whole)
        if not candidates:
            raise InputError(
                f"{options.model}: no tensor lies on every path from the input to the output: nothing to cut"
            )
        chosen = select_cuts(candidates, options.cuts, DEFAULT_CUTS)
        prepared = _prepare(options, whole, check, candidates, chosen, Path(folder), progress, say, started)
        inputs.hash_all()
        entries, executed = _audit_cuts(options, whole, prepared, chosen, progress, say)
    inputs.confirm_unchanged()
    calibration = entries[0]["calibration"]
    target = calibration["target_mse"]
    header = prepared.header
    document = {
        **header,
        "run": {**header["run"], **executed},
        "target_mse": target,
        "target_source": target_source(options, calibration),
        "max_accuracy_loss": options.max_accuracy_loss,
        "noise_sigma": options.cut_noise_sigma,
        "prior": prior_section(prepared.prior),
        "whole_accuracy": prepared.whole_accuracy,
        "cuts": entries,
        "recommendation": recommend_cut(entries, target, options.max_accuracy_loss),
        "provenance": provenance_section(
            options, inputs.records, prepared.device, prepared.seeds, prepared.converter, invocation, started
        ),
    }
    gate = cuts_gate(document, **thresholds_of(options))
    return {**document, "gate": gate, "run": {**document["run"], "seconds": time.perf_counter() - clock}}


def measure_cuts_again(options: AuditOptions, document: dict, config: str | None) -> list[tuple[dict, float]]:
    """Each cut recorded in a cuts.json `document`: its mean dFIL at its sigma measured again from the
    files (`verify --recompute`): the whole model cut again at the recorded names, the data loaded once beside the
    first, the prior term estimated once (the measurement carries it; the dFIL does not use it)."""
    measured, data, prior = [], None, None
    with tempfile.TemporaryDirectory(prefix="splitaudit-cuts-") as folder:
        whole, _ = _whole_model(options, Path(folder))
        candidates = {cut.name: cut for cut in candidate_cuts(whole)}
        for entry in document["cuts"]:
            if entry["name"] not in candidates:
                raise InputError(f"the report's cut {entry['name']!r} is not a candidate cut of this model")
            with tempfile.TemporaryDirectory(dir=folder) as halves:
                _, _, bottom, top = write_halves(whole, candidates[entry["name"]], Path(halves))
                with AuditEngine.prepared(
                    cut_options(options, bottom, top), attacks=False, config_file=config, data=data
                ) as engine:
                    data = data or (engine.ctx.aux, engine.ctx.target)
                    prior = prior or prior_term(engine.ctx, options.prior, options.smoothing)
                    engine.known_prior = prior
                    measured.append((entry, engine.assess(entry["noise_sigma"])["dfil"]["mean"]))
    return measured


def _whole_model(options: AuditOptions, folder: Path):
    """The whole model's graph, and its loader's check that the graph computes what the file does
    (WholeGraph.check; None where the file is the graph): its format's loader writes it as ONNX in
    `folder` where it is not ONNX, and the check runs on the data."""
    path = Path(options.model)
    loader = loader_for(path)
    graph = loader.whole_graph(path, folder)  # a format that keeps no graph says so here
    require_regular_file(graph.path, "model file")
    whole = open_whole_model(graph.path, _sample_shape(replace(options, model=str(graph.path))), options.output_name)
    whole.format = loader.format.name
    return whole, graph.check


def _sample_shape(options: AuditOptions) -> tuple[int, ...]:
    """One sample's shape: --input-shape, else the model's declared input, else the .npz data's x."""
    if options.input_shape:
        return tuple(options.input_shape)
    proto = load_whole_proto(Path(options.model), external_data=False)  # the input's shape needs no weights
    weights = {i.name for i in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in weights]
    dims = (
        [d.dim_value if d.HasField("dim_value") else 0 for d in inputs[0].type.tensor_type.shape.dim] if inputs else []
    )
    if dims and all(d > 0 for d in dims[1:]):
        return tuple(dims[1:])
    shape = _npz_sample_shape(options.aux) if str(options.aux).endswith(".npz") else None
    if shape is None:
        raise InputError("the model's input has sizes set at run time: give one sample's shape with --input-shape")
    return shape


def _npz_sample_shape(path: str) -> tuple[int, ...] | None:
    """The per-sample shape of the .npz's x, from its header alone (nothing is allocated; the data
    loader checks the file in full later)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive, archive.open("x.npy") as stream:
            version = np.lib.format.read_magic(stream)
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape = reader(stream)[0]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None  # the data loader names what is wrong with the file
    return tuple(int(d) for d in shape[1:])


def _prepare(
    options: AuditOptions,
    whole: WholeModel,
    check: Callable[[np.ndarray, np.ndarray], object] | None,
    candidates: list[CutPoint],
    chosen: list[CutPoint],
    folder: Path,
    progress: Callable[..., tqdm],
    say: Callable[[str], None],
    started: datetime,
) -> Preparation:
    """What every cut shares, from the data loaded once beside the first cut's bottom: the graph
    checked against the file it was written from (a .pt2's program), the whole model's accuracy, the plan and its cost estimate
    (timed on each chosen bottom, one context at a time, and said before anything slow), then the
    prior term. No bottom's context outlives this (each cut builds its own)."""
    clocks = Clocks()
    (ctx, names), opening = clocks.timed(partial(_opened_bottom, options, whole, chosen[0], folder, progress))
    if check is not None:  # the graph that is cut was written from the file
        x = model_inputs(ctx).astype(input_dtype(whole), copy=False)
        check(x, run_onnx(whole.proto, x))
    workers = local_workers(options.workers, ctx) if options.executor == "local" else 0
    data = ctx.aux.to("cpu"), ctx.target.to("cpu")
    prepared = Preparation(
        header=_header(ctx, options, whole, candidates, started),
        data=data,
        prior=None,
        whole_accuracy=whole_accuracy(whole, ctx),
        device=ctx.device,
        workers=max(1, workers),
        seeds=ctx.seeds,
        converter=ctx.encoder.converter,
    )
    estimates = [_cut_estimate(ctx, options, names, opening)]  # its opening counts the data's loading too
    for cut in chosen[1:] if estimates[0] else []:
        del ctx  # one bottom's context at a time
        with tempfile.TemporaryDirectory(dir=folder) as halves:
            opened = partial(_opened_bottom, options, whole, cut, Path(halves), silent_progress, data)
            (ctx, _), opening = clocks.timed(opened)
        estimates.append(_cut_estimate(ctx, options, names, opening))
    say(_plan_words(chosen, len(candidates), workers, estimates if estimates[0] else None))
    prepared.prior = prior_term(ctx, options.prior, options.smoothing)  # any cut's context: it reads the data alone
    return prepared


def _opened_bottom(
    options: AuditOptions,
    whole: WholeModel,
    cut: CutPoint,
    folder: Path,
    progress: Callable[..., tqdm],
    data: SplitData | None = None,
) -> tuple[AuditContext, list[str]]:
    """The cut's halves written in `folder` and its bottom opened as an audit's context (on `data`
    when given, else the data loaded), with the selected attacks."""
    _, _, bottom, top = write_halves(whole, cut, folder)
    return prepare_audit(cut_options(options, bottom, top), progress, data)


def _audit_cuts(
    options: AuditOptions,
    whole: WholeModel,
    prepared: Preparation,
    chosen: list[CutPoint],
    progress: Callable[..., tqdm],
    say: Callable[[str], None],
) -> tuple[list[dict], dict]:
    """Every chosen cut as a task on the executor, in cut order, and the run section's executor keys.
    A refused cut (bad input) or a failed one stops the run at once."""
    space = CutsWorkspace(options, whole, prepared.data, prepared.prior, progress=progress)

    def recipe() -> CutsRecipe:
        return CutsRecipe(options, whole, *prepared.data, prepared.prior)

    executor = open_backend(options.executor, options, recipe, prepared.device, prepared.workers, None)
    try:
        with progress(total=len(chosen), desc=f"cuts ({executor.name})", unit="cut") as bar:
            results = executor.map(space, [CutTask(cut) for cut in chosen], bar, _reporter(say, len(chosen)))
    finally:
        executor.close()
    executed = {"executor": executor.name, "workers": executor.workers, "cut_tasks": [_record(r) for r in results]}
    return [r.outcome for r in results], executed


def _reporter(say: Callable[[str], None], count: int) -> Callable[[TaskResult], list]:
    """The executor's follow-up: a line as each cut finishes; a refused cut raises InputError (exit 2),
    a failed one RuntimeError (exit 3), which stops the executor before the other cuts run."""
    done: list[str] = []

    def finished(result: TaskResult) -> list:
        name = result.task.cut.name
        if result.error is not None:
            raise RuntimeError(f"cut {name!r} failed after {result.attempts} attempt(s): {result.error}")
        if isinstance(result.outcome, CutRefused):
            raise InputError(result.outcome.message)
        done.append(name)
        say(f"cut {len(done)} of {count} done in {duration(result.seconds)}: {name} ({_cut_words(result.outcome)})")
        return []

    return finished


def _cut_words(entry: dict) -> str:
    """A finished cut's headline numbers."""
    accuracy = entry["utility"].get("accuracy")
    return (
        f"noise sigma {entry['noise_sigma']:.4g} ({entry['sigma_source']}), van Trees bound "
        f"{entry['bounds']['van_trees_mse']:.4g}, accuracy {'n/a' if accuracy is None else f'{accuracy:.3g}'}"
    )


def _record(result: TaskResult) -> dict:
    """A cut task's line in the run section: which cut, where it ran and how long it took."""
    return {
        "cut": result.task.cut.name,
        "seconds": result.seconds,
        "attempts": result.attempts,
        "worker": result.worker,
    }


def whole_accuracy(whole: WholeModel, ctx: AuditContext) -> dict:
    """The whole model's accuracy on the labelled target data (argmax of its output), by onnxruntime.
    InputError for a model that does not end in the labels' class scores, before any cut is audited:
    every cut's top is then no classifier, and its utility (the accuracy it loses to the noise) has no
    meaning."""
    if ctx.target.y is None:
        return {"status": "skipped", "accuracy": None, "n": len(ctx.target), "reason": "the data has no labels"}
    x = model_inputs(ctx, None).astype(input_dtype(whole), copy=False)
    scores = run_onnx(whole.proto, x, batch=samples_per_batch(whole))
    if scores.ndim != 2 or scores.shape[1] < (ctx.num_classes or 0):
        raise InputError(
            f"splitaudit cuts takes a whole classifier: this model's output has shape {tuple(scores.shape[1:])} per "
            f"sample, not scores for the data's {ctx.num_classes} classes (cut the model that ends in its class scores)"
        )
    hits = scores.argmax(1) == label_indices(ctx.target).cpu().numpy()
    return {"status": "ok", "accuracy": float(hits.mean()), "n": len(x), "reason": ""}


def _cut_estimate(
    ctx: AuditContext, options: AuditOptions, names: list[str], opening_seconds: float
) -> CostEstimate | None:
    """A cut's cost estimate (stages/cost.py) timed on its bottom, when the data is large enough to be
    worth it, with what opening its bottom took (CPU seconds per thread, as the estimate counts them):
    each cut's task opens it again."""
    from splitaudit.stages import leakage
    from splitaudit.stages.cost import estimate_cost, worth_estimating

    if not worth_estimating(ctx):
        return None
    smoothing = leakage.resolve_smoothing(ctx, options.smoothing)
    estimate = estimate_cost(ctx, options.prior, smoothing, names, options.dfil_samples, dfil_rtol=options.dfil_rtol)
    estimate.stages[OPENING] = opening_seconds
    return estimate


def _plan_words(chosen: list[CutPoint], count: int, workers: int, estimates: list[CostEstimate] | None) -> str:
    """The plan before anything slow runs: which cuts, where, and what they may cost: each cut's
    stages timed on its bottom, the prior trained once, the cuts shared out over the workers."""
    where = f"in {workers} local worker processes" if workers > 1 else "in this process" if workers else "on Ray"
    plan = f"auditing {len(chosen)} of {count} candidate cuts {where}: {', '.join(c.name for c in chosen)}"
    if not estimates:
        return f"{plan}; small data, so no cost estimate (each cut takes seconds)"
    prior = sum(v for k, v in estimates[0].stages.items() if k.startswith("prior"))
    per_cut = [e.total - sum(v for k, v in e.stages.items() if k.startswith("prior")) for e in estimates]
    total = prior + max(max(per_cut), sum(per_cut) / max(workers, 1))  # the dearest cut alone, or the work shared
    load = f" (at this load about {duration(total / min(e.share for e in estimates))})"
    left_out = sorted({name for e in estimates for name in e.not_estimated})
    return (
        f"{plan}; timed on each bottom: the prior about {duration(prior)} (trained once), the cuts "
        f"{', '.join(duration(s) for s in per_cut)} (opening its bottom, dFIL and attacks), so about "
        f"{duration(total)} in all"
        f"{load if any(e.busy for e in estimates) else ''}{'; not estimated: ' + ', '.join(left_out) if left_out else ''}"
    )


def _header(
    ctx: AuditContext, options: AuditOptions, whole: WholeModel, candidates: list[CutPoint], started: datetime
) -> dict:
    """cuts.json's tool, run, model (the whole model and its candidates) and data sections."""
    header = describe_run(ctx, options, started)
    del header["noise_sigma"]
    header["kind"] = KIND
    header["model"] = {
        "path": str(options.model),
        "format": whole.format,
        "input_name": whole.input_name,
        "output_name": whole.output_name,
        "input_shape": list(whole.shapes[whole.input_name][1:]),
        "params": total_parameters(whole.proto),
        "flops": 2 * sum(whole.macs),
        "candidates": [
            {"name": c.name, "op": c.op, "depth": c.depth, "flops": c.flops, "params": c.params} for c in candidates
        ],
    }
    header["data"] = describe_data(ctx, options)
    return header
