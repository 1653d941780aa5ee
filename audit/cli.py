"""The `splitaudit` command line: parses, delegates, prints. It computes nothing itself.

Exit codes: 0 audit done and every gate passed; 1 a gate failed (reports still written);
2 bad usage or input (one line on stderr; --debug shows the traceback); 3 internal error;
130 interrupted (SIGINT, Ctrl-C); 143 terminated (SIGTERM, e.g. kill or a CI job's time-out).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import traceback
from dataclasses import fields
from importlib.resources import files
from pathlib import Path

import click
from click.core import ParameterSource
from tqdm import tqdm

from splitaudit.attacks import attack_class, attack_names, check_attack_request
from splitaudit.core.config import (
    CALIBRATE,
    CUTS,
    DEVICES,
    RUN,
    SWEEP,
    AuditOptions,
    load_config,
    option_flag,
    parse_attack_option,
)
from splitaudit.core.errors import InputError
from splitaudit.core.options import AUDITING, option_spec
from splitaudit.core.registries import check_formats, formats_of, resolve, result_kind
from splitaudit.core.safety import display_path, display_text, displayable
from splitaudit.core.version import __version__

EXIT_GATE_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 3, 130, 143
COST_NOTICE_SECONDS = 180  # the up-front cost estimate is printed when the audit may take longer


def _comma_list(convert):
    """A click callback turning 'a,b,c' into [convert(a), ...] with a clear error."""

    def callback(_ctx, param, value):
        if value is None:
            return None
        try:
            return [convert(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError as exc:
            raise click.BadParameter(f"expected a comma-separated list ({exc})", param=param) from exc

    return callback


def _worker_count(_ctx, param, value):
    """--workers: a count, or auto (None: one per CPU core)."""
    if value is None or value == "auto":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise click.BadParameter(f"expected a worker count or auto, got {value!r}", param=param) from exc


def audit_options(command: str):
    """The click options of `command`, made from the option table (config.AuditOptions) in its
    order, then the flags that control the CLI itself (--attack-option, --config, --debug)."""
    decorators = [_click_option(f, command) for f in fields(AuditOptions) if command in option_spec(f).commands]
    if command in AUDITING:
        decorators.append(
            click.option(
                "--attack-option",
                "attack_option",
                multiple=True,
                metavar="NAME.KEY=VALUE",
                help="An attack setting, e.g. sdar.ablation=true (repeatable; `splitaudit attacks` lists them).",
            )
        )
    decorators += [
        click.option(
            "--config",
            "config_file",
            type=click.Path(dir_okay=False),
            help="TOML file with the same options; command-line flags win.",
        ),
        click.option("--debug", is_flag=True, help="Show tracebacks for errors."),
    ]

    def apply(func):
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


LIST_ITEMS = {"list[str]": str, "list[int] | None": int, "list[float] | None": float}
SCALARS = {"float": float, "float | None": float, "int": int, "int | None": int}


def _click_option(f, command: str):
    """One option of the table as a click option: its type from the field's annotation (comma
    lists, numbers, flags; --workers takes a count or auto), choices, metavar and help from its
    OptionSpec."""
    spec = option_spec(f)
    words = spec.help_in(command).format(
        attacks=",".join(attack_names()),
        formats=",".join(formats_of(command if command in (SWEEP, CUTS) else "report")),
    )
    kwargs = {"help": words, "metavar": spec.metavar, "required": command in spec.required_in}
    if f.type == "bool":
        kwargs["is_flag"] = True
    elif f.name == "workers":
        kwargs["callback"] = _worker_count
    elif f.type in LIST_ITEMS:
        kwargs["callback"] = _comma_list(LIST_ITEMS[f.type])
    elif spec.choices:
        kwargs["type"] = click.Choice(spec.choices)
    elif spec.is_path:
        kwargs["type"] = click.Path(dir_okay=False)
    elif f.type in SCALARS:
        kwargs["type"] = SCALARS[f.type]
    return click.option(option_flag(f), f.name, **kwargs)


def given_flags(flags: dict) -> dict:
    """The flags the user actually typed (so that config-file values are not overridden by defaults)."""
    ctx = click.get_current_context()
    return {k: v for k, v in flags.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}


def build_options(model: str | None, flags: dict) -> AuditOptions:
    """Defaults, then the --config file, then the flags given on the command line."""
    values = load_config(flags["config_file"]) if flags.get("config_file") else {}
    names = {f.name for f in fields(AuditOptions)}
    values.update({k: v for k, v in flags.items() if k in names})
    if model:
        values["model"] = model
    for text in flags.get("attack_option") or ():
        attack, key, value = parse_attack_option(text)
        values.setdefault("attack_options", {}).setdefault(attack, {})[key] = value
    if not values.get("model"):
        raise InputError("no model given: splitaudit run MODEL --aux DATA")
    if not values.get("aux"):
        raise InputError("no auxiliary data given: pass --aux PATH (.npz, .csv or an image folder)")
    options = AuditOptions(**values).validate()
    check_attack_request(options.attacks, options.attack_options)
    return options


def cli_progress(**kwargs) -> tqdm:
    """Progress bars on stderr when it is a terminal; in a log (CI), lines instead (LogLines)."""
    if sys.stderr.isatty():
        return tqdm(file=sys.stderr, leave=False, dynamic_ncols=True, **kwargs)
    return LogLines(**kwargs)


class LogLines(tqdm):
    """Progress where stderr is a log, not a terminal (a CI job): no bar, whose redraws a log cannot
    show, but a line as each coarse step ends (a stage, an attack task, a sigma, a cut) and as each
    stage ends, once it has run for a second, so that a long audit is seen to progress."""

    COARSE_UNITS = ("stage", "task", "sigma", "cut")
    QUIET_SECONDS = 1.0  # steps that end sooner say nothing

    def __init__(self, desc: str = "", total: int | None = None, unit: str = "it", **kwargs) -> None:
        self._stage, self._steps, self._unit = desc, total, unit
        self._done, self._started, self._said = 0, time.monotonic(), False
        super().__init__(desc=desc, total=total, unit=unit, disable=True, **kwargs)

    def update(self, n: float = 1) -> bool | None:
        self._done += n
        if self._unit in self.COARSE_UNITS and self._steps and self._done < self._steps:
            self._line(f"{self._done:g} of {self._steps} {self._unit}s done")
        return super().update(n)

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self._said = self._said or exc_type is not None  # a step that raised is not done
        super().__exit__(exc_type, exc_value, traceback)

    def close(self) -> None:
        if not self._said and self._stage:
            self._said = True
            self._line("done")
        super().close()

    def _line(self, what: str) -> None:
        seconds = time.monotonic() - self._started
        if seconds >= self.QUIET_SECONDS:
            print(f"splitaudit: {self._stage}: {what} after {seconds:.0f} s", file=sys.stderr, flush=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="splitaudit")
def cli() -> None:
    """Audit what a split-learning bottom model's embeddings leak."""


