"""`splitaudit cuts`: audit every candidate split point of a whole model and recommend one.

The whole ONNX model's candidate cuts (splitaudit.inputs.onnx_cuts: the tensors every input-to-output
path passes through) are cut into a bottom (input -> cut) and the real top (cut -> output), written
to a private temporary folder, and checked: bottom then top must give the whole model's output on
the data. Each bottom is then audited by the engine `run` uses (pipeline.AuditEngine: the loader's
autograd parity, the traces' runtime cross-check, their intervals), at `--noise-sigma` or at the
sigma calibrated for the target, with the real top's accuracy on the noisy embeddings as the
utility. The prior term depends on the input data only, so it is estimated once and shared.

Cuts run one after the other (each opens its own context and executor, so memory holds one cut at
a time); within a cut, the dFIL shards and the attack seeds run as tasks on the executor, as in
`run`. The recommendation and the gate (splitaudit.stages.recommend_cut) read only the cuts' numbers.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from splitaudit.core.config import DEFAULT_CUTS, AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.engine.pipeline import AuditEngine, describe_data, describe_run
from splitaudit.engine.sweep import target_source
from splitaudit.inputs.context import AuditContext, silent_progress
from splitaudit.inputs.exported_loading import is_exported_archive
from splitaudit.inputs.exported_whole import check_conversion, exported_as_onnx
from splitaudit.inputs.onnx_cuts import (
    CutPoint,
    WholeModel,
    candidate_cuts,
    open_whole_model,
    run_onnx,
    select_cuts,
    split_at,
    total_parameters,
)
from splitaudit.stages.gate import thresholds_of
from splitaudit.stages.recommend_cut import cuts_gate, recommend_cut
from splitaudit.stages.utility import label_indices

KIND = "cuts"
PARITY_SAMPLES = 64  # target samples bottom-then-top is compared with the whole model on
PARITY_RTOL = 1e-4  # of the whole model's largest output: float32 kernels may order sums differently per graph
PREDICT_BATCH = 256
CUT_KEYS = ("noise_sigma", "dfil", "bounds", "calibration", "attacks", "utility")  # an audit point's sections kept


def run_cuts(
    options: AuditOptions,
    progress: Callable[..., tqdm] = silent_progress,
    on_cost: Callable[[str], None] | None = None,
) -> dict:
    """The whole cuts audit: cuts.json's content (candidates, one audit per chosen cut, the
    recommendation and the gate). on_cost receives the up-front estimate and each cut's start."""
    started = datetime.now(timezone.utc)
    clock = time.perf_counter()
    options.validate()
    say = on_cost or (lambda _line: None)
    entries, header, shared = [], None, {}
    with tempfile.TemporaryDirectory(prefix="splitaudit-cuts-") as folder:
        whole = _whole_model(options, Path(folder), shared)
        candidates = candidate_cuts(whole)
        if not candidates:
            raise InputError(
                f"{options.model}: no tensor lies on every path from the input to the output: nothing to cut"
            )
        chosen = select_cuts(candidates, options.cuts, DEFAULT_CUTS)
        names = ", ".join(c.name for c in chosen)
        say(f"auditing {len(chosen)} of {len(candidates)} candidate cuts, one after the other: {names}")
        with progress(total=len(chosen), desc="cuts", unit="cut") as bar:
            for index, cut in enumerate(chosen):
                bar.set_postfix_str(cut.name[:40])
                entry, context = _audit_cut(options, whole, cut, index, Path(folder), shared, progress)
                if header is None:
                    header = _header(context, options, whole, candidates, started, shared)
                    say(_estimate_words(shared, len(chosen)))
                entries.append(entry)
                bar.update()
    target = shared["calibration"]["target_mse"]
    document = {
        **header,
        "target_mse": target,
        "target_source": target_source(options, shared["calibration"]),
        "max_accuracy_loss": options.max_accuracy_loss,
        "noise_sigma": options.cut_noise_sigma,
        "prior": shared["prior"],
        "whole_accuracy": shared["whole_accuracy"],
        "cuts": entries,
        "recommendation": recommend_cut(entries, target, options.max_accuracy_loss),
    }
    gate = cuts_gate(document, **thresholds_of(options))
    return {**document, "gate": gate, "run": {**document["run"], "seconds": time.perf_counter() - clock}}


