"""Which backend runs the audit's tasks, and the attack grid on it: in this process (`local`, the
default), on local worker processes (`--workers N`, splitaudit.execution.process_pool) or on Ray (`ray`,
splitaudit.execution.ray_executor). The tasks and their scheduler are in splitaudit.execution.tasks, which the
backends import; this module picks a backend and imports it only then (Ray only when asked for).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from tqdm import tqdm

from splitaudit.attacks import get_attack
from splitaudit.attacks.base import first_seeds
from splitaudit.context.audit_context import AuditContext, silent_progress
from splitaudit.core.config import EXECUTORS
from splitaudit.core.errors import InputError
from splitaudit.core.safety import machine_memory_bytes
from splitaudit.core.threads import SMALL_WORK, usable_cores
from splitaudit.estimators.mean_trace import Job
from splitaudit.execution.recipe import Recipe, make_recipe
from splitaudit.execution.tasks import (
    Executor,
    FollowUp,
    SeedTask,
    ShardTask,
    Task,
    TaskResult,
    no_follow_up,
    timed_task,
)

RAY_INSTALL_HINT = 'the ray executor needs Ray: pip install "splitaudit[ray]" (or pip install ray)'


class LocalExecutor:
    """Every task in this process, one after the other (no worker to start, hence no time-out)."""

    name = "local"
    workers = 1
    task_timeout = None  # a time-out needs a worker process (ProcessPool)

    def map(
        self, ctx: AuditContext, tasks: list[Task], bar: tqdm, follow_up: FollowUp = no_follow_up
    ) -> list[TaskResult]:
        tasks, results = list(tasks), []
        for task in tasks:  # grows as follow_up adds tasks
            bar.set_postfix_str(f"running 1, {task.label}")
            outcome, error, seconds = timed_task(ctx, task)
            results.append(TaskResult(task, outcome, error, seconds))
            bar.update(task.units)
            tasks += follow_up(results[-1])
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
    """The backend an audit asked for (`--executor`, `--workers`), its workers rebuilding ctx."""
    workers = local_workers(options.workers, ctx) if name == "local" else 1
    return open_backend(name, options, lambda: make_recipe(options, ctx), ctx.device, workers, options.task_timeout)


def open_backend(
    name: str,
    options,
    recipe: Callable[[], Recipe],
    device: torch.device,
    workers: int,
    task_timeout: float | None,
) -> Executor:
    """The backend `name` with `workers` local workers (local) or the cluster's slots (ray), whose
    workers rebuild what their tasks run on from `recipe()` (called only when there are workers);
    Ray is imported only here, only for `ray`."""
    if name == "local":
        if workers == 1 and task_timeout is None:
            return LocalExecutor()  # a time-out needs a worker process that can be stopped
        from splitaudit.execution.process_pool import ProcessPool

        return ProcessPool(recipe(), device, workers, task_timeout=task_timeout)
    if name != "ray":
        raise InputError(f"--executor must be one of {', '.join(EXECUTORS)}, got {name!r}")
    require_ray()
    from splitaudit.execution.ray_executor import RayExecutor

    return RayExecutor(recipe(), device, address=options.ray_address, task_timeout=task_timeout)


WORKER_BASE_BYTES = 768 * 1024**2  # a spawned worker before its data: Python, torch, model, working memory


def local_workers(asked: int | None, ctx: AuditContext) -> int:
    """Worker processes for the local executor: as asked, or (None: auto) one per CPU core this
    process may use, as many as half this machine's memory holds (each keeps its own copy of the
    model and data). Auto gives one where workers cannot help: on a GPU (processes would only
    queue for the one device), for --quick smoke runs (a worker's start-up, ~4 s, costs more than
    their short tasks), and for data of SMALL_WORK values or more, whose tasks already use every
    core (splitaudit.core.threads; a 64 px ConvNeXt-style stem, 150 aux images: 166 s in one process,
    185 s on 2 workers of one thread each)."""
    if asked is not None:
        return asked
    if ctx.device.type != "cpu" or ctx.quick or ctx.aux.x.numel() >= SMALL_WORK:
        return 1
    return max(1, min(usable_cores(), machine_memory_bytes() // 2 // worker_bytes(ctx)))


def worker_bytes(ctx: AuditContext) -> int:
    """A worker's memory: the base, its data (twice: loading copies it) and the model's weights."""
    data = sum(part.x.numel() * part.x.element_size() for part in (ctx.aux, ctx.target))
    architecture = ctx.encoder.architecture()
    weights = sum(p.numel() * p.element_size() for p in architecture.parameters()) if architecture else 0
    return WORKER_BASE_BYTES + 2 * data + weights


def run_attack_grid(
    ctx: AuditContext,
    names: list[str],
    sigmas: list[float],
    executor: Executor,
    progress: Callable[..., tqdm] = silent_progress,
) -> tuple[dict[float, dict], list[TaskResult]]:
    """Every attack at every sigma, each seed a task on the executor; returns {sigma: {attack:
    report entry}} (skipped, failed or ok as `Attack.run` gives them) and every task's result.
    The first seeds of every (sigma, attack) start side by side; a further seed is queued as soon
    as an attack's seeds so far have finished and their spread calls for it (Attack.next_seed)."""
    attacks = {name: get_attack(name) for name in names}
    runnable = [name for name, attack in attacks.items() if attack.missing(ctx) is None]
    by_key: dict[tuple[float, str], list[TaskResult]] = {(sigma, name): [] for sigma in sigmas for name in runnable}
    first = [SeedTask(name, seed, sigma) for sigma, name in by_key for seed in first_seeds(ctx.seeds)]
    unfinished = Counter((task.noise_sigma, task.attack) for task in first)
    with progress(total=len(first), desc=f"attacks ({executor.name})", unit="task") as bar:

        def follow_up(result: TaskResult) -> list[SeedTask]:
            key = (result.task.noise_sigma, result.task.attack)
            by_key[key].append(result)
            unfinished[key] -= 1
            further = [] if unfinished[key] else further_seed(attacks[key[1]], key, by_key[key], ctx.seeds)
            unfinished[key] += len(further)
            bar.total += len(further)
            bar.refresh()
            return further

        results = executor.map(ctx, first, bar, follow_up)
    grid = {}
    for sigma in sigmas:
        grid[sigma] = {}
        for name, attack in attacks.items():
            reason = attack.missing(ctx)
            grid[sigma][name] = attack.skipped(reason) if reason else attack_entry(attack, by_key[(sigma, name)])
    return grid, results