@cli.command()
@click.argument("model", required=False)
@audit_options(RUN)
def run(model: str | None, **flags) -> None:
    """Audit MODEL (.onnx, TorchScript .pt or torch.export .pt2) with auxiliary data."""
    options = build_options(model, given_flags(flags))
    _audit_and_report(options, invocation(flags))


@cli.command()
@click.option("--out", default="splitaudit-report", show_default=True, help="Output folder.")
@click.option("--quick", is_flag=True, help="Smoke run: fewer seeds, epochs and probes.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option(
    "--sweep",
    "as_sweep",
    is_flag=True,
    help="Sweep the noise instead: sigma 0 and the calibrated sigma with points around it, every "
    "attack but SDAR (sweep.html).",
)
@click.option(
    "--workers",
    callback=_worker_count,
    default="auto",
    show_default=True,
    metavar="N|auto",
    help="Worker processes for the attacks (auto: one per CPU core; 1: all in this process).",
)
@click.option(
    "--text",
    is_flag=True,
    help="Audit the bundled text sample instead: a GPT-2 checkpoint folder cut after block 2, on raw text "
    '(needs the hf extra: pip install "splitaudit[hf]"; without it, a transformer bottom in ONNX over token ids).',
)
def demo(out: str, quick: bool, device: str, debug: bool, as_sweep: bool, workers: int | None, text: bool) -> None:
    """Audit the bundled digits CNN (or, with --text, a Hugging Face GPT-2 checkpoint folder cut after
    block 2 on raw text) with every attack (nothing to download)."""
    from splitaudit.engine.demo_samples import demo_inputs

    inputs, fallback = demo_inputs(text)
    if fallback:
        click.echo(f"splitaudit: {fallback}", err=True)
    options = AuditOptions(
        **inputs,
        out=out,
        quick=quick,
        device=device,
        workers=workers,
    ).validate()
    if as_sweep:
        from splitaudit.engine.sweep import demo_sweep_options

        _sweep_and_report(demo_sweep_options(options), invocation({}))
        return
    _audit_and_report(options, invocation({}))


