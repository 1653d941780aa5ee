"""An up-front estimate of the audit's cost, stage by stage, so a long run says so before it starts.

Forward and backward passes of the encoder (and one step of the score network) are timed on
a small batch, then multiplied by the work each stage plans: the Jacobian products of the dFIL
traces (estimators/mean_trace.py's own plan, planned_products, and its pilot's time where it runs one),
the prior's capped training, and each
attack's own cost model (Attack.estimated_range / estimated_seconds: the optimization attack's inversion steps in
encoder passes, SDAR's training iterations and the decoder's steps up to its epoch cap, timed on
the model and data), over the seeds that always run (MIN_SEEDS; the others run only when the
first ones' spread demands, so every seed is the stage's ceiling, shown as "at most"). Attacks
whose training has a cap that early stopping usually ends sooner count their expected share of
it (Attack.expected_share_of_cap, measured on the benchmarks' models) in the expected time and
the whole cap in the ceiling. The estimate is rough (a randomised trace stops when its error
target is met), meant to tell minutes from hours. Attacks without a cost model are listed as not
estimated. Steps are timed in CPU seconds on a CPU (StepTimer), so that other work on the cores
does not inflate them, and the estimate says when the machine was busy and what that load makes
of it. Pure computation, no I/O.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from splitaudit.attacks.base import first_seeds
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.registries import PRIORS
from splitaudit.core.threads import threads_for, usable_cores
from splitaudit.estimators.mean_trace import default_method, planned_products
from splitaudit.estimators.prior import (
    EXPECTED_EPOCHS,
    QUICK_SCORE_SETTINGS,
    ScoreSettings,
    score_training_step,
    within_work_cap,
)

TIMING_BATCH = 16  # samples per timed pass (batches amortise per-call overhead, as the stages do)
MIN_CALLS, MAX_CALLS, TIMING_SECONDS = 3, 100, 1.5  # counted calls of a timed step, and how long it repeats
BUSY_SHARE = 0.5  # timed steps that got less of their threads' time than this ran beside other work
EVAL_PASSES_PER_EPOCH = 1  # the held-out loss: about one training step per held-out sample
T = TypeVar("T")
MIN_VALUES_TO_ESTIMATE = 2**20  # input values (aux + target); the bundled digits hold 115k


@dataclass
class CostEstimate:
    """Estimated seconds per stage (dFIL, prior, each estimated attack) and the attacks left out.

    `stages` holds what a stage is expected to take, `ceilings` the most it can take where that
    is more: an attack runs MIN_SEEDS seeds and adds the others only when their spread leaves
    the mean uncertain (attacks/base.py), and its early stopping usually ends a capped training
    sooner, so its expected time is its expected share of the cap over its first seeds and its
    ceiling the whole cap over every seed; the prior's score network likewise."""

    stages: dict[str, float] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)
    not_estimated: list[str] = field(default_factory=list)
    quick: bool = False  # the estimate is of a --quick audit
    busy: str = ""  # why the machine counted as busy while the steps were timed ("" when it did not)
    share: float = 1.0  # the share of their threads' time the timed steps got (StepTimer.share)

    @property
    def total(self) -> float:
        return sum(self.stages.values())

    @property
    def at_load(self) -> float:
        """What the estimated stages take at the load they were timed at: their CPU seconds run at
        `share` of a second a second."""
        return self.total / self.share

    @property
    def ceiling(self) -> float:
        """The most the estimated stages can take together."""
        return sum(self.ceilings.get(name, seconds) for name, seconds in self.stages.items())

    def summary(self) -> str:
        """One line: the total (and the most it can be) and each stage's share, and what was not estimated."""
        parts = ", ".join(f"{name} {duration(seconds)}" for name, seconds in self.stages.items() if seconds >= 1)
        left_out = f"; not estimated: {', '.join(self.not_estimated)}" if self.not_estimated else ""
        hint = "" if self.quick else "; --quick is faster"
        at_most = f" (at most {duration(self.ceiling)})" if duration(self.ceiling) != duration(self.total) else ""
        return f"this audit may take about {duration(self.total)}{at_most} ({parts}{left_out}){hint}{self.load_note()}"

    def load_note(self) -> str:
        """What the machine's load makes of the estimate, when it was busy while the steps were timed:
        the stages' times are CPU seconds, and at that load the run gets only `share` of them a second."""
        if not self.busy:
            return ""
        return f"; timed on a busy machine ({self.busy}): at this load about {duration(self.at_load)}"