def _whole_model(options: AuditOptions, folder: Path, shared: dict) -> WholeModel:
    """The whole model's graph: the ONNX file, or a torch.export program written as ONNX in `folder`
    (shared["program"] keeps the program, to check the graph against it on the data)."""
    path = Path(options.model)
    if is_exported_archive(path):
        onnx_path, shared["program"] = exported_as_onnx(path, folder)
        whole = open_whole_model(onnx_path, _sample_shape(replace(options, model=str(onnx_path))), options.output_name)
        whole.format = "exported"
        return whole
    return open_whole_model(path, _sample_shape(options), options.output_name)


def _sample_shape(options: AuditOptions) -> tuple[int, ...]:
    """One sample's shape: --input-shape, else the model's declared input, else the .npz data's x."""
    if options.input_shape:
        return tuple(options.input_shape)
    import onnx

    proto = onnx.load(str(options.model), load_external_data=False)
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


def _audit_cut(
    options: AuditOptions, whole: WholeModel, cut: CutPoint, index: int, folder: Path, shared: dict, progress
) -> tuple[dict, AuditContext]:
    """One cut: its halves written and checked against the whole model, its bottom audited at its sigma."""
    import onnx

    bottom, top = split_at(whole, cut)
    paths = folder / f"cut{index}_bottom.onnx", folder / f"cut{index}_top.onnx"
    for half, path in zip((bottom, top), paths):
        onnx.save(half, str(path))
    cut_options = replace(options, model=str(paths[0]), top_model=str(paths[1]), output_name=None, noise_sigma=0.0)
    clock = time.perf_counter()
    with AuditEngine.prepared(cut_options, progress) as engine:
        ctx = engine.ctx
        parity = check_halves(whole, bottom, top, _model_inputs(ctx), cut.name)
        if "prior" not in shared:
            if "program" in shared:  # the graph that was cut is the program's
                x = _model_inputs(ctx).astype(_input_dtype(whole), copy=False)
                check_conversion(shared["program"], run_onnx(whole.proto, x), x)
            shared["whole_accuracy"] = whole_accuracy(whole, ctx)
        else:
            engine.known_prior = shared["prior_estimate"]
        assessed = engine.assess(0.0, options.target_mse if options.target_mse is not None else options.fail_under_mse)
        shared.setdefault("prior", assessed["prior"])
        shared.setdefault("prior_estimate", engine.measurement.prior)
        shared.setdefault("calibration", assessed["calibration"])
        calibration = assessed["calibration"]
        sigma, source = _cut_sigma(options, calibration)
        grid, executed = engine.run_attacks([sigma])
        point = engine.point(sigma, grid[sigma], calibration["target_mse"])
        if "estimate" not in shared:
            shared["estimate"] = _cut_estimate(ctx, options, engine.names)
            shared["executor"] = {k: executed[k] for k in ("executor", "workers") if k in executed}
    bottom_info = ctx.encoder.describe()
    entry = {
        "name": cut.name,
        "op": cut.op,
        "depth": cut.depth,
        "shape": cut.shape,
        "params": cut.params,
        "flops": cut.flops,
        "bytes_sent": cut.bytes_sent,
        "parity_max_abs_err": parity,
        "sigma_source": source,
        **{key: point[key] for key in CUT_KEYS if key != "calibration"},
        "calibration": calibration,
        "bottom": {
            "gradient_mode": bottom_info["gradient_mode"],
            "parity_max_abs_err": bottom_info["parity_max_abs_err"],
            "warnings": bottom_info["warnings"],
        },
        "seconds": time.perf_counter() - clock,
    }
    return entry, ctx


def _cut_sigma(options: AuditOptions, calibration: dict) -> tuple[float, str]:
    """--noise-sigma when given; else the cut's calibrated sigma; else (no sigma reaches the target) 0."""
    if options.cut_noise_sigma is not None:
        return float(options.cut_noise_sigma), "--noise-sigma"
    if calibration["feasible"] and calibration["sigma"] is not None and math.isfinite(calibration["sigma"]):
        return float(calibration["sigma"]), "calibrated"
    return 0.0, "uncalibrated"


