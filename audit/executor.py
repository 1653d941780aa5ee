"""Where the audit's tasks run: in this process (`local`, the default), on local worker processes
(`--workers N`, splitaudit.process_pool) or on Ray (`ray`, splitaudit.ray_executor).

The units of work are one seed of one attack at one noise sigma (a `SeedTask`) and one shard of
the dFIL traces' Jacobian products (a `ShardTask`). A seed task seeds torch's global generator
from the task alone (`run_seed_task`) and a shard carries its own seed, so a task's answer does
not depend on which tasks ran before it in the same process: whichever backend (and however
many workers) runs it, a task computes the same thing, bit for bit where it runs on as many CPU
threads (README: a task on more threads sums in another order, and training amplifies that). `schedule` is the one scheduler of the
worker backends (heaviest first, retry once, time-outs). Ray is imported only when asked for.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Protocol

import torch
from tqdm import tqdm

from splitaudit.attacks import get_attack
from splitaudit.attacks.base import MIN_SEEDS, SeedOutcome
from splitaudit.config import EXECUTORS
from splitaudit.context import AuditContext, silent_progress
from splitaudit.errors import InputError
from splitaudit.estimators.mean_trace import Job
from splitaudit.safety import machine_memory_bytes
from splitaudit.threads import SMALL_WORK

MAX_ATTEMPTS = 2  # a task that fails on a worker is retried once
POLL_SECONDS = 1.0  # how often a scheduler looks at its running tasks' time-outs
RAY_INSTALL_HINT = 'the ray executor needs Ray: pip install "splitaudit[ray]" (or pip install ray)'


@dataclass(frozen=True)
class SeedTask:
    """One seed of one attack at one noise sigma."""

    attack: str
    seed: int
    noise_sigma: float
    units = 1  # progress units
    timed = True  # --task-timeout bounds it

    def run(self, ctx: AuditContext) -> SeedOutcome:
        return run_seed_task(ctx, self)

    @property
    def relative_cost(self) -> float:
        """The attack's scheduling hint; an unknown name fails on its worker like any task error."""
        try:
            return get_attack(self.attack).relative_cost
        except KeyError:
            return 1.0


@dataclass(frozen=True)
class ShardTask:
    """A shard of the dFIL traces' Jacobian products (estimators/mean_trace.py's jobs), run with the
    worker's own copy of the encoder; the job travels on the CPU and its result comes back there."""

    job: Job
    relative_cost = 1.0
    timed = False  # --task-timeout bounds attack seeds: a shard's size is ours, not the user's, and
    # without every shard there is no bound at all (a shard still fails after MAX_ATTEMPTS crashes)

    @property
    def units(self) -> int:  # progress units: samples
        return len(self.job.x)

    def run(self, ctx: AuditContext):
        result = self.job.to(ctx.device).run(ctx.encoder)
        return result.to("cpu")


Task = SeedTask | ShardTask


@dataclass
class TaskResult:
    """What became of a task: its outcome, or why it failed, and what it cost."""

    task: Task
    outcome: object  # SeedOutcome for a SeedTask, the job's result for a ShardTask; None on failure
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
    task_timeout: float | None

    def map(self, ctx: AuditContext, tasks: list[Task], bar: tqdm) -> list[TaskResult]:
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


def timed_task(ctx: AuditContext, task: Task) -> tuple[object, str | None, float]:
    """(outcome, None, seconds) or (None, reason, seconds): a task's failure is data, not an error."""
    start = time.perf_counter()
    try:
        return task.run(ctx), None, time.perf_counter() - start
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}", time.perf_counter() - start


class LocalExecutor:
    """Today's loop: every task in this process, one after the other."""

    name = "local"
    workers = 1
    task_timeout = None  # a time-out needs a worker process (ProcessPool)

    def map(self, ctx: AuditContext, tasks: list[Task], bar: tqdm) -> list[TaskResult]:
        results = []
        for task in tasks:
            bar.set_postfix_str(f"running 1, {task.attack} seed {task.seed}")
            outcome, error, seconds = timed_task(ctx, task)
            results.append(TaskResult(task, outcome, error, seconds))
            bar.update(task.units)
        return results

    def close(self) -> None:
        pass


class Slots(Protocol):
    """Where a scheduler starts tasks: `workers` at a time (a pool of processes, a Ray cluster)."""

    workers: int

    def start(self, task: Task) -> Hashable:
        """Start the task; a handle to wait on."""

    def wait(self, handles: list[Hashable], timeout: float) -> list[tuple[Hashable, Finished]]:
        """The handles that finished within `timeout` seconds, each with what came back."""

    def cancel(self, handle: Hashable) -> None:
        """Stop a running task (its time-out passed) and free its slot."""


@dataclass
class Finished:
    """What a finished task gave back: its outcome or the reason it failed, where it ran."""

    outcome: SeedOutcome | None
    error: str | None
    seconds: float | None  # None: the worker was lost, the scheduler counts from the task's start
    worker: str


