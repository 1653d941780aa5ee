"""The Ray backend of the executor (`--executor ray`): seed tasks on a Ray cluster.

The context's recipe (splitaudit.execution.recipe: model files and the already split data) goes into
Ray's object store once (`ray.put`); a worker rebuilds the audit context from it the first time
it sees it and keeps it for the next tasks.
At most as many tasks are in flight as the cluster has slots, so a task's time-out counts from
when it starts; a task that raises, times out or loses its worker is retried once, then
reported as that attack's failure. Imported only when `--executor ray` is asked for.
"""

from __future__ import annotations

import os
import uuid

import ray
import torch
from tqdm import tqdm

from splitaudit.core.errors import InputError
from splitaudit.execution.recipe import Recipe
from splitaudit.execution.tasks import Finished, FollowUp, Task, TaskResult, no_follow_up, schedule, timed_task

_CONTEXTS: dict[str, object] = {}  # per worker process: recipe key -> what the recipe rebuilt


def context_on_worker(recipe_box: list):
    """The context (or the recipe's other state) for a recipe, rebuilt on this worker the first
    time (recipe_box holds the recipe's ObjectRef, unresolved, so a cached worker never fetches it again)."""
    key, ref = recipe_box
    if key not in _CONTEXTS:
        recipe: Recipe = ray.get(ref)
        device = recipe.device if ray.get_gpu_ids() else "cpu"
        _CONTEXTS[key] = recipe.rebuild(device)
    return _CONTEXTS[key]


@ray.remote(max_retries=0)
def _run_on_worker(recipe_box: list, task: Task):
    outcome, error, seconds = timed_task(context_on_worker(recipe_box), task)
    return outcome, error, seconds, f"{ray.get_runtime_context().get_node_id()[:8]}/{os.getpid()}"


def cannot_connect(address: str, exc: Exception) -> str:
    """One line for a cluster that refused or did not answer (bad input, exit 2)."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (
        f"--ray-address {address}: cannot connect to the Ray cluster ({reason}). Is it running (ray status)? "
        "A cluster with token authentication (Ray >= 2.59 turns it on for `ray start`) also needs "
        "RAY_AUTH_MODE=token here, with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN"
    )


class RayExecutor:
    """Seed tasks on Ray: a local instance started (and shut down) here, or the cluster at `address`."""

    name = "ray"

    def __init__(
        self, recipe: Recipe, device: torch.device, address: str | None = None, task_timeout: float | None = None
    ) -> None:
        self.started_here = not ray.is_initialized() and not address
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError) as exc:
                if not address:
                    raise
                raise InputError(cannot_connect(address, exc)) from exc
        self.task_timeout = task_timeout
        resources = ray.cluster_resources()
        self.use_gpu = device.type == "cuda" and resources.get("GPU", 0) > 0
        slot = "GPU" if self.use_gpu else "CPU"
        self.workers = max(1, int(resources.get(slot, 1)))
        self.remote = (
            _run_on_worker.options(num_gpus=1, num_cpus=0) if self.use_gpu else _run_on_worker.options(num_cpus=1)
        )
        self.recipe_box = [uuid.uuid4().hex, ray.put(recipe)]

    def map(self, ctx, tasks: list[Task], bar: tqdm, follow_up: FollowUp = no_follow_up) -> list[TaskResult]:
        return schedule(self, tasks, bar, self.task_timeout, follow_up)

    def start(self, task: Task):
        return self.remote.remote(self.recipe_box, task)

    def wait(self, handles: list, timeout: float) -> list[tuple[object, Finished]]:
        done, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        return [(ref, self._collect(ref)) for ref in done]

    def cancel(self, handle) -> None:
        ray.cancel(handle, force=True)

    def _collect(self, ref) -> Finished:
        """What the task returned, or its failure when the worker raised or was lost."""
        try:
            return Finished(*ray.get(ref))
        except Exception as exc:  # RayTaskError, WorkerCrashedError, ObjectLostError...
            return Finished(None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", None, "")

    def close(self) -> None:
        if self.started_here:
            ray.shutdown()