def duration(seconds: float) -> str:
    """Seconds in the unit a reader takes in at a glance (s, min, h)."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def worth_estimating(ctx: AuditContext) -> bool:
    """Whether the data is large enough for the audit to possibly run for minutes; below that,
    the few seconds of timing an estimate costs would be most of the run (digits, tabular data)."""
    return ctx.aux.x.numel() + ctx.target.x.numel() >= MIN_VALUES_TO_ESTIMATE


def estimate_cost(
    ctx: AuditContext,
    prior: str,
    smoothing: float,
    attacks: list[str],
    dfil_samples: int | None = None,
    timer: StepTimer | None = None,
    dfil_rtol: float | None = None,
) -> CostEstimate:
    """Seconds each long stage of the audit is expected to take on ctx's model, data and device
    (`timer` times the steps: a StepTimer for the device by default)."""
    from splitaudit.stages.leakage import DFIL_MAX_SAMPLES, DFIL_RTOL, QUICK_DFIL_MAX_SAMPLES

    timer = timer or StepTimer(cpu_bound=ctx.device.type == "cpu")
    cap = dfil_samples or (QUICK_DFIL_MAX_SAMPLES if ctx.quick else DFIL_MAX_SAMPLES)
    estimate = CostEstimate(quick=ctx.quick)
    with threads_for(ctx.aux.x.numel(), ctx.device):  # the threads the stages themselves use
        pass_seconds = encoder_pass_seconds(ctx, timer)
        prior_expected, prior_ceiling = prior_seconds(ctx, prior, smoothing, timer)
        n, rtol = min(cap, len(ctx.target)), dfil_rtol or DFIL_RTOL
        estimate.stages["dFIL"] = dfil_seconds(ctx, n, rtol, pass_seconds, timer.clocks)
    estimate.stages[f"prior ({prior})"] = prior_expected
    estimate.ceilings[f"prior ({prior})"] = prior_ceiling
    for name in attacks:
        seconds = attack_seconds(ctx, name, pass_seconds, timer)
        if seconds is None:
            estimate.not_estimated.append(name)
        else:
            expected, cap = seconds
            estimate.stages[name] = expected * len(first_seeds(ctx.seeds)) / len(ctx.seeds)
            estimate.ceilings[name] = cap
    estimate.share = timer.share
    estimate.busy = busy_machine(timer.share, timer.clocks.load(), timer.clocks.cores())
    return estimate


def encoder_pass_seconds(ctx: AuditContext, timer: Callable[[Callable], float]) -> float:
    """Per-sample seconds of one forward + backward pass of the encoder on a small batch (of a
    forward pass for a black-box model: its Jacobians are finite differences)."""
    x = ctx.target.x[:TIMING_BATCH]
    if not ctx.encoder.differentiable:
        return timer(lambda: ctx.encoder(x)) / len(x)

    def forward_backward() -> None:
        point = x.detach().clone().requires_grad_(True)
        torch.autograd.grad(ctx.encoder(point).sum(), point)

    return timer(forward_backward) / len(x)


def load_average() -> float:
    """The machine's load average over the last minute (0 where the system does not tell it)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


@dataclass(frozen=True)
class Clocks:
    """What StepTimer reads: wall seconds, the process's CPU seconds (all its threads), the torch
    threads a step runs on, the load average and the usable cores (tests give fakes)."""

    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.process_time
    threads: Callable[[], int] = torch.get_num_threads
    load: Callable[[], float] = load_average
    cores: Callable[[], int] = usable_cores

    def timed(self, step: Callable[[], T]) -> tuple[T, float]:
        """step()'s result and the CPU seconds it took over the torch threads it ran on (the work
        itself, as StepTimer counts it)."""
        threads, start = max(1, self.threads()), self.cpu()
        result = step()
        return result, (self.cpu() - start) / threads


