"""Wall time, process CPU time and peak memory of `splitaudit demo`, stage by stage, in one process.

Runs the demo command itself (audit of the bundled digits CNN with every registered attack, then
the reports), with its stages wrapped in timers: model + data load, leakage (dFIL traces, prior,
bounds), each attack, the reports. Peak memory per stage is the process's peak resident set
size while the stage ran (Linux: VmHWM, reset at each stage start; elsewhere the running
ru_maxrss); --tracemalloc adds the peak of Python and numpy allocations (torch tensors are not
traced, and tracing slows the run). --estimate makes the demo print its up-front cost estimate
(the digits are below the size worth estimating) and prints it stage by stage beside what the
stages took: the estimate counts CPU seconds over each step's threads, and on a busy machine also
what it makes of the load.

    python -m benchmarks.demo_stages [--quick] [--device cpu|cuda|auto] [--threads 2] [--tracemalloc] [--estimate]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitaudit import cli, reports
from splitaudit.engine import pipeline
from splitaudit.execution import tasks

HWM = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class Stage:
    name: str
    depth: int
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the process's CPU time (all threads) during the stage
    peak_rss: int = 0  # bytes
    python_peak: int | None = None
    running_peak: int = field(default=0, repr=False)


class StageClock:
    """Times nested stages and records each one's peak memory."""

    def __init__(self, trace_python: bool) -> None:
        self.trace_python = trace_python
        self.stages: list[Stage] = []
        self.open: list[Stage] = []

    @contextlib.contextmanager
    def stage(self, name: str):
        for outer in self.open:  # peaks so far belong to the enclosing stages before the reset
            outer.running_peak = max(outer.running_peak, peak_rss())
        stage = Stage(name, depth=len(self.open))
        self.stages.append(stage)
        self.open.append(stage)
        reset_peak_rss()
        if self.trace_python:
            tracemalloc.reset_peak()
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield stage
        finally:
            stage.seconds = time.perf_counter() - start
            stage.cpu_seconds = time.process_time() - cpu_start
            stage.peak_rss = max(stage.running_peak, peak_rss())
            if self.trace_python:
                stage.python_peak = tracemalloc.get_traced_memory()[1]
            self.open.pop()
            for outer in self.open:
                outer.running_peak = max(outer.running_peak, stage.peak_rss)

    def wrap(self, owner, attribute: str, name: str) -> None:
        """Replace owner.attribute (a function) by a timed call of it, if it exists."""
        original = getattr(owner, attribute, None)
        if original is None:
            return

        def timed(*args, **kwargs):
            with self.stage(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)


def peak_rss() -> int:
    """Peak resident set size since the last reset (Linux), else since the process started."""
    if HWM.exists():
        for line in HWM.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        CLEAR_REFS.write_text("5")


def instrument(clock: StageClock, results: list[dict], estimates: list | None = None) -> None:
    """Wrap the demo's stages; attacks are whatever the registry holds. Every run's result goes to
    `results`, and every up-front cost estimate (CostEstimate) to `estimates` when given."""
    from splitaudit.stages import cost, leakage

    clock.wrap(pipeline, "prepare_context", "load model + data")
    clock.wrap(cost, "estimate_cost", "up-front cost estimate")
    clock.wrap(leakage, "measure", "leakage: dFIL traces, prior")
    clock.wrap(leakage, "_jacobian_traces", "Jacobian traces")
    clock.wrap(leakage, "_prior", "prior J(pi)")
    clock.wrap(reports, "write_reports", "reports (write)")
    run_task, run_audit = tasks.run_seed_task, pipeline.run_audit

    def timed_task(ctx, task):
        with clock.stage(f"attack {task.attack} (seed {task.seed})"):
            return run_task(ctx, task)

    def keep_result(*args, **kwargs):
        results.append(run_audit(*args, **kwargs))
        return results[-1]

    tasks.run_seed_task = timed_task
    pipeline.run_audit = keep_result
    if estimates is not None:
        estimate_cost = cost.estimate_cost

        def keep_estimate(*args, **kwargs):
            estimates.append(estimate_cost(*args, **kwargs))
            return estimates[-1]

        cost.estimate_cost = keep_estimate


def quiet_cli_run(clock: StageClock, argv: list[str]) -> tuple[int, str]:
    """`splitaudit ARGV` in this process, timed as one stage with its output captured; the output's
    tail is printed when the run broke (exit code other than 0 or 1). Returns (exit code, output)."""
    exit_code = 0
    with clock.stage(f"splitaudit {argv[0]} (total)"):
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            try:
                cli.main(argv)
            except SystemExit as stop:
                exit_code = stop.code or 0
    if exit_code not in (0, 1):
        print(quiet.getvalue()[-3000:])
    return exit_code, quiet.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo's smoke settings (default: full)")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="default cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--tracemalloc", action="store_true", help="also trace Python/numpy allocations")
    parser.add_argument("--estimate", action="store_true", help="the up-front estimate beside the measured stages")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.tracemalloc:
        tracemalloc.start()
    clock, results, estimates = StageClock(args.tracemalloc), [], []
    instrument(clock, results, estimates)
    if args.estimate:
        from splitaudit.stages import cost

        cost.MIN_VALUES_TO_ESTIMATE = 0
    with tempfile.TemporaryDirectory() as out:
        # one process (--workers 1): the stages are timed where they run; through the CLI's entry
        # point, as a user runs it (the demo reads its command line from the click context)
        argv = ["demo", "--out", out, "--device", args.device, "--workers", "1", "--debug"]
        exit_code, _ = quiet_cli_run(clock, argv + (["--quick"] if args.quick else []))
    print(
        f"splitaudit demo{' --quick' if args.quick else ''} on {args.device}, torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, demo exit code {exit_code}"
    )
    print_stages(clock.stages, results[0] if results else {})
    if estimates:
        print_estimate(estimates[0], clock.stages)


