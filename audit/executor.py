"""Where the attacks run: in this process (`local`, the default) or as tasks on Ray (`ray`).

The unit of work is one seed of one attack at one noise sigma (a `SeedTask`). Both backends run
it through `run_seed_task`, which seeds torch's global generator from the task alone, so a
task's answer does not depend on which tasks ran before it in the same process: the report's
numbers are the same whichever backend (and however many workers) ran them. The Ray backend
lives in `splitaudit.ray_executor` and is imported only when asked for, so nothing else needs Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch
from tqdm import tqdm

from splitaudit.attacks import get_attack
from splitaudit.attacks.base import SeedOutcome
from splitaudit.config import EXECUTORS
from splitaudit.context import AuditContext, silent_progress
from splitaudit.errors import InputError

RAY_INSTALL_HINT = 'the ray executor needs Ray: pip install "splitaudit[ray]" (or pip install ray)'


@dataclass(frozen=True)
class SeedTask:
    """One seed of one attack at one noise sigma."""

    attack: str
    seed: int
    noise_sigma: float


@dataclass
class TaskResult:
    """What became of a task: its outcome, or why it failed, and what it cost."""

    task: SeedTask
    outcome: SeedOutcome | None
    error: str | None
    seconds: float
    attempts: int = 1
    worker: str = "local"

    def record(self) -> dict:
        """The task's line in report.json's run.tasks."""
        return {
            "attack": self.task.attack,
            "seed": self.task.seed,
            "noise_sigma": self.task.noise_sigma,
            "status": "ok" if self.error is None else "failed",
            "seconds": self.seconds,
            "attempts": self.attempts,
            "worker": self.worker,
        }


class Executor(Protocol):
    name: str
    workers: int

    def map(self, ctx: AuditContext, tasks: list[SeedTask], bar: tqdm) -> list[TaskResult]:
        """Every task's result, in the tasks' order; a failing task never raises."""

    def close(self) -> None:
        """Release what the executor started."""


def run_seed_task(ctx: AuditContext, task: SeedTask) -> SeedOutcome:
    """Run one task on a context: the attack's run_seed at the task's sigma, with torch's global
    generator seeded from the task (and restored afterwards) so the order of tasks is irrelevant."""
    point = replace(ctx, noise_sigma=task.noise_sigma)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(task.seed)
        return get_attack(task.attack).run_seed(point, task.seed)


def timed_task(ctx: AuditContext, task: SeedTask) -> tuple[SeedOutcome | None, str | None, float]:
    """(outcome, None, seconds) or (None, reason, seconds): an attack's failure is data, not an error."""
    start = time.perf_counter()
    try:
        return run_seed_task(ctx, task), None, time.perf_counter() - start
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}", time.perf_counter() - start


class LocalExecutor:
    """Today's loop: every task in this process, one after the other."""

    name = "local"
    workers = 1

    def map(self, ctx: AuditContext, tasks: list[SeedTask], bar: tqdm) -> list[TaskResult]:
        results = []
        for task in tasks:
            bar.set_postfix_str(f"running 1, {task.attack} seed {task.seed}")
            outcome, error, seconds = timed_task(ctx, task)
            results.append(TaskResult(task, outcome, error, seconds))
            bar.update()
        return results

    def close(self) -> None:
        pass


def require_ray() -> None:
    """InputError (exit 2) with the install command when Ray cannot be imported."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise InputError(RAY_INSTALL_HINT) from exc


def open_executor(name: str, options, ctx: AuditContext) -> Executor:
    """The backend an audit asked for (`--executor`); Ray is imported only here, only for `ray`."""
    if name == "local":
        return LocalExecutor()
    if name != "ray":
        raise InputError(f"--executor must be one of {', '.join(EXECUTORS)}, got {name!r}")
    require_ray()
    from splitaudit.ray_executor import RayExecutor

    return RayExecutor(options, ctx, address=options.ray_address, task_timeout=options.task_timeout)


def run_attack_grid(
    ctx: AuditContext,
    names: list[str],
    sigmas: list[float],
    executor: Executor,
    progress: Callable[..., tqdm] = silent_progress,
) -> tuple[dict[float, dict], list[TaskResult]]:
    """Every attack at every sigma, each seed a task on the executor; returns {sigma: {attack:
    report entry}} (skipped, failed or ok as `Attack.run` gives them) and every task's result."""
    attacks = {name: get_attack(name) for name in names}
    runnable = [name for name, attack in attacks.items() if attack.missing(ctx) is None]
    tasks = [SeedTask(name, seed, sigma) for sigma in sigmas for name in runnable for seed in ctx.seeds]
    with progress(total=len(tasks), desc=f"attacks ({executor.name})", unit="task") as bar:
        results = executor.map(ctx, tasks, bar) if tasks else []
    by_key = {(r.task.noise_sigma, r.task.attack): [] for r in results}
    for r in results:
        by_key[(r.task.noise_sigma, r.task.attack)].append(r)
    grid = {}
    for sigma in sigmas:
        grid[sigma] = {}
        for name, attack in attacks.items():
            reason = attack.missing(ctx)
            grid[sigma][name] = (
                attack.skipped(reason) if reason else attack_entry(attack, ctx.seeds, by_key[(sigma, name)])
            )
    return grid, results


def attack_entry(attack, seeds: list[int], results: list[TaskResult]) -> dict:
    """The attack's report entry from its seeds' task results: failed if any seed failed."""
    seconds = sum(r.seconds for r in results)
    failures = [r for r in results if r.error is not None]
    if failures:
        first = failures[0]
        return attack.failed(f"seed {first.task.seed}: {first.error}", seconds)
    return attack.summarize(seeds, [r.outcome for r in results], seconds)


def describe_executor(executor: Executor, results: list[TaskResult], task_timeout: float | None) -> dict:
    """The run section's executor keys: backend, workers, time-out and each task's wall time."""
    return {
        "executor": executor.name,
        "workers": executor.workers,
        "task_timeout": task_timeout,
        "tasks": [r.record() for r in results],
    }
