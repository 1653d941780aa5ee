"""The units of work an audit hands to an executor, and the one scheduler of the worker backends.

A unit is one seed of one attack at one noise sigma (a `SeedTask`) or one shard of the dFIL
traces' Jacobian products (a `ShardTask`). A seed task seeds torch's global generator from the
task alone (`run_seed_task`) and a shard carries its own seed, so a task's answer does not depend
on which tasks ran before it in the same process: whichever backend (and however many workers)
runs it, a task computes the same thing, bit for bit where it runs on as many CPU threads (docs/usage.md,
a task on more threads sums in another order, and training amplifies that). `schedule` runs tasks
on any backend's slots (heaviest first, retry once, time-outs); the backends (splitaudit.execution.executor,
splitaudit.execution.process_pool, splitaudit.execution.ray_executor) build on these names and nothing here imports them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Protocol

import torch
from tqdm import tqdm

from splitaudit.attacks import get_attack
from splitaudit.attacks.base import SeedOutcome
from splitaudit.context.audit_context import AuditContext
from splitaudit.estimators.mean_trace import Job

MAX_ATTEMPTS = 2  # a task that fails on a worker is retried once
POLL_SECONDS = 1.0  # how often a scheduler looks at its running tasks' time-outs


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
    def label(self) -> str:
        """What the progress bar shows while it runs."""
        return f"{self.attack} seed {self.seed}"

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

    label = "a dFIL shard"


Task = SeedTask | ShardTask
FollowUp = Callable[["TaskResult"], list[Task]]  # the tasks a settled result calls for


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


def no_follow_up(result: TaskResult) -> list[Task]:
    """No task depends on another's result (the dFIL shards)."""
    return []


class Executor(Protocol):
    name: str
    workers: int
    task_timeout: float | None

    def map(
        self, ctx: AuditContext, tasks: list[Task], bar: tqdm, follow_up: FollowUp = no_follow_up
    ) -> list[TaskResult]:
        """Every task's result, and those of the tasks `follow_up` adds as results settle, in the
        order given; a failing task never raises."""

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


def schedule(
    slots: Slots,
    tasks: list[Task],
    bar: tqdm,
    task_timeout: float | None,
    follow_up: FollowUp = no_follow_up,
) -> list[TaskResult]:
    """Every task's result, in the order the tasks were given or followed up: at most
    `slots.workers` run at once, the heaviest attacks first (so the last tasks to start are short
    ones and the workers finish together); a task that fails, or a timed one (an attack seed) that
    passes `task_timeout` (counted from its start), is retried once, then reported as failed.
    `follow_up(result)` gives the tasks a settled result calls for (a further seed), queued at
    once by their weight, so a worker never idles while another finishes a round."""
    tasks = list(tasks)
    results: dict[int, TaskResult] = {}
    queue: list[tuple[int, int]] = []  # (task index, attempt): retries first, then the heaviest
    running: dict = {}  # handle -> (index, attempt, start)

    def enqueue(index: int, attempt: int) -> None:
        queue.append((index, attempt))
        queue.sort(key=lambda entry: (entry[1] == 1, -tasks[entry[0]].relative_cost))  # stable: ties keep their order

    def settle(index: int, attempt: int, result: TaskResult) -> None:
        if result.error is not None and attempt < MAX_ATTEMPTS:
            enqueue(index, attempt + 1)
            return
        results[index] = result
        bar.update(tasks[index].units)
        for task in follow_up(result):
            tasks.append(task)
            enqueue(len(tasks) - 1, 1)

    for index in range(len(tasks)):
        enqueue(index, 1)
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
