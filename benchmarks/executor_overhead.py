"""What the executors cost on one machine, and what Ray would give on N machines.

Runs one grid of seed tasks (noise sigmas x attacks x seeds, as `run` and a sweep submit them)
on a sample model four ways, side by side in one process: the local executor in this process,
the local executor with --cpus worker processes (`--workers`), Ray with one worker slot (no
parallelism: the difference is pure overhead), and Ray with --cpus slots. It
checks that every backend gave the same numbers, then prints the wall times, the ratios, the
overhead per task, the one-off costs (starting Ray, putting the model and data in the object
store) and a projection to N machines of that many slots each.

    python -m benchmarks.executor_overhead [--model breast_cancer_mlp.onnx --data breast_cancer.npz]
        [--sigmas 0,0.3,1] [--attacks kmeans,attribute,decoder] [--cpus 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import ray

from splitaudit.core.config import AuditOptions
from splitaudit.engine.pipeline import prepare_context
from splitaudit.execution.executor import LocalExecutor, open_executor, run_attack_grid
from splitaudit.execution.ray_executor import context_on_worker

SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"
PROJECT_MACHINES = (1, 4, 16, 64)
ROUND_TRIPS = 50


@ray.remote(num_cpus=1)
def touch_context(recipe_box: list) -> float:
    """A task that does no work but find (or rebuild) the worker's context; returns that time."""
    clock = time.perf_counter()
    context_on_worker(recipe_box)
    return time.perf_counter() - clock


def round_trip_costs(executor) -> tuple[float, float]:
    """(seconds per no-op task on a worker with the context cached, seconds to rebuild it)."""
    ray.get(touch_context.remote(executor.recipe_box))
    clock = time.perf_counter()
    for _ in range(ROUND_TRIPS):
        ray.get(touch_context.remote(executor.recipe_box))
    per_task = (time.perf_counter() - clock) / ROUND_TRIPS
    rebuild = ray.get(touch_context.remote(["fresh-key", executor.recipe_box[1]]))
    return per_task, rebuild


def numbers(grid: dict) -> dict:
    return {
        (s, n): (e["status"], e.get("metrics"), e.get("baseline")) for s, row in grid.items() for n, e in row.items()
    }


def ray_grid(options: AuditOptions, ctx, names, sigmas, cpus: int) -> dict:
    """One Ray run on a fresh local instance of `cpus` slots, its one-off costs timed apart."""
    clock = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    started = time.perf_counter()
    executor = open_executor("ray", options, ctx)
    opened = time.perf_counter()
    grid, results = run_attack_grid(ctx, names, sigmas, executor)
    done = time.perf_counter()
    per_task, rebuild = round_trip_costs(executor)
    executor.close()
    ray.shutdown()
    return {
        "grid": grid,
        "results": results,
        "init": started - clock,
        "put": opened - started,
        "tasks_wall": done - opened,
        "workers": executor.workers,
        "per_task": per_task,
        "rebuild": rebuild,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="breast_cancer_mlp.onnx")
    parser.add_argument("--data", default="breast_cancer.npz")
    parser.add_argument("--sigmas", default="0,0.3,1")
    parser.add_argument("--attacks", default="kmeans,attribute,decoder")
    parser.add_argument("--cpus", type=int, default=2, help="Ray slots for the parallel run")
    parser.add_argument("--quick", action="store_true", help="one seed per attack instead of three")
    args = parser.parse_args()
    options = AuditOptions(
        model=str(SAMPLES / args.model), aux=str(SAMPLES / args.data), quick=args.quick, executor="ray"
    ).validate()
    ctx = prepare_context(options)
    names, sigmas = args.attacks.split(","), [float(s) for s in args.sigmas.split(",")]
    print(
        f"load average {os.getloadavg()[0]:.2f}; grid: {len(sigmas)} sigmas x {len(names)} attacks x "
        f"{len(ctx.seeds)} seeds on {args.model}"
    )

    clock = time.perf_counter()
    local, local_results = run_attack_grid(ctx, names, sigmas, LocalExecutor())
    local_wall = time.perf_counter() - clock
    clock = time.perf_counter()
    pool = open_executor("local", replace(options, executor="local", workers=args.cpus), ctx)
    pool_start = time.perf_counter() - clock
    pooled, _ = run_attack_grid(ctx, names, sigmas, pool)
    pool_wall = time.perf_counter() - clock - pool_start
    pool.close()
    one = ray_grid(options, ctx, names, sigmas, 1)
    many = ray_grid(options, ctx, names, sigmas, args.cpus)
    same = numbers(local) == numbers(pooled) == numbers(one["grid"]) == numbers(many["grid"])
    n = len(local_results)
    task_seconds = sum(r.seconds for r in local_results)

    print(f"same numbers on every backend: {same}")
    print(f"{'backend':<22}{'tasks wall s':>14}{'ratio to local':>16}")
    print(f"{'local':<22}{local_wall:>14.2f}{1.0:>16.2f}")
    workers_label = f"local, {pool.workers} workers"
    print(f"{workers_label:<22}{pool_wall:>14.2f}{pool_wall / local_wall:>16.2f}  (+ {pool_start:.2f} s start-up)")
    for label, r in (("ray, 1 slot", one), (f"ray, {many['workers']} slots", many)):
        print(f"{label:<22}{r['tasks_wall']:>14.2f}{r['tasks_wall'] / local_wall:>16.2f}")
    overhead = one["per_task"]
    print(
        f"tasks: {n}, mean task {task_seconds / n:.2f} s (local), longest {max(r.seconds for r in local_results):.2f} s"
    )
    print(
        f"Ray overhead per task (round trip of a no-op task, context cached, {ROUND_TRIPS} in a row): "
        f"{overhead * 1000:.1f} ms = {overhead / (task_seconds / n):.1%} of a mean task"
    )
    print(
        f"one-off: ray.init {one['init']:.2f} s, model + data into the object store {one['put']:.3f} s, "
        f"rebuilding the context on a new worker {one['rebuild']:.2f} s"
    )
    print(
        "projection on N machines of the same slots (tasks balanced; wall >= the longest task; "
        "plus one rebuild per worker; an existing cluster has no ray.init to pay):"
    )
    longest = max(r.seconds for r in local_results)
    for machines in PROJECT_MACHINES:
        slots = machines * many["workers"]
        wall = one["rebuild"] + max(longest, (task_seconds + overhead * n) / slots)
        print(
            f"  {machines:>3} machines ({slots:>3} slots): about {wall:8.2f} s  (local {local_wall:.2f} s, "
            f"x{local_wall / wall:.1f})"
        )


if __name__ == "__main__":
    main()
