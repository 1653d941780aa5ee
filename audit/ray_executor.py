"""The Ray backend of the executor (`--executor ray`): seed tasks on a Ray cluster.

The model file(s) and the already split data go into Ray's object store once (`ray.put`);
a worker rebuilds the audit context from them the first time it sees them and keeps it for
the next tasks (torch modules and onnxruntime sessions do not pickle, files and tensors do).
At most as many tasks are in flight as the cluster has slots, so a task's time-out counts from
when it starts; a task that raises, times out or loses its worker is retried once, then
reported as that attack's failure. Imported only when `--executor ray` is asked for.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from tqdm import tqdm

from splitaudit.config import AuditOptions
from splitaudit.context import AuditContext
from splitaudit.data import Dataset
from splitaudit.executor import SeedTask, TaskResult, timed_task

MAX_ATTEMPTS = 2  # a failed task is retried once
POLL_SECONDS = 1.0


@dataclass
class ContextRecipe:
    """What a worker needs to rebuild the audit context: the options, the model files' bytes
    (with an ONNX model's external data) and the data already split into aux and target."""

    options: AuditOptions
    model_files: dict[str, bytes]
    top_model_files: dict[str, bytes]
    aux: Dataset
    target: Dataset


def model_files(path) -> dict[str, bytes]:
    """A model file's bytes by name, and for ONNX the external-data files it points to (nothing
    for no model, or for an in-memory torch module, which travels pickled in the options)."""
    if not isinstance(path, (str, Path)):
        return {}
    path = Path(path)
    files = {path.name: path.read_bytes()}
    if path.suffix.lower() == ".onnx":
        import onnx
        from onnx.external_data_helper import _get_all_tensors

        proto = onnx.load(str(path), load_external_data=False)
        for tensor in _get_all_tensors(proto):
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value not in files:
                    files[entry.value] = (path.parent / entry.value).read_bytes()
    return files


def make_recipe(options: AuditOptions, ctx: AuditContext) -> ContextRecipe:
    return ContextRecipe(
        options=replace(options, aux="", target=None),
        model_files=model_files(options.model),
        top_model_files=model_files(options.top_model),
        aux=ctx.aux.to("cpu"),
        target=ctx.target.to("cpu"),
    )


_CONTEXTS: dict[str, AuditContext] = {}  # per worker process: recipe key -> rebuilt context


def context_on_worker(recipe_box: list) -> AuditContext:
    """The context for a recipe, rebuilt on this worker the first time (recipe_box holds the
    recipe's ObjectRef, unresolved, so a cached worker never fetches it again)."""
    key, ref = recipe_box
    if key not in _CONTEXTS:
        from splitaudit.models import open_model, resolve_device
        from splitaudit.pipeline import build_context

        recipe: ContextRecipe = ray.get(ref)
        folder = Path(tempfile.mkdtemp(prefix="splitaudit-worker-"))
        for files in (recipe.model_files, recipe.top_model_files):
            for name, data in files.items():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_bytes(data)
        options = replace(
            recipe.options,
            model=_local_copy(recipe.options.model, folder),
            top_model=_local_copy(recipe.options.top_model, folder),
            device=recipe.options.device if ray.get_gpu_ids() else "cpu",
        )
        device = resolve_device(options.device)
        raw = open_model(options.model, device, options.output_name)
        _CONTEXTS[key] = build_context(options, raw, recipe.aux, recipe.target, device)
    return _CONTEXTS[key]


def _local_copy(model, folder: Path):
    """Where the worker wrote a model file (a torch module or None is used as it is)."""
    return str(folder / Path(model).name) if isinstance(model, (str, Path)) else model


@ray.remote(max_retries=0)
def _run_on_worker(recipe_box: list, task: SeedTask):
    outcome, error, seconds = timed_task(context_on_worker(recipe_box), task)
    return outcome, error, seconds, f"{ray.get_runtime_context().get_node_id()[:8]}/{os.getpid()}"


class RayExecutor:
    """Seed tasks on Ray: a local instance started (and shut down) here, or the cluster at `address`."""

    name = "ray"

    def __init__(
        self, options: AuditOptions, ctx: AuditContext, address: str | None = None, task_timeout: float | None = None
    ) -> None:
        self.started_here = not ray.is_initialized() and not address
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.task_timeout = task_timeout
        resources = ray.cluster_resources()
        self.use_gpu = ctx.device.type == "cuda" and resources.get("GPU", 0) > 0
        slot = "GPU" if self.use_gpu else "CPU"
        self.workers = max(1, int(resources.get(slot, 1)))
        self.remote = (
            _run_on_worker.options(num_gpus=1, num_cpus=0) if self.use_gpu else _run_on_worker.options(num_cpus=1)
        )
        self.recipe_box = [uuid.uuid4().hex, ray.put(make_recipe(options, ctx))]

    def map(self, ctx: AuditContext, tasks: list[SeedTask], bar: tqdm) -> list[TaskResult]:
        results: dict[int, TaskResult] = {}
        queue = [(i, 1) for i in range(len(tasks))]  # (task index, attempt)
        running: dict = {}  # ref -> (index, attempt, start)
        while queue or running:
            while queue and len(running) < self.workers:
                index, attempt = queue.pop(0)
                running[self.remote.remote(self.recipe_box, tasks[index])] = (index, attempt, time.monotonic())
            bar.set_postfix_str(f"running {len(running)}")
            done, _ = ray.wait(list(running), num_returns=1, timeout=self._wait_seconds(running))
            for ref in done:
                index, attempt, start = running.pop(ref)
                result = self._collect(ref, tasks[index], attempt, start)
                if result.error is not None and attempt < MAX_ATTEMPTS:
                    queue.insert(0, (index, attempt + 1))
                else:
                    results[index] = result
                    bar.update()
            for ref, (index, attempt, start) in list(running.items()):
                if self.task_timeout is not None and time.monotonic() - start > self.task_timeout:
                    ray.cancel(ref, force=True)
                    running.pop(ref)
                    if attempt < MAX_ATTEMPTS:
                        queue.insert(0, (index, attempt + 1))
                    else:
                        results[index] = TaskResult(
                            tasks[index],
                            None,
                            f"timed out after {self.task_timeout:g} s (--task-timeout), {attempt} attempts",
                            time.monotonic() - start,
                            attempt,
                            "",
                        )
                        bar.update()
        return [results[i] for i in range(len(tasks))]

    def _wait_seconds(self, running: dict) -> float:
        """Until the next poll, or sooner when a running task reaches its time-out."""
        if self.task_timeout is None:
            return POLL_SECONDS
        first_deadline = min(start for _, _, start in running.values()) + self.task_timeout
        return min(POLL_SECONDS, max(0.0, first_deadline - time.monotonic()))

    def _collect(self, ref, task: SeedTask, attempt: int, start: float) -> TaskResult:
        """The task's result, or its failure when the worker raised or was lost."""
        try:
            outcome, error, seconds, node = ray.get(ref)
        except Exception as exc:  # RayTaskError, WorkerCrashedError, ObjectLostError...
            return TaskResult(
                task,
                None,
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                time.monotonic() - start,
                attempt,
                "",
            )
        return TaskResult(task, outcome, error, seconds, attempt, node)

    def close(self) -> None:
        if self.started_here:
            ray.shutdown()