def invocation(flags: dict):
    """The command line as typed (main passes it as the click context's obj) and the --config file,
    for the result's provenance section."""
    from splitaudit.engine.provenance import Invocation

    argv = click.get_current_context().find_root().obj
    return Invocation(["splitaudit", *argv] if isinstance(argv, list) else None, flags.get("config_file"))


def _audit_and_report(options: AuditOptions, invocation) -> None:
    from splitaudit.api import run as run_api
    from splitaudit.reports import terminal_summary, write_junit
    from splitaudit.reports.compare import read_baseline

    logging = options.mlflow or options.mlflow_uri is not None
    with held_output(options.out, "report", options.junit):
        if logging:
            from splitaudit.reports.mlflow_log import require_mlflow

            require_mlflow(options.mlflow_uri)  # installed and its store usable, before any computation
        baseline = read_baseline(options.baseline) if options.baseline else None
        outcome = run_api(
            options,
            progress=cli_progress,
            on_cost=print_long_cost,
            invocation=invocation,
            baseline=baseline,
            on_notice=print_notice,
        )
        written = outcome.write(options.out, options.formats)
        if options.junit:
            written.append(write_junit(outcome.data, Path(options.junit)))
    click.echo(terminal_summary(displayable(outcome.data)))
    _echo_written(written)
    if logging:
        from splitaudit.reports.mlflow_log import log_run

        click.echo(f"logged to MLflow run {log_run(outcome.data, written, options.mlflow_uri)}")
    if not outcome.passed:
        raise SystemExit(EXIT_GATE_FAILED)


@contextlib.contextmanager
def held_output(out: str, document: str, junit: str | None):
    """--out (and --junit's folder) checked and locked for one run, before any computation. The
    earlier run's reports are removed first, and this run's again when a signal arrived, even one
    whose exception a library swallowed so that the run went on to write them (CPython loses an
    exception raised while compile() runs, as in a lazy import); the signal then ends the command.
    So a run that does not finish leaves no report (exit 2, 3, 130, 143)."""
    from splitaudit.reports.writer import claim_output_folder, output_lock, remove_previous_reports

    if junit:
        claim_output_folder(Path(junit).parent)
    with output_lock(claim_output_folder(out)) as out_dir:
        try:
            remove_previous_reports(out_dir, document, junit)
            yield out_dir
        finally:
            if RECEIVED_SIGNALS:  # its exception raised on the way here, or lost on the way
                remove_previous_reports(out_dir, document, junit)
                raise signal_exception(RECEIVED_SIGNALS[0])


def print_notice(line: str) -> None:
    """A line the audit says before its slow stages (why the model runs slower than it could), on stderr."""
    click.echo(f"splitaudit: {line}", err=True)


def print_long_cost(estimate) -> None:
    """The up-front cost estimate on stderr, when the audit will take more than a few minutes (at the
    machine's present load)."""
    if estimate.at_load > COST_NOTICE_SECONDS:
        click.echo(f"splitaudit: {estimate.summary()}", err=True)


@cli.command()
@click.argument("model", required=False)
@audit_options(CALIBRATE)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def calibrate(model: str | None, target_mse: float, as_json: bool, **flags) -> None:
    """The noise sigma that makes MODEL's provable bound reach --target-mse."""
    from splitaudit.engine.pipeline import run_calibration
    from splitaudit.reports.files import to_strict_json
    from splitaudit.stages.calibration import describe_calibration

    options = build_options(model, {**given_flags(flags), "attacks": ["none"], "target_mse": target_mse})
    answer = run_calibration(options, progress=cli_progress, on_notice=print_notice)
    if as_json:
        click.echo(json.dumps(to_strict_json(answer), indent=2, allow_nan=False))
    else:
        click.echo(describe_calibration(answer))


@cli.command()
@click.argument("report", type=click.Path(dir_okay=False))
@click.option("--format", "formats", callback=_comma_list(str), default="html,md", show_default=True)
@click.option("--out", help="Output folder (default: the report's folder).")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def render(report: str, formats: list[str], out: str | None, debug: bool) -> None:
    """Re-render a saved report.json (or sweep.json) as HTML and/or Markdown."""
    from splitaudit.reports import load_result
    from splitaudit.reports.writer import claim_output_folder, output_lock

    result = load_result(Path(report))
    kind = result_kind(result)
    check_formats(formats, kind.name)
    write = resolve(kind.writer)
    out_dir = claim_output_folder(Path(report).parent if out is None else out)
    with output_lock(out_dir):
        written = write(result, out_dir, formats)
    _echo_written(written)


