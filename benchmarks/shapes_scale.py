"""Anisotropic and 1-D bottoms: the up-front cost estimate against the measured `--quick --attacks all`.

The target on 2 CPU cores: a MobileNetV3-style text-line bottom (3x48x192 -> 16x3x96,
tests/support/architectures.py `textline`), 400 aux and 200 target lines, `splitaudit run --quick
--attacks all` under 15 minutes with every attack ok, and the full battery's up-front
estimate under 2 hours. The bottom is first trained briefly on its own task (upright/turned,
the audio class; tests/support/architectures.py `train_briefly`): with random weights and random
BatchNorm statistics the text-line bottom keeps 1e-5 of its output's spread for the input, and
every attack failed on it. `--shape audio1d` does the same for the 1-D conv audio-style bottom
(1x1024 -> 16x128). The data are generated (tests/support/shaped_data.py), nothing is downloaded; the
model is exported with torch.onnx.export(dynamo=True).

It prints the estimate of the quick and of the full battery stage by stage, then (unless
--estimate-only) runs the quick audit and prints each stage's measured seconds beside its
estimate, and every attack's status and metric against its baseline. On a machine shared
with other work, wall seconds say little about idle cores: the estimate's steps are timed in CPU
seconds (splitaudit.stages.cost.StepTimer), and `--cpu-time` reports the measured run in CPU seconds
of this process (all its threads) too, an upper bound on its wall time on idle cores. `--full-seed ATTACK` runs one
seed of that attack at the full battery's settings instead of the quick audit, and prints its CPU
seconds beside the estimate's share of one seed. `--attacks` runs (and estimates) only the attacks
named, `--attack-option` passes an attack setting on, as `splitaudit run` takes them.

    python -m benchmarks.shapes_scale [--shape textline|audio1d] [--aux 400] [--target 200] [--estimate-only]
                                      [--cpu-time] [--full-seed decoder|sdar|optimization]
                                      [--attacks all|NAME,...] [--attack-option NAME.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.demo_stages import StageClock, instrument
from splitaudit import cli
from splitaudit.attacks import attack_names, get_attack
from splitaudit.core.config import AuditOptions
from splitaudit.core.threads import threads_for
from splitaudit.engine.pipeline import prepare_context
from splitaudit.stages import cost, leakage
from splitaudit.stages.cost import estimate_cost
from tests.support.architectures import build, export_onnx, train_briefly
from tests.support.shaped_data import audio_clips, text_lines

SHAPES = {"textline": text_lines, "audio1d": audio_clips}


N_TRAIN = 300  # the bottom's own training data, apart from aux and target


def write_inputs(folder: Path, shape: str, n_aux: int, n_target: int) -> tuple[Path, Path, Path]:
    """The exported bottom model, trained briefly on its own task, and its aux and target data."""
    x, y, attr = SHAPES[shape](n_aux + n_target + N_TRAIN)
    aux, target, end = folder / "aux.npz", folder / "target.npz", n_aux + n_target
    np.savez(aux, x=x[:n_aux], y=y[:n_aux], attr=attr[:n_aux])
    np.savez(target, x=x[n_aux:end], y=y[n_aux:end], attr=attr[n_aux:end])
    model = train_briefly(build(shape, seed=0), torch.from_numpy(x[end:]), torch.from_numpy(y[end:]).long())
    onnx = export_onnx(model, torch.from_numpy(x[:2]), folder / f"{shape}.onnx", exporter="dynamo")
    return onnx, aux, target


def estimates(model: Path, aux: Path, target: Path, attacks: list[str]) -> dict[bool, dict[str, float]]:
    """Seconds per stage the up-front estimate gives, for the quick and the full battery of `attacks`."""
    found = {}
    for quick in (True, False):
        options = AuditOptions(model=str(model), aux=str(aux), target=str(target), seed=0, quick=quick)
        ctx = prepare_context(options.validate())
        cost = estimate_cost(ctx, options.prior, leakage.resolve_smoothing(ctx, options.smoothing), attacks)
        found[quick] = dict(cost.stages, total=cost.total)
        print(f"{'quick' if quick else 'full'} estimate: {cost.summary()}", flush=True)
        ceilings = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in cost.ceilings.items())
        print(f"  at most, by stage: {ceilings or 'as expected'}", flush=True)
    return found


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children so far (the audit's
    worker processes, joined when it ends): on a machine shared with other work, an upper bound
    on the wall time the same run takes on idle cores."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(usage.ru_utime + usage.ru_stime for usage in usages)


def run_quick(
    model: Path, aux: Path, target: Path, out: Path, cpu_time: bool = False, attacks: str = "all", settings=()
) -> tuple[int, float, float, dict[str, float]]:
    """(exit code, wall seconds, CPU seconds, measured seconds per attack: CPU seconds with
    `cpu_time`, else wall) of `splitaudit run --quick --attacks ATTACKS` with each of `settings` as an
    `--attack-option`."""
    clock, results = StageClock(trace_python=False), []
    instrument(clock, results)
    argv = ["run", str(model), "--aux", str(aux), "--target", str(target), "--quick", "--attacks", attacks]
    argv += ["--out", str(out), "--format", "json"]
    argv += [arg for setting in settings for arg in ("--attack-option", setting)]
    quiet, exit_code, start, cpu_start = io.StringIO(), 0, time.perf_counter(), cpu_seconds()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            cli.main(argv)
        except SystemExit as stop:
            exit_code = stop.code or 0
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    if exit_code not in (0, 1):
        print(quiet.getvalue()[-3000:])
    measured = {
        s.name.removeprefix("attack ").split(" (seed")[0]: s.cpu_seconds if cpu_time else s.seconds
        for s in clock.stages
    }
    measured["dFIL"] = measured.get("Jacobian traces", 0.0)
    return exit_code, seconds, cpu, measured


def full_seed(model: Path, aux: Path, target: Path, name: str) -> None:
    """One seed of attack `name` at the full battery's settings, in CPU seconds, beside the
    estimate's share of one seed (about: its expected share of the cap; at most: the cap) and
    what stopped it."""
    options = AuditOptions(model=str(model), aux=str(aux), target=str(target), seed=0, quick=False)
    ctx = prepare_context(options.validate())
    attack = get_attack(name)
    timer = cost.StepTimer(cpu_bound=ctx.device.type == "cpu")
    with threads_for(ctx.aux.x.numel(), ctx.device):
        pass_seconds = cost.encoder_pass_seconds(ctx, timer)
    expected, cap = (seconds / len(ctx.seeds) for seconds in attack.estimated_range(ctx, pass_seconds, timer))
    begin = cpu_seconds()
    outcome = attack.run_seed(ctx, ctx.seeds[0])
    measured = cpu_seconds() - begin
    metric = attack.primary_metric
    stops = {k: v for k, v in outcome.details.items() if k.endswith(("_run", "stopped_by", "epochs", "iterations"))}
    print(
        f"{name}, one full seed: estimate about {expected:.0f} s (at most {cap:.0f} s), measured {measured:.0f} "
        f"CPU s (ratio to about {measured / expected:.2f}); {metric} {outcome.metrics[metric]:.4g} baseline "
        f"{outcome.baseline[metric]:.4g}; {stops}"
    )


def main(args) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, aux, target = write_inputs(folder, args.shape, args.aux, args.target)
        attacks = list(attack_names()) if args.attacks == "all" else args.attacks.split(",")
        found = estimates(model, aux, target, attacks)
        print(f"{args.shape}: full battery estimate {found[False]['total'] / 60:.1f} min", flush=True)
        if args.full_seed:
            full_seed(model, aux, target, args.full_seed)
        if args.estimate_only or args.full_seed:
            return
        exit_code, seconds, cpu, measured = run_quick(
            model, aux, target, folder / "report", args.cpu_time, args.attacks, args.attack_option
        )
        print(
            f"splitaudit run --quick --attacks {args.attacks} on {args.shape} ({args.aux} aux, {args.target} target): "
            f"{seconds:.0f} s wall, {cpu:.0f} CPU s, exit code {exit_code}; torch threads "
            f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
        )
        print(f"{'stage':14s} {'estimate s':>10s} {'measured s':>10s} {'ratio':>6s}")
        for stage, estimate in found[True].items():
            if stage in measured and estimate > 0:
                print(f"{stage:14s} {estimate:10.1f} {measured[stage]:10.1f} {measured[stage] / estimate:6.2f}")
        report = json.loads((folder / "report" / "report.json").read_text())
        for name, entry in report["attacks"].items():
            metric = entry.get("primary_metric", "")
            result = entry.get("metrics", {}).get(metric, {})
            baseline = entry.get("baseline", {}).get(metric, {})
            print(f"{name:13s} {_status(entry):7s} {metric} {_value(result)} baseline {_value(baseline)}")
            print(f"{'':13s} {_scalars(entry.get('details', {}))}")


def _scalars(details: dict) -> dict:
    """The details that are single numbers or words (the attack's settings and what stopped it), and
    flat tables of numbers (the optimisation pilot's MSE per start and step)."""
    flat = lambda value: isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values())
    return {key: value for key, value in details.items() if isinstance(value, (int, float, str)) or flat(value)}


def _status(entry) -> str:
    """The report's outcome where the attack ran (leakage, no-advantage, inconclusive), else its status."""
    return entry.get("outcome") or entry["status"]


def _value(entry) -> str:
    return f"{entry.get('mean', float('nan')):.4g}" if isinstance(entry, dict) else f"{entry}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="textline")
    parser.add_argument("--aux", type=int, default=400)
    parser.add_argument("--target", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--estimate-only", action="store_true")
    parser.add_argument("--cpu-time", action="store_true", help="report the measured run in CPU seconds")
    parser.add_argument("--full-seed", metavar="ATTACK", help="run one seed of ATTACK at full settings instead")
    parser.add_argument("--attacks", default="all", help="the attacks to estimate and run: all, or names with commas")
    parser.add_argument("--attack-option", action="append", default=[], metavar="NAME.KEY=VALUE")
    main(parser.parse_args())
