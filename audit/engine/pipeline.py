"""The audit engine: load -> embed once -> measure once -> one audit point per sigma (bounds,
attacks checked against them, utility) -> one result -> gate.

AuditEngine holds what every command prepares (context, attacks, executor, measurement); run_audit,
run_calibration and sweep.run_sweep are its three uses. Data flows one way; this module wires the
stages and never prints or renders.
"""

from __future__ import annotations

import platform
import time
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from tqdm import tqdm

from splitaudit.attacks import check_attack_inputs, selected_attacks
from splitaudit.context.audit_context import AuditContext, ContextSettings, build_context, silent_progress
from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.result import SCHEMA_VERSION
from splitaudit.core.version import __version__
from splitaudit.engine.provenance import Invocation, provenance_section
from splitaudit.execution.executor import (
    Executor,
    ShardRunner,
    describe_executor,
    open_executor,
    require_ray,
    run_attack_grid,
    trace_runner,
)
from splitaudit.inputs.data import Dataset, split_dataset
from splitaudit.inputs.digests import InputFiles
from splitaudit.inputs.model_checks import within_time_limit
from splitaudit.inputs.models import resolve_device
from splitaudit.inputs.raw_model import RawModel
from splitaudit.inputs.token_models import ModelSource, load_audited_data, open_audited_model
from splitaudit.stages.bound_check import check_against_bound
from splitaudit.stages.token_statement import checked_against_attacks, token_statement
from splitaudit.verdicts.gate import evaluate_gate, thresholds_of

if TYPE_CHECKING:
    from splitaudit.estimators.prior import PriorEstimate
    from splitaudit.stages.leakage import Measurement


SplitData = tuple[Dataset, Dataset]  # aux and target, loaded and split


def prepare_context(
    options: AuditOptions, progress: Callable[..., tqdm] = silent_progress, data: SplitData | None = None
) -> AuditContext:
    """Load the model and data (or take `data`, already loaded and split), split them and check the
    model on real inputs.

    Anything that goes wrong here is a problem with the inputs, reported as InputError.
    """
    try:
        return _prepare_context(options, progress, data)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"cannot prepare the audit from these inputs: {type(exc).__name__}: {exc}") from exc


def _prepare_context(options: AuditOptions, progress: Callable[..., tqdm], data: SplitData | None) -> AuditContext:
    device = resolve_device(options.device)
    raw = within_time_limit(
        open_audited_model,
        ModelSource.of(options),
        device,
        what="loading the model",
    )
    if data is not None:
        return build_context(ContextSettings.of(options), raw, *data, device, progress)
    shape = raw.declared_input_shape
    loaded = _load(options.aux, shape, options, raw)
    if options.target:
        aux, target = loaded, _load(options.target, shape or loaded.sample_shape, options, raw)
    else:
        aux, target = split_dataset(loaded, options.target_fraction, options.seed)
    return build_context(ContextSettings.of(options), raw, aux, target, device, progress)


def _load(path: str, shape, options: AuditOptions, raw: RawModel) -> Dataset:
    return load_audited_data(
        path,
        shape,
        raw,
        label_column=options.label_column,
        attr_column=options.attr_column,
        vocab=options.vocab,
        max_length=options.max_length,
    )


def prepare_audit(
    options: AuditOptions, progress: Callable[..., tqdm], data: SplitData | None = None
) -> tuple[AuditContext, list[str]]:
    """What an audit and a sweep do before their first slow stage: select the attacks, check the
    executor, seed torch, load the context (on `data` when given), and check the
    attacks' options against the loaded data. Returns the context and the selected attack names.
    `options` are validated where they came in (AuditOptions.validate, attacks.check_attack_request)."""
    names = selected_attacks(options.attacks)
    check_executor(options)
    torch.manual_seed(options.seed)
    ctx = prepare_context(options, progress, data)
    check_attack_inputs(ctx, names)
    return ctx, names