@cli.command()
@click.argument("before", type=click.Path(dir_okay=False))
@click.argument("after", type=click.Path(dir_okay=False))
@click.option("--format", "formats", callback=_comma_list(str), default="html,md", show_default=True)
@click.option("--out", default="splitaudit-compare", show_default=True, help="Output folder.")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def compare(before: str, after: str, formats: list[str], out: str, debug: bool) -> None:
    """Render two saved audits side by side (e.g. before and after a defence)."""
    from splitaudit.reports import load_result, write_comparison
    from splitaudit.reports.compare import check_comparable, differences, regression
    from splitaudit.reports.writer import claim_output_folder, output_lock

    check_formats(formats, "comparison")
    results = load_result(Path(before)), load_result(Path(after))
    check_comparable(*results, (display_path(before), display_path(after)))
    for warning in differences(*results):
        click.echo(f"splitaudit: warning: not like for like: {warning}", err=True)
    click.echo(f"regression test: {regression(*results)[1]}")
    with output_lock(claim_output_folder(out)) as out_dir:
        written = write_comparison(*results, out_dir, formats)
    _echo_written(written)


@cli.command()
@click.argument("report", type=click.Path(dir_okay=False))
@click.option("--model", help="The model file (default: the path the report records).")
@click.option("--aux", help="The auxiliary data (default: the recorded path).")
@click.option("--target", help="The target data, when the audit had a separate one.")
@click.option("--top-model", "top_model", help="The top model, when the audit had one.")
@click.option("--vocab", help="The vocabulary or tokenizer.json, when the audit had one.")
@click.option("--config", "config", help="The --config file, when the audit had one.")
@click.option(
    "--recompute", is_flag=True, help="Also measure the dFIL again and check it lies in the report's interval."
)
@click.option("--device", type=click.Choice(DEVICES), help="Where to recompute (default: the recorded option).")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def verify(report: str, recompute: bool, device: str | None, debug: bool, **paths) -> None:
    """Check that the files are the ones REPORT (report.json, sweep.json or cuts.json) audited: exit 0 verified,
    1 at the first file that differs (or, with --recompute, a dFIL outside its interval), 2 bad input."""
    from splitaudit.engine.verify import check_files, provenance_of, recompute_dfil
    from splitaudit.reports import load_result

    result = load_result(Path(report))
    provenance = provenance_of(result, display_path(report))
    overrides = {role.replace("_", "-"): path for role, path in paths.items()}
    checks = check_files(provenance, overrides)
    for check in checks:
        click.echo(check.describe())
    if checks and not checks[-1].matches:
        _fail(f"verify: NOT the audited files: {checks[-1].describe()}", EXIT_GATE_FAILED)
    if recompute:
        outcomes = recompute_dfil(result, provenance, checks, device)
        for _, line in outcomes:
            click.echo(line)
        failed = next((line for ok, line in outcomes if not ok), None)
        if failed:
            _fail(f"verify: the dFIL does not reproduce: {failed}", EXIT_GATE_FAILED)
    click.echo(f"verified: {len(checks)} file(s) match report fingerprint {provenance['fingerprint']}")


def _echo_written(paths: list[Path]) -> None:
    click.echo("wrote " + ", ".join(display_path(p) for p in paths))