def _model_inputs(ctx: AuditContext) -> np.ndarray:
    """The first target samples as the whole model takes them (token ids for token models)."""
    data = ctx.target.token_ids if ctx.target.token_ids is not None else ctx.target.x
    return data[:PARITY_SAMPLES].cpu().numpy()


def check_halves(whole: WholeModel, bottom, top, x: np.ndarray, name: str) -> float:
    """The largest |top(bottom(x)) - whole(x)| on x; InputError when it exceeds PARITY_RTOL of the
    whole model's largest output (the halves would not be the model that was given)."""
    x = x.astype(_input_dtype(whole), copy=False)
    expected = run_onnx(whole.proto, x)
    got = run_onnx(top, run_onnx(bottom, x))
    if got.shape != expected.shape:
        raise InputError(f"cut {name!r}: bottom then top gives shape {got.shape}, the whole model {expected.shape}")
    error = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    if not error <= PARITY_RTOL * max(scale, 1.0):
        raise InputError(
            f"cut {name!r}: bottom then top differs from the whole model by {error:.3g} (tolerance "
            f"{PARITY_RTOL * max(scale, 1.0):.3g}) on {len(x)} samples: the halves are not the model (random "
            "operators in the graph?), so this cut cannot be audited"
        )
    return error


def _input_dtype(whole: WholeModel):
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(whole.elem_types[whole.input_name])


def whole_accuracy(whole: WholeModel, ctx: AuditContext) -> dict:
    """The whole model's accuracy on the labelled target data (argmax of its output), by onnxruntime."""
    if ctx.target.y is None:
        return {"status": "skipped", "accuracy": None, "n": len(ctx.target), "reason": "the data has no labels"}
    data = ctx.target.token_ids if ctx.target.token_ids is not None else ctx.target.x
    x = data.cpu().numpy().astype(_input_dtype(whole), copy=False)
    scores = np.concatenate([run_onnx(whole.proto, x[i : i + PREDICT_BATCH]) for i in range(0, len(x), PREDICT_BATCH)])
    if scores.ndim != 2:
        reason = f"the model's output has shape {scores.shape[1:]} per sample, not class scores"
        return {"status": "skipped", "accuracy": None, "n": len(x), "reason": reason}
    hits = scores.argmax(1) == label_indices(ctx.target).cpu().numpy()
    return {"status": "ok", "accuracy": float(hits.mean()), "n": len(x), "reason": ""}


def _cut_estimate(ctx: AuditContext, options: AuditOptions, names: list[str]):
    """The first cut's cost estimate (stages/cost.py), when the data is large enough to be worth it."""
    from splitaudit.stages import leakage
    from splitaudit.stages.cost import estimate_cost, worth_estimating

    if not worth_estimating(ctx):
        return None
    smoothing = leakage.resolve_smoothing(ctx, options.smoothing)
    return estimate_cost(ctx, options.prior, smoothing, names, options.dfil_samples)


def _estimate_words(shared: dict, count: int) -> str:
    """The cost of the whole run from the first cut's (the prior is trained once, every other stage per cut)."""
    estimate = shared.get("estimate")
    if estimate is None:
        return f"cut 1 of {count} done; small data: each cut takes about as long"
    prior = sum(v for k, v in estimate.stages.items() if k.startswith("prior"))
    per_cut = estimate.total - prior
    total = prior + count * per_cut
    return (
        f"the first cut's estimate: {estimate.summary()}; the prior is trained once, so {count} cuts may take about "
        f"{total / 60:.1f} min in all (later cuts' dFIL costs differ with their depth)"
    )


def _header(
    ctx: AuditContext, options: AuditOptions, whole: WholeModel, candidates: list[CutPoint], started: datetime, shared
) -> dict:
    header = describe_run(ctx, options, started)
    del header["noise_sigma"]
    header["kind"] = KIND
    header["run"].update(shared["executor"])
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