def further_seed(attack, key: tuple[float, str], done: list[TaskResult], seeds: list[int]) -> list[SeedTask]:
    """The next seed of an (sigma, attack) whose seeds so far have all finished, as Attack.next_seed
    decides from their outcomes in seed order; none after a failed seed."""
    if any(r.error is not None for r in done):
        return []
    outcomes = [r.outcome for r in sorted(done, key=lambda r: r.task.seed)]
    seed = attack.next_seed(seeds, outcomes)
    return [] if seed is None else [SeedTask(key[1], seed, key[0])]


def attack_entry(attack, results: list[TaskResult]) -> dict:
    """The attack's report entry from its seeds' task results (in seed order, whichever finished
    first): failed if any seed failed."""
    results = sorted(results, key=lambda r: r.task.seed)
    seconds = sum(r.seconds for r in results)
    failures = [r for r in results if r.error is not None]
    if failures:
        first = failures[0]
        return attack.failed(f"seed {first.task.seed}: {first.error}", seconds)
    return attack.summarize([r.task.seed for r in results], [r.outcome for r in results], seconds)


class ShardFailed(RuntimeError):
    """A dFIL shard failed on its worker twice: without all its products there is no bound."""


class ShardRunner:
    """The dFIL traces' Jacobian-product shards as tasks on an executor's workers (a JobRunner of
    estimators/mean_trace.py); keeps their results for the run section."""

    def __init__(self, executor: Executor, ctx: AuditContext) -> None:
        self.executor, self.ctx = executor, ctx
        self.results: list[TaskResult] = []

    def __call__(self, jobs: list[Job], on_samples: Callable[[int], None]) -> list:
        results = self.executor.map(self.ctx, [ShardTask(job.to("cpu")) for job in jobs], SamplesBar(on_samples))
        self.results += results
        failed = next((r for r in results if r.error is not None), None)
        if failed is not None:
            raise ShardFailed(f"a dFIL shard failed on its worker after {failed.attempts} attempts: {failed.error}")
        return [r.outcome for r in results]

    def summary(self) -> dict:
        """The run section's dfil_shards: how many shard tasks, their summed wall time, retries."""
        return {
            "tasks": len(self.results),
            "seconds": sum(r.seconds for r in self.results),
            "retried": sum(r.attempts > 1 for r in self.results),
        }


class SamplesBar:
    """The progress interface schedule() drives, reporting finished samples to the trace estimate."""

    def __init__(self, on_samples: Callable[[int], None]) -> None:
        self.update = on_samples

    def set_postfix_str(self, _text: str) -> None:
        pass


def trace_runner(executor: Executor, ctx: AuditContext) -> ShardRunner | None:
    """Shards on the executor's workers, or None (run in this process) for the in-process loop."""
    return None if isinstance(executor, LocalExecutor) else ShardRunner(executor, ctx)


def describe_executor(executor: Executor, results: list[TaskResult], shards: ShardRunner | None = None) -> dict:
    """The run section's executor keys: backend, workers, time-out, each attack task's wall time
    and, when the dFIL traces ran on the workers, their shards."""
    described = {
        "executor": executor.name,
        "workers": executor.workers,
        "task_timeout": executor.task_timeout,
        "tasks": [r.record() for r in results],
    }
    if shards is not None:
        described["dfil_shards"] = shards.summary()
    return described