@cli.command()
def schema() -> None:
    """Print the JSON Schema of report.json (what every output is rendered from)."""
    from splitaudit.core.result import SCHEMA_FILE

    click.echo(files("splitaudit").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"), nl=False)


@cli.command()
@click.argument("model", required=False)
@audit_options(SWEEP)
def sweep(model: str | None, **flags) -> None:
    """Audit MODEL at several noise sigmas: bounds, attacks and utility, and a recommended sigma."""
    _sweep_and_report(build_options(model, given_flags(flags)), invocation(flags))


def _sweep_and_report(options: AuditOptions, invocation) -> None:
    from splitaudit.engine.sweep import run_sweep
    from splitaudit.reports import write_junit
    from splitaudit.reports.sweep import sweep_summary, write_sweep_reports

    with held_output(options.out, "sweep", options.junit) as out_dir:
        result = run_sweep(options, progress=cli_progress, invocation=invocation, on_notice=print_notice)
        written = write_sweep_reports(result, out_dir, options.formats)
        if options.junit:
            written.append(write_junit(result, Path(options.junit)))
    click.echo(sweep_summary(result))
    _echo_written(written)
    if not result["gate"]["passed"]:
        raise SystemExit(EXIT_GATE_FAILED)


@cli.command()
@click.argument("model", required=False)
@audit_options(CUTS)
def cuts(model: str | None, **flags) -> None:
    """Audit every candidate split point of a whole MODEL (.onnx or torch.export .pt2) and recommend where to split."""
    from splitaudit.engine.cuts import run_cuts
    from splitaudit.reports import write_junit
    from splitaudit.reports.cuts import cuts_summary, write_cuts_reports

    options = build_options(model, given_flags(flags))
    check_formats(options.formats, CUTS)
    with held_output(options.out, "cuts", options.junit) as out_dir:
        result = run_cuts(
            options,
            progress=cli_progress,
            on_cost=lambda line: click.echo(f"splitaudit: {line}", err=True),
            invocation=invocation(flags),
        )
        written = write_cuts_reports(result, out_dir, options.formats)
        if options.junit:
            written.append(write_junit(result, Path(options.junit)))
    click.echo(cuts_summary(result))
    _echo_written(written)
    if not result["gate"]["passed"]:
        raise SystemExit(EXIT_GATE_FAILED)


@cli.command()
def attacks() -> None:
    """List the attacks, what each measures and the options each takes (NAME.KEY=VALUE)."""
    from splitaudit.attacks.base import options_help

    for name in attack_names():
        attack = attack_class(name)
        click.echo(f"{name}: {attack.title}; metrics {', '.join(attack.metrics)}")
        for line in options_help(attack.Options) or ["takes no options"]:
            click.echo(f"  {line}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps errors to one line and the documented exit codes."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    received = RECEIVED_SIGNALS
    received.clear()

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        raise signal_exception(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = cli.main(args=args, prog_name="splitaudit", standalone_mode=False, obj=list(args))
    except (click.exceptions.Abort, KeyboardInterrupt):
        _fail_on_signal(signal.SIGINT)
    except Terminated:
        _fail_on_signal(signal.SIGTERM)
    except click.ClickException as exc:
        _fail(exc.format_message(), EXIT_BAD_INPUT)
    except SystemExit:
        raise
    except Exception as exc:
        # A signal's exception raised inside a C extension can come out as that library's own error
        # (matplotlib: "Invalid affine transformation matrix"): after a signal, any error is its echo.
        if received:
            _fail_on_signal(received[0])
        if debug:
            traceback.print_exc()
        if isinstance(exc, InputError):
            _fail(str(exc), EXIT_BAD_INPUT)
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", EXIT_INTERNAL)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:  # a library swallowed the signal's exception and the command went on: still the signal's exit
        _fail_on_signal(received[0])
    raise SystemExit(code or 0)


class Terminated(BaseException):
    """SIGTERM as an exception, so that every `with` and `finally` on the way out runs (worker
    pools stop their workers and remove their model copies); a BaseException, like
    KeyboardInterrupt, so that no `except Exception` (a task's failure handler) swallows it."""


RECEIVED_SIGNALS: list[int] = []  # SIGINT/SIGTERM received by the command main runs (held_output reads it)


def signal_exception(signum: int) -> BaseException:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _fail_on_signal(signum: int) -> None:
    _forget_interrupt_in_string_eval()
    if signum == signal.SIGTERM:
        _fail("terminated (SIGTERM); reports of this run are incomplete or absent", EXIT_TERMINATED)
    _fail("interrupted (SIGINT); reports of this run are incomplete or absent", EXIT_INTERRUPTED)


def _forget_interrupt_in_string_eval() -> None:
    """CPython (3.11, 3.12) marks a KeyboardInterrupt that leaves a string exec or eval as unhandled
    even when a caller catches it, and `python -m splitaudit` then ends by killing itself with
    SIGINT (exit -2) instead of exiting 130: dataclasses build their methods by string exec, torch
    defines hundreds as its modules load while the workers run, and Ctrl-C landed in one in about
    1 run of 20 of the Ctrl-C test. Every string eval clears the mark as it starts, so one that
    raises nothing leaves it cleared."""
    eval("None")  # noqa: S307 (a constant: only the interpreter's side effect is wanted)


def _fail(message: str, code: int) -> None:
    line = display_text(next((t for t in message.splitlines() if t.strip()), "failed"))
    click.echo(f"splitaudit: error: {line}", err=True)
    raise SystemExit(code)