def schedule(slots: Slots, tasks: list[Task], bar: tqdm, task_timeout: float | None) -> list[TaskResult]:
    """Every task's result, in the tasks' order: at most `slots.workers` run at once, the heaviest
    attacks first (so the last tasks to start are short ones and the workers finish together);
    a task that fails, or a timed one (an attack seed) that passes `task_timeout` (counted from its
    start), is retried once, then reported as failed."""
    results: dict[int, TaskResult] = {}
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i].relative_cost)
    queue = [(i, 1) for i in order]  # (task index, attempt)
    running: dict = {}  # handle -> (index, attempt, start)

    def settle(index: int, attempt: int, result: TaskResult) -> None:
        if result.error is not None and attempt < MAX_ATTEMPTS:
            queue.insert(0, (index, attempt + 1))
        else:
            results[index] = result
            bar.update(tasks[index].units)

    while queue or running:
        while queue and len(running) < slots.workers:
            index, attempt = queue.pop(0)
            running[slots.start(tasks[index])] = (index, attempt, time.monotonic())
        bar.set_postfix_str(f"running {len(running)}")
        timed = {h: entry for h, entry in running.items() if tasks[entry[0]].timed}
        for handle, done in slots.wait(list(running), _seconds_to_wait(timed, task_timeout)):
            index, attempt, start = running.pop(handle)
            seconds = done.seconds if done.seconds is not None else time.monotonic() - start
            settle(index, attempt, TaskResult(tasks[index], done.outcome, done.error, seconds, attempt, done.worker))
        for handle, (index, attempt, start) in list(running.items()):
            if tasks[index].timed and task_timeout is not None and time.monotonic() - start > task_timeout:
                slots.cancel(handle)
                running.pop(handle)
                reason = f"timed out after {task_timeout:g} s (--task-timeout), {attempt} attempts"
                settle(index, attempt, TaskResult(tasks[index], None, reason, time.monotonic() - start, attempt, ""))
    return [results[i] for i in range(len(tasks))]


def _seconds_to_wait(running: dict, task_timeout: float | None) -> float:
    """Until the next poll, or sooner when a running timed task reaches its time-out."""
    if task_timeout is None or not running:
        return POLL_SECONDS
    first_deadline = min(start for _, _, start in running.values()) + task_timeout
    return min(POLL_SECONDS, max(0.0, first_deadline - time.monotonic()))


def require_ray() -> None:
    """InputError (exit 2) with the install command when Ray cannot be imported."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise InputError(RAY_INSTALL_HINT) from exc


def open_executor(name: str, options, ctx: AuditContext) -> Executor:
    """The backend an audit asked for (`--executor`, `--workers`); Ray is imported only here, only for `ray`."""
    if name == "local":
        workers = local_workers(options.workers, ctx)
        if workers == 1 and options.task_timeout is None:
            return LocalExecutor()  # a time-out needs a worker process that can be stopped
        from splitaudit.process_pool import ProcessPool

        return ProcessPool(options, ctx, workers, task_timeout=options.task_timeout)
    if name != "ray":
        raise InputError(f"--executor must be one of {', '.join(EXECUTORS)}, got {name!r}")
    require_ray()
    from splitaudit.ray_executor import RayExecutor

    return RayExecutor(options, ctx, address=options.ray_address, task_timeout=options.task_timeout)


WORKER_BASE_BYTES = 768 * 1024**2  # a spawned worker before its data: Python, torch, model, working memory


def local_workers(asked: int | None, ctx: AuditContext) -> int:
    """Worker processes for the local executor: as asked, or (None: auto) one per CPU core this
    process may use, as many as half this machine's memory holds (each keeps its own copy of the
    model and data). Auto gives one where workers cannot help: on a GPU (processes would only
    queue for the one device), for --quick smoke runs (a worker's start-up, ~4 s, costs more than
    their short tasks), and for data of SMALL_WORK values or more, whose tasks already use every
    core (splitaudit.threads; a 64 px ConvNeXt-style stem, 150 aux images: 166 s in one process,
    185 s on 2 workers of one thread each)."""
    if asked is not None:
        return asked
    if ctx.device.type != "cpu" or ctx.quick or ctx.aux.x.numel() >= SMALL_WORK:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, machine_memory_bytes() // 2 // worker_bytes(ctx)))


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
    report entry}} (skipped, failed or ok as `Attack.run` gives them) and every task's result."""
    attacks = {name: get_attack(name) for name in names}
    runnable = [name for name, attack in attacks.items() if attack.missing(ctx) is None]
    by_key: dict[tuple[float, str], list[TaskResult]] = {(sigma, name): [] for sigma in sigmas for name in runnable}
    results: list[TaskResult] = []
    with progress(total=0, desc=f"attacks ({executor.name})", unit="task") as bar:
        while tasks := next_seed_tasks(attacks, by_key, ctx.seeds):
            bar.total += len(tasks)
            bar.refresh()
            for result in executor.map(ctx, tasks, bar):
                by_key[(result.task.noise_sigma, result.task.attack)].append(result)
                results.append(result)
    grid = {}
    for sigma in sigmas:
        grid[sigma] = {}
        for name, attack in attacks.items():
            reason = attack.missing(ctx)
            grid[sigma][name] = attack.skipped(reason) if reason else attack_entry(attack, by_key[(sigma, name)])
    return grid, results


def next_seed_tasks(
    attacks: dict, by_key: dict[tuple[float, str], list[TaskResult]], seeds: list[int]
) -> list[SeedTask]:
    """One round of seed tasks: the first MIN_SEEDS seeds of every (sigma, attack) side by side,
    then one more wherever Attack.next_seed still calls for it; none after a failed seed."""
    tasks = []
    for (sigma, name), done in by_key.items():
        if not done:
            tasks += [SeedTask(name, seed, sigma) for seed in seeds[:MIN_SEEDS]]
        elif all(r.error is None for r in done):
            seed = attacks[name].next_seed(seeds, [r.outcome for r in done])
            tasks += [] if seed is None else [SeedTask(name, seed, sigma)]
    return tasks


def attack_entry(attack, results: list[TaskResult]) -> dict:
    """The attack's report entry from its seeds' task results: failed if any seed failed."""
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