class StepTimer:
    """Seconds one call of a step takes: the median over calls repeated for TIMING_SECONDS (at least
    MIN_CALLS after a first call that is not counted: thread pools and allocations warm up in it).

    On a CPU a call counts its process CPU seconds over the torch threads it ran on: the work
    itself, which other processes on the cores do not stretch as they stretch wall seconds (the
    64 px battery's estimate read 10 h beside other jobs, against 25 minutes run on idle cores).
    On a GPU it counts wall seconds, which hold the device's time. The median, not the least:
    robust to a call that a page fault or a timer slowed, without betting on the luckiest one.
    The timer keeps the counted calls' wall and CPU seconds: their ratio (`share`) is how much of
    its threads' time the process got, which says how busy the machine was."""

    def __init__(self, cpu_bound: bool, clocks: Clocks = Clocks()) -> None:
        self.cpu_bound, self.clocks = cpu_bound, clocks
        self.wall_seconds = self.work_seconds = 0.0  # counted calls: wall, and CPU over threads

    def __call__(self, step: Callable[[], object]) -> float:
        clocks, calls = self.clocks, []
        start = clocks.wall()
        while len(calls) <= MIN_CALLS or (clocks.wall() - start < TIMING_SECONDS and len(calls) <= MAX_CALLS):
            threads, wall, cpu = max(1, clocks.threads()), clocks.wall(), clocks.cpu()
            step()
            calls.append((clocks.wall() - wall, (clocks.cpu() - cpu) / threads))
        counted = calls[1:]
        self.wall_seconds += sum(wall for wall, _ in counted)
        self.work_seconds += sum(work for _, work in counted)
        return statistics.median(work if self.cpu_bound else wall for wall, work in counted)

    @property
    def share(self) -> float:
        """The share of their threads' time the counted calls got (1: the cores were theirs)."""
        if self.wall_seconds <= 0 or not self.cpu_bound:
            return 1.0
        return min(1.0, self.work_seconds / self.wall_seconds)


def busy_machine(share: float, load: float, cores: int) -> str:
    """Why the machine counts as busy, or "": a one-minute load average above its usable cores, or
    timed steps that got under BUSY_SHARE of their threads' time."""
    if load <= cores and share >= BUSY_SHARE:
        return ""
    return f"load average {load:.1f} on {cores} cores, the timed steps got {share:.0%} of their threads' time"


def dfil_seconds(ctx: AuditContext, n: int, rtol: float, pass_seconds: float, clocks: Clocks) -> float:
    """CPU seconds of the dFIL traces of n samples: the products estimators/mean_trace.py plans by its
    own choice, each at a forward + backward pass, or where it runs a pilot of random probes, at
    what the pilot's products took, the pilot timed alone (forward-mode products cost more than a
    backward pass)."""
    from splitaudit.stages.leakage import dfil_mean_options

    pilot_seconds = []
    method, options = default_method(ctx.encoder.differentiable), dfil_mean_options(ctx, rtol)
    planned = planned_products(
        ctx.encoder,
        ctx.target.x[:n],
        method,
        options,
        run_pilot=lambda pilot: pilot_seconds.append(clocks.timed(pilot)[1]),
    )
    if not pilot_seconds:
        return planned.products * pass_seconds
    return planned.products * pilot_seconds[0] / planned.pilot_products


def prior_seconds(
    ctx: AuditContext, prior: str, smoothing: float, timer: Callable[[Callable], float]
) -> tuple[float, float]:
    """(expected, at most) seconds of the score network's training, 0 for a closed-form prior: at
    most its epoch cap (after the work cap), expected EXPECTED_EPOCHS of it, where its early
    stopping usually ends it; an epoch is its samples' steps at the per-sample time of one step
    on the batch the training uses."""
    if not PRIORS[prior].trains:
        return 0.0, 0.0
    x = ctx.aux.x
    settings = within_work_cap(len(x), x[0].numel(), QUICK_SCORE_SETTINGS if ctx.quick else ScoreSettings())
    n = min(len(x), settings.max_samples)
    heldout = max(1, round(settings.heldout_fraction * n))
    step, batch = score_training_step(x, prior, smoothing, min(settings.batch_size, max(1, n - heldout)))
    epoch = (n + EVAL_PASSES_PER_EPOCH * heldout) * timer(step) / batch
    return min(settings.max_epochs, EXPECTED_EPOCHS) * epoch, settings.max_epochs * epoch


def attack_seconds(
    ctx: AuditContext, name: str, pass_seconds: float, timer: Callable[[Callable], float]
) -> tuple[float, float] | None:
    """(expected, at most) seconds of an attack over all its seeds, from the attack's own cost model
    (None for the attacks without one): its training cap, and the share of it early stopping is
    expected to leave; 0 for an attack these inputs skip (SDAR on token inputs)."""
    from splitaudit.attacks import get_attack

    attack = get_attack(name)
    if attack.missing(ctx):
        return 0.0, 0.0
    return attack.estimated_range(ctx, pass_seconds, timer)
