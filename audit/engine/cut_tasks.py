"""The cuts of `splitaudit cuts` as tasks on the executor: one task audits one cut.

A worker (a local process of `--workers N`, a Ray worker, or this process for the local executor)
holds what every cut shares, rebuilt once from a `CutsRecipe`: the whole model's graph, the
options, the data already loaded and split, and the prior term (estimated once by the parent: it
depends on the data alone). A `CutTask` names a cut; the worker cuts the whole model there itself
(only the cut travels, not its halves), writes the halves to a private temporary folder, checks
that bottom then top is the whole model, and audits the bottom with `run`'s engine (autograd
parity, dFIL with its runtime cross-check and intervals, bounds, calibration, attacks, the real
top's accuracy) at the cut's sigma. Inside a task the attacks and the dFIL shards run in that
worker (a worker starts no workers); every stage is seeded from the options alone, so a cut gives
the same numbers on whichever backend runs it. A worker holds one cut's audit at a time.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from splitaudit.context.audit_context import AuditContext, silent_progress
from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.engine.pipeline import AuditEngine, SplitData
from splitaudit.estimators.prior import PriorEstimate
from splitaudit.inputs.data import Dataset
from splitaudit.inputs.onnx_cuts import CutPoint, WholeModel, run_onnx, samples_per_batch, split_at

PARITY_SAMPLES = 64  # target samples bottom-then-top is compared with the whole model on
PARITY_RTOL = 1e-4  # of the whole model's largest output: float32 kernels may order sums differently per graph
CUT_KEYS = ("noise_sigma", "dfil", "bounds", "calibration", "attacks", "utility")  # an audit point's sections kept


@dataclass
class CutsWorkspace:
    """What every cut's audit reads: the options, the whole model, the split data and the prior term."""

    options: AuditOptions
    whole: WholeModel
    data: SplitData
    prior: PriorEstimate
    scratch: str | None = None  # where the halves are written (the pool's folder; None: the system's)
    progress: Callable[..., tqdm] = field(default=silent_progress, repr=False)


@dataclass
class CutsRecipe:
    """A workspace as it travels to a worker (everything in it pickles: the graph as its bytes)."""

    options: AuditOptions
    whole: WholeModel
    aux: Dataset
    target: Dataset
    prior: PriorEstimate
    scratch: str | None = None

    @property
    def device(self) -> str:
        return self.options.device

    def rebuild(self, device: str) -> CutsWorkspace:
        options = replace(self.options, device=device)
        return CutsWorkspace(options, self.whole, (self.aux, self.target), self.prior, self.scratch)


@dataclass(frozen=True)
class CutRefused:
    """A cut whose inputs cannot be audited (its halves are not the model, its bottom fails a check):
    bad input, which the parent reports as such (exit 2), not a task failure to retry."""

    message: str


@dataclass(frozen=True)
class CutTask:
    """One cut to audit."""

    cut: CutPoint
    units = 1  # progress units
    timed = False  # --task-timeout bounds an attack seed, not a whole cut's audit

    @property
    def relative_cost(self) -> float:
        """The bottom's FLOPs: the deepest cuts start first, so the workers finish together."""
        return float(self.cut.flops)

    @property
    def label(self) -> str:
        return f"cut {self.cut.name}"

    def run(self, space: CutsWorkspace) -> dict | CutRefused:
        try:
            return audit_cut(space, self.cut)
        except InputError as exc:
            return CutRefused(str(exc))


def cut_options(options: AuditOptions, bottom: Path, top: Path) -> AuditOptions:
    """The options of one cut's audit: its halves as the model and the top model, its attacks and
    dFIL in this process (the cut is the executor's task), the sigma set per cut."""
    return replace(
        options,
        model=str(bottom),
        top_model=str(top),
        output_name=None,
        noise_sigma=0.0,
        executor="local",
        workers=1,
        task_timeout=None,
        ray_address=None,
    )


def write_halves(whole: WholeModel, cut: CutPoint, folder: Path) -> tuple[object, object, Path, Path]:
    """The cut's bottom and top, and where they were written in `folder`."""
    import onnx

    bottom, top = split_at(whole, cut)
    paths = folder / "bottom.onnx", folder / "top.onnx"
    for half, path in zip((bottom, top), paths):
        onnx.save(half, str(path))
    return bottom, top, *paths


def audit_cut(space: CutsWorkspace, cut: CutPoint) -> dict:
    """One cut: its halves written and checked against the whole model, its bottom audited at its
    sigma (--noise-sigma, or the one calibrated for the target), as cuts.json's entry."""
    clock = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="splitaudit-cut-", dir=space.scratch) as folder:
        bottom, top, bottom_path, top_path = write_halves(space.whole, cut, Path(folder))
        options = cut_options(space.options, bottom_path, top_path)
        with AuditEngine.prepared(options, space.progress, data=space.data) as engine:
            parity = check_halves(space.whole, bottom, top, model_inputs(engine.ctx), cut.name)
            engine.known_prior = space.prior
            calibration = engine.assess(0.0, target_of(space.options))["calibration"]
            sigma, source = cut_sigma(space.options, calibration)
            grid, _ = engine.run_attacks([sigma])
            point = engine.point(sigma, grid[sigma], calibration["target_mse"])
            loaded = engine.ctx.encoder.describe()
    return {
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
        "bottom": {key: loaded[key] for key in ("gradient_mode", "parity_max_abs_err", "warnings")},
        "seconds": time.perf_counter() - clock,
    }


def target_of(options: AuditOptions) -> float | None:
    """The bound target each cut is calibrated for: --target-mse, else --fail-under-mse (else None:
    half the mean-guess MSE, decided by the calibration)."""
    return options.target_mse if options.target_mse is not None else options.fail_under_mse


def cut_sigma(options: AuditOptions, calibration: dict) -> tuple[float, str]:
    """--noise-sigma when given; else the cut's calibrated sigma; else (no sigma reaches the target) 0."""
    if options.cut_noise_sigma is not None:
        return float(options.cut_noise_sigma), "--noise-sigma"
    if calibration["feasible"] and calibration["sigma"] is not None and math.isfinite(calibration["sigma"]):
        return float(calibration["sigma"]), "calibrated"
    return 0.0, "uncalibrated"


def model_inputs(ctx: AuditContext, count: int | None = PARITY_SAMPLES) -> np.ndarray:
    """The first `count` target samples (all for None) as the whole model takes them (token ids for token models)."""
    data = ctx.target.token_ids if ctx.target.token_ids is not None else ctx.target.x
    return data[:count].cpu().numpy()


def check_halves(whole: WholeModel, bottom, top, x: np.ndarray, name: str) -> float:
    """The largest |top(bottom(x)) - whole(x)| on x; InputError when it exceeds PARITY_RTOL of the
    whole model's largest output (the halves would not be the model that was given)."""
    x = x.astype(input_dtype(whole), copy=False)
    batch = samples_per_batch(whole)
    expected = run_onnx(whole.proto, x, batch=batch)
    got = run_onnx(top, run_onnx(bottom, x, batch=batch), batch=batch)
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


def input_dtype(whole: WholeModel):
    """The numpy dtype of the whole model's input."""
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(whole.elem_types[whole.input_name])