class AuditEngine:
    """A prepared audit: options checked, context loaded, attacks selected, the executor open
    (none for calibrate, which only measures), and the measurement (Jacobian traces and prior
    term: they do not depend on sigma, dFIL scales as 1/sigma^2) taken once, when first asked for.

    Each audit point is one call, `point(sigma, attacks)`: run is one point and its gate, a sweep
    many points and a recommendation, calibrate the measurement alone. The CLI and the Python API
    reach it through run_audit, run_sweep and run_calibration alike.
    """

    def __init__(
        self,
        options: AuditOptions,
        ctx: AuditContext,
        names: list[str],
        executor: Executor | None,
        progress: Callable[..., tqdm],
        inputs: InputFiles | None = None,
    ) -> None:
        self.options, self.ctx, self.names, self.executor, self.progress = options, ctx, names, executor, progress
        self.inputs = inputs or InputFiles({})
        self._measured: tuple[Measurement, ShardRunner | None] | None = None
        self.known_prior: PriorEstimate | None = None  # a prior term measured on the same aux data (cuts share it)
        self._clean_utility: dict | None = None

    @classmethod
    @contextmanager
    def prepared(
        cls,
        options: AuditOptions,
        progress: Callable[..., tqdm] = silent_progress,
        attacks: bool = True,
        config_file: str | None = None,
        data: SplitData | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> Iterator["AuditEngine"]:
        """The engine for `options`, its executor (when `attacks`) closed however the audit ends; once
        the audit is done, the model is asked again for its first answers (Encoder.confirm_unchanged),
        and the input files, hashed once loaded, are confirmed unchanged since before they were loaded
        (splitaudit.inputs.digests). Given `data` (aux and target, loaded by the caller, as each cut of
        `splitaudit cuts` is given them), no file is hashed: the caller records its own inputs.
        on_notice receives the one line that says why the model will run slower than it could (it runs
        in chunks of the static batch it was saved with), if it will, before any slow stage."""
        inputs = InputFiles.before_loading(options, config_file) if data is None else InputFiles({})
        ctx, names = prepare_audit(options, progress, data)
        if on_notice is not None and ctx.encoder.batch_note:
            on_notice(ctx.encoder.batch_note)
        inputs.hash_all()
        with opened_executor(options, ctx) if attacks else nullcontext() as executor:
            yield cls(options, ctx, names, executor, progress, inputs)
        ctx.encoder.confirm_unchanged("at the end of the audit")
        inputs.confirm_unchanged()

    def provenance(self, started: datetime, invocation: Invocation | None) -> dict:
        """The result's provenance section (splitaudit.engine.provenance), ended now."""
        ctx = self.ctx
        return provenance_section(
            self.options, self.inputs.records, ctx.device, ctx.seeds, ctx.encoder.converter, invocation, started
        )

    @property
    def measurement(self) -> Measurement:
        """The dFIL traces (in shards on the executor's workers, when it has any) and the prior term."""
        if self._measured is None:
            from splitaudit.stages import leakage

            shards = trace_runner(self.executor, self.ctx) if self.executor is not None else None
            o = self.options
            measured = leakage.measure(
                self.ctx, o.prior, o.smoothing, o.dfil_rtol, o.dfil_samples, runner=shards, known_prior=self.known_prior
            )
            self.ctx.encoder.confirm_unchanged("after the dFIL and bounds stage")
            self._measured = measured, shards
        return self._measured[0]

    @property
    def clean_utility(self) -> dict:
        """Utility without noise, measured once: what each point's utility loss is measured from."""
        if self._clean_utility is None:
            from splitaudit.stages.utility import measure_utility

            self._clean_utility = measure_utility(self.ctx.at_sigma(0.0))
        return self._clean_utility

    def assess(self, sigma: float, target_mse: float | None = None) -> dict:
        """The dfil, prior, bounds and calibration sections at sigma, from the shared measurement."""
        from splitaudit.stages import leakage

        return leakage.assess_measurement(self.ctx.at_sigma(sigma, self.options.seed), self.measurement, target_mse)

    def run_attacks(self, sigmas: list[float]) -> tuple[dict[float, dict], dict]:
        """Every selected attack at every sigma on the executor, as {sigma: {attack: entry}}, and
        the run section's keys for it (executor, workers, each task's wall time, dFIL shards)."""
        grid, results = run_attack_grid(self.ctx, self.names, sigmas, self.executor, self.progress)
        shards = self._measured[1] if self._measured is not None else None
        return grid, describe_executor(self.executor, results, shards)

    def point(
        self, sigma: float, attacks: dict[str, dict], target_mse: float | None = None, utility: dict | None = None
    ) -> dict:
        """One audit point: the sections at sigma, the attacks' entries (run at sigma) checked
        against the bound, and utility (its loss against clean_utility; measured unless given)."""
        from splitaudit.stages.utility import utility_section

        sections = self.assess(sigma, target_mse)
        checked, bounds = check_against_bound(sections["bounds"], attacks, sections["prior"]["smoothing"])
        if utility is None:
            utility = utility_section(self.ctx.at_sigma(sigma, self.options.seed), self.clean_utility)
        return {"noise_sigma": sigma, **sections, "bounds": bounds, "attacks": checked, "utility": utility}


def run_audit(
    options: AuditOptions,
    progress: Callable[..., tqdm] = silent_progress,
    on_cost: Callable[..., None] | None = None,
    invocation: Invocation | None = None,
    baseline: dict | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> dict:
    """Run the whole audit and return the result object (report.json's content): one audit point
    at options.noise_sigma, and its gate (with the regression checks against `baseline`, an earlier
    report's splitaudit.verdicts.regression.baseline_summary, when given).

    on_cost, when given, receives the up-front cost estimate (splitaudit.stages.cost.CostEstimate)
    before the long stages start; on_notice: AuditEngine.prepared's; invocation
    (the command line and --config file) goes into the provenance section."""
    started = datetime.now(timezone.utc)
    clock = time.perf_counter()
    invocation = invocation or Invocation()
    with AuditEngine.prepared(options, progress, config_file=invocation.config_file, on_notice=on_notice) as engine:
        ctx, names = engine.ctx, engine.names
        header = describe_run(ctx, options, started)
        from splitaudit.stages.utility import utility_section

        utility = utility_section(ctx)  # before the slow stages: a top model that rejects the embeddings is bad input
        if on_cost is not None:
            _announce_cost(ctx, options, names, on_cost)
        with progress(total=1 + len(names), desc="audit", unit="stage") as stages:
            stages.set_postfix_str("dFIL and bounds")
            _ = engine.measurement  # taken here, inside its stage (the engine measures once, on first use)
            statement = None
            if ctx.space.kind == "tokens":
                hidden = ctx.clean_embeddings("target")
                statement = token_statement(ctx.tokens, hidden, ctx.noise_sigma, ctx.aux, ctx.target.mask)
            stages.update()
            stages.set_postfix_str("attacks")
            grid, executed = engine.run_attacks([ctx.noise_sigma])
            stages.update(len(names))
        point = engine.point(ctx.noise_sigma, grid[ctx.noise_sigma], options.fail_under_mse, utility)
    bounds, statement_section = point["bounds"], {}
    if statement is not None:
        statement_section["tokens"], bounds = checked_against_attacks(statement, bounds, point["attacks"])
    result = {
        **header,
        "run": {**header["run"], **executed},
        "utility": point["utility"],
        "dfil": point["dfil"],
        "prior": point["prior"],
        "bounds": bounds,
        "calibration": point["calibration"],
        **statement_section,
        "attacks": point["attacks"],
        "provenance": engine.provenance(started, invocation),
    }
    gate = evaluate_gate(result, **thresholds_of(options), baseline=baseline)
    return {**result, "gate": gate, "run": {**result["run"], "seconds": time.perf_counter() - clock}}


def _announce_cost(ctx: AuditContext, options: AuditOptions, names: list[str], on_cost: Callable[..., None]) -> None:
    """The up-front cost estimate, to on_cost, where the data is large enough to be worth it."""
    from splitaudit.stages import leakage
    from splitaudit.stages.cost import estimate_cost, worth_estimating

    if worth_estimating(ctx):
        smoothing = leakage.resolve_smoothing(ctx, options.smoothing)
        on_cost(estimate_cost(ctx, options.prior, smoothing, names, options.dfil_samples, dfil_rtol=options.dfil_rtol))


def run_calibration(
    options: AuditOptions,
    progress: Callable[..., tqdm] = silent_progress,
    on_notice: Callable[[str], None] | None = None,
) -> dict:
    """`splitaudit calibrate`: the measurement alone (no attack), and the noise sigma that makes its
    van Trees bound reach options.target_mse (splitaudit.stages.calibration.calibration_answer);
    on_notice: AuditEngine.prepared's."""
    from splitaudit.stages.calibration import calibration_answer

    with AuditEngine.prepared(options, progress, attacks=False, on_notice=on_notice) as engine:
        return calibration_answer(engine.ctx, engine.measurement, options.target_mse)


def check_executor(options: AuditOptions) -> None:
    """Before any slow stage: --executor ray without Ray installed is bad input (exit 2)."""
    if options.executor == "ray":
        require_ray()


@contextmanager
def opened_executor(options: AuditOptions, ctx: AuditContext) -> Iterator[Executor]:
    """The executor the audit asked for (--executor, --workers), open for the dFIL shards and the
    attacks, and closed (workers stopped) however the audit ends."""
    executor = open_executor(options.executor, options, ctx)
    try:
        yield executor
    finally:
        executor.close()


def describe_run(ctx: AuditContext, options: AuditOptions, started: datetime) -> dict:
    """The result's header: tool, run, model and data sections."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "splitaudit", "version": __version__},
        "run": {
            "started": started.isoformat(timespec="seconds"),
            "seconds": None,
            "device": ctx.device.type,
            "seed": options.seed,
            "quick": options.quick,
            "seeds": ctx.seeds,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "model": ctx.encoder.describe(),
        "data": describe_data(ctx, options),
        "noise_sigma": options.noise_sigma,
    }


def describe_data(ctx: AuditContext, options: AuditOptions) -> dict:
    return {
        "aux_path": source_name(options.aux),
        "target_path": source_name(options.target),
        "n_aux": len(ctx.aux),
        "n_target": len(ctx.target),
        "classes": ctx.num_classes,
        "class_names": ctx.aux.class_names,
        "has_labels": ctx.aux.y is not None,
        "has_attr": ctx.aux.attr is not None,
        "input_kind": ctx.space.kind,
        "is_image": ctx.space.kind == "image",
        "in_unit_range": ctx.space.unit_range,
        "sample_shape": list(ctx.aux.sample_shape),
        **text_facts(ctx, options),
    }


def text_facts(ctx: AuditContext, options: AuditOptions) -> dict:
    """{"text": {"aux": ..., "target": ...}} for raw-text data (how each file was tokenised), else {}:
    a target split from the aux file is the aux file's texts."""
    files = {"aux": ctx.aux.text, "target": ctx.target.text if options.target else None}
    files = {role: facts for role, facts in files.items() if facts is not None}
    return {"text": files} if files else {}


def source_name(value) -> str | None:
    """A data path as given, or the source of in-memory data (the Python API)."""
    return value if value is None or isinstance(value, str) else str(getattr(value, "source", value))