def stage_totals(stages: list[Stage]) -> dict[str, tuple[float, float]]:
    """(wall, CPU) seconds per stage name, an attack's seeds added up under "attack NAME"."""
    totals: dict[str, tuple[float, float]] = {}
    for s in stages:
        name = s.name.split(" (seed ")[0]
        wall, cpu = totals.get(name, (0.0, 0.0))
        totals[name] = (wall + s.seconds, cpu + s.cpu_seconds)
    return totals


ESTIMATED_STAGES = {"dFIL": "Jacobian traces", "prior": "prior J(pi)"}  # estimate's stage -> measured stage


def measured_stage(estimated: str) -> str:
    """The measured stage an estimated one is ("prior (ssm)" -> "prior J(pi)", "sdar" -> "attack sdar")."""
    return ESTIMATED_STAGES.get(estimated.split(" (")[0], f"attack {estimated}")


def print_estimate(estimate, stages: list[Stage]) -> None:
    """The up-front estimate (splitaudit.stages.cost.CostEstimate) stage by stage beside the measured
    stages: about (the seeds that always run, the expected share of a capped training), at most,
    and the wall and CPU seconds the stage took (every seed that ran); then the estimated stages'
    total against the run's, also as the estimate reads at the load it was timed at."""
    totals = stage_totals(stages)
    print(f"\nup-front estimate: {estimate.summary()}")
    print(
        f"{'estimated stage':24s} {'about s':>8s} {'at most s':>9s} {'ran s':>8s} {'ran CPU s':>9s} {'ran/about':>9s}"
    )
    ran = 0.0
    for name, about in estimate.stages.items():
        wall, cpu = totals.get(measured_stage(name), (0.0, 0.0))
        ran += wall
        ratio = f"{wall / about:9.2f}" if about > 0 else f"{'':9s}"
        print(f"{name:24s} {about:8.1f} {estimate.ceilings.get(name, about):9.1f} {wall:8.1f} {cpu:9.1f} {ratio}")
    at_load = estimate.at_load
    print(
        f"{'estimated stages':24s} {estimate.total:8.1f} {estimate.ceiling:9.1f} {ran:8.1f} {'':9s} "
        f"{ran / estimate.total:9.2f}; at the load it was timed at the estimate reads {at_load:.1f} s "
        f"(ran / that {ran / at_load:.2f}; busy: {estimate.busy or 'no'})"
    )


def print_stages(stages: list[Stage], result: dict) -> None:
    attacks = result.get("attacks", {})
    python = stages[0].python_peak is not None
    header = f"{'stage':40s} {'seconds':>8s} {'CPU s':>7s} {'share':>6s} {'peak RSS MiB':>13s}"
    print(header + (f" {'py peak MiB':>12s}" if python else "") + "  status")
    total = stages[0].seconds
    for s in stages[1:] + stages[:1]:
        name = "  " * max(0, s.depth - 1) + s.name
        entry = attacks.get(s.name.removeprefix("attack "), {}) if s.name.startswith("attack ") else {}
        status = entry.get("status", "")
        if entry.get("reason"):
            status += f": {entry['reason'][:60]}"
        line = f"{name:40s} {s.seconds:8.2f} {s.cpu_seconds:7.1f} {s.seconds / total:6.1%} {s.peak_rss / 2**20:13.0f}"
        print(line + (f" {s.python_peak / 2**20:12.1f}" if python else "") + f"  {status}")
    top = sum(s.seconds for s in stages if s.depth == 1)
    print(f"{'other (imports, gate, summary)':40s} {total - top:8.2f} {'':7s} {(total - top) / total:6.1%}")
    for name, entry in attacks.items():
        print(f"{name}: {entry.get('status', '')}{headline_metric(entry)}")
    if "run" in result:
        print(f"report.json run.seconds: {result['run']['seconds']:.2f} (run_audit, without writing reports)")


def headline_metric(entry: dict) -> str:
    """The attack's first metric, its spread between seeds and the seeds run (", mse 0.0121 ± 0.0004, 3 seeds")."""
    metrics = entry.get("metrics") or {}
    if not metrics:
        return ""
    name, value = next(iter(metrics.items()))
    spread = (entry.get("metrics_std") or {}).get(name)
    spread_words = f" ± {spread:.3g}" if isinstance(spread, float) else ""
    return f", {name} {value:.4g}{spread_words}, {len(entry.get('seeds', []))} seeds"


if __name__ == "__main__":
    main()
