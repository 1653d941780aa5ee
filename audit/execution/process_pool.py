"""The local executor's worker processes (`--workers N`, or any `--task-timeout`): attack seeds
and dFIL shards on this machine's cores.

Each worker is a fresh (spawned) Python process that rebuilds the audit context once from the
parent's recipe (splitaudit.execution.recipe) and then runs the tasks it is sent, one at a time, each
through the same `timed_task` as the in-process loop, on its share of the parent's threads.
Every worker talks over its own pipe: a worker stopped for its time-out, or one that dies, takes
nothing down with it; its task is retried once on a fresh worker (tasks.schedule), then
reported as that attack's failure. Workers ignore Ctrl-C; the parent stops them. A stopped
worker exits through its `finally` blocks (SIGTERM raises SystemExit), so its model copy and its
semaphores are released; the pool's scratch folder, which holds every worker's model copy, is
removed by the parent however the pool ends.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait

import torch
from tqdm import tqdm

from splitaudit.core.errors import InputError
from splitaudit.execution.recipe import Recipe
from splitaudit.execution.tasks import Finished, FollowUp, Task, TaskResult, no_follow_up, schedule, timed_task

STOP_SECONDS = 5.0  # how long a worker may take to exit when asked, before it is terminated


def serve(recipe: Recipe, device: str, threads: int, conn: Connection) -> None:
    """A worker's life: rebuild the context (or the recipe's other state) and say so, then answer (token, task) messages until
    None, or until the parent is gone (its end of the pipe closed: nothing left to answer)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_term)
    torch.set_num_threads(threads)
    name = f"local/{os.getpid()}"
    try:
        ctx, failure = recipe.rebuild(device), None
    except Exception as exc:  # reported with every task it is sent, never raised in the parent
        ctx, failure = None, f"the worker could not rebuild the audit context: {type(exc).__name__}: {exc}"
    try:
        _send(conn, "ready")
        while (message := _receive(conn)) is not None:
            token, task = message
            outcome, error, seconds = timed_task(ctx, task) if ctx is not None else (None, failure, 0.0)
            _send(conn, (token, Finished(outcome, error, seconds, name)))
    except (EOFError, BrokenPipeError):
        return


def _exit_on_term(signum, _frame) -> None:
    """SIGTERM (the parent's terminate()) as SystemExit: with-blocks and finalizers still run."""
    sys.exit(128 + signum)


def _send(conn: Connection, message) -> None:
    """Pickle by value: a tensor sent the multiprocessing way travels as a file descriptor that the
    sender's resource-sharer thread hands over later, and a worker stopped before it takes it
    makes that thread print tracebacks (and leak the descriptor)."""
    conn.send_bytes(pickle.dumps(message))


def _receive(conn: Connection):
    return pickle.loads(conn.recv_bytes())


@dataclass
class Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    token: int | None = None  # the task it runs, if any


class ProcessPool:
    """`workers` spawned processes, each with its own copy of what the recipe rebuilds."""

    name = "local"

    def __init__(self, recipe: Recipe, device: torch.device, workers: int, task_timeout: float | None = None) -> None:
        self.workers, self.task_timeout = workers, task_timeout
        self.scratch = tempfile.TemporaryDirectory(prefix="splitaudit-worker-")
        self.recipe = replace(recipe, scratch=self.scratch.name)
        self.device = device.type
        self.threads = max(1, torch.get_num_threads() // workers)
        self.spawn = multiprocessing.get_context("spawn")
        self.tokens = itertools.count()
        self.pool: list[Worker] = []
        try:
            self.pool += [self._spawn() for _ in range(workers)]
            for worker in self.pool:  # they rebuild in parallel; a task's time-out counts from its start
                self._until_ready(worker)
        except BaseException:  # a worker that cannot start, or Ctrl-C: stop those started, remove their files
            self.close()
            raise

    def _spawn(self) -> Worker:
        parent, child = self.spawn.Pipe()
        process = self.spawn.Process(
            target=serve, args=(self.recipe, self.device, self.threads, child), daemon=True, name="splitaudit-worker"
        )
        try:
            process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an in-memory model that cannot travel
            raise InputError(
                f"worker processes need a model and data that pickle ({type(exc).__name__}: {exc}); "
                "use --workers 1 (workers=1)"
            ) from exc
        child.close()
        return Worker(process, parent)

    @staticmethod
    def _until_ready(worker: Worker) -> None:
        """Wait for the worker's context (a worker that dies first is found by the next task)."""
        try:
            _receive(worker.conn)
        except (EOFError, OSError):
            pass

    def map(self, ctx, tasks: list[Task], bar: tqdm, follow_up: FollowUp = no_follow_up) -> list[TaskResult]:
        return schedule(self, tasks, bar, self.task_timeout, follow_up)

    def start(self, task: Task) -> int:
        worker = next(w for w in self.pool if w.token is None)
        worker.token = next(self.tokens)
        try:
            _send(worker.conn, (worker.token, task))
        except (BrokenPipeError, OSError):  # it died idle: wait() finds its pipe closed and says so
            pass
        return worker.token

    def wait(self, handles: list[int], timeout: float) -> list[tuple[int, Finished]]:
        busy = {w.conn: w for w in self.pool if w.token in handles}
        finished = []
        for conn in wait(list(busy), timeout):
            worker = busy[conn]
            try:
                token, done = _receive(conn)
            except (EOFError, OSError):  # the process died mid-task (killed, out of memory, crashed)
                worker.process.join(STOP_SECONDS)
                token = worker.token
                done = Finished(None, f"worker process died (exit code {worker.process.exitcode})", None, "")
                self._replace(worker)
            else:
                worker.token = None
            finished.append((token, done))
        return finished

    def cancel(self, handle: int) -> None:
        """Stop the worker running `handle` (its time-out passed) and start a fresh one in its place."""
        worker = next(w for w in self.pool if w.token == handle)
        _stop(worker.process, asked=False)
        self._replace(worker)

    def _replace(self, worker: Worker) -> None:
        worker.conn.close()
        fresh = self._spawn()
        self._until_ready(fresh)
        self.pool[self.pool.index(worker)] = fresh

    def close(self) -> None:
        """Stop every worker (asked, then terminated, then killed) and remove the scratch folder."""
        try:
            for worker in self.pool:
                try:
                    _send(worker.conn, None)
                except (BrokenPipeError, OSError):
                    pass
            for worker in self.pool:
                _stop(worker.process, asked=True)
                worker.conn.close()
        finally:
            self.scratch.cleanup()


def _stop(process: multiprocessing.process.BaseProcess, asked: bool) -> None:
    """Wait for a process asked to exit, else terminate it (it cleans up), else kill it."""
    if asked:
        process.join(STOP_SECONDS)
    if process.is_alive():
        process.terminate()
        process.join(STOP_SECONDS)
    if process.is_alive():
        process.kill()
        process.join(STOP_SECONDS)
