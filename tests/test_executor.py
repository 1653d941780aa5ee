"""The execution layer: local and Ray backends give the same report numbers, failures and
time-outs become the attack's failure, and Ray stays out of everything that does not ask for it.

The Ray tests share one local Ray instance limited to 2 CPUs (the CI machine), started once."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from conftest import sample

from splitaudit.attacks import get_attack
from splitaudit.cli import main
from splitaudit.core.config import AuditOptions
from splitaudit.engine.pipeline import run_audit
from splitaudit.execution.executor import LocalExecutor, open_executor, run_attack_grid
from splitaudit.execution.tasks import SeedTask

QUICK_RUN = dict(
    model=sample("breast_cancer_mlp.onnx"),
    aux=sample("breast_cancer.npz"),
    quick=True,
    prior="gaussian",
    noise_sigma=0.3,
    attacks=["kmeans", "decoder", "optimization"],
    formats=["json"],
)


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "splitaudit[ray]")')
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def full_seed_ctx(cancer_ctx):
    """Three seeds per attack (not --quick), so seed tasks are aggregated as Attack.run does."""
    return replace(cancer_ctx, quick=False)


class NullBar:
    def set_postfix_str(self, _text):
        pass

    def update(self, _n=1):
        pass


def attack_numbers(entry: dict) -> tuple:
    return (
        entry["status"],
        entry.get("metrics"),
        entry.get("metrics_std"),
        entry.get("baseline"),
        entry.get("advantage"),
    )


def test_local_grid_equals_attack_run_at_every_sigma(full_seed_ctx):
    """The executor's seed tasks aggregate to exactly what Attack.run gives (every seed in one process), at each sigma."""
    names = ["kmeans", "attribute"]
    grid, results = run_attack_grid(full_seed_ctx, names, [0.0, 0.5], LocalExecutor())
    assert all(r.error is None for r in results)
    assert len(results) == sum(len(grid[sigma][name]["seeds"]) for sigma in (0.0, 0.5) for name in names)
    for sigma in (0.0, 0.5):
        for name in names:
            direct = get_attack(name).run(replace(full_seed_ctx, noise_sigma=sigma))
            assert attack_numbers(grid[sigma][name]) == attack_numbers(direct)
            assert grid[sigma][name]["seeds"] == direct["seeds"] in ([0, 1], [0, 1, 2])  # added by spread
    assert grid[0.0]["kmeans"]["metrics"] != grid[0.5]["kmeans"]["metrics"]  # the sigma reached the tasks


def test_ray_grid_is_bit_identical_to_local_twice(ray_instance, full_seed_ctx):
    """Same tasks on Ray (2 workers) and locally: the same numbers, exactly; twice, the second
    time on workers that cached the context."""
    names = ["kmeans", "attribute"]
    local, _ = run_attack_grid(full_seed_ctx, names, [0.0, 0.5], LocalExecutor())
    options = AuditOptions(
        model=sample("breast_cancer_mlp.onnx"), aux=sample("breast_cancer.npz"), executor="ray"
    ).validate()
    executor = open_executor("ray", options, full_seed_ctx)
    assert executor.workers == 2 and not executor.started_here
    for _ in range(2):
        remote, results = run_attack_grid(full_seed_ctx, names, [0.0, 0.5], executor)
        assert all(r.error is None and r.attempts == 1 and r.worker for r in results)
        for sigma in (0.0, 0.5):
            for name in names:
                assert attack_numbers(remote[sigma][name]) == attack_numbers(local[sigma][name])
    executor.close()
    assert ray_instance.is_initialized()  # an instance the tool did not start is left running


def test_ray_run_report_equals_local(ray_instance, tmp_path):
    """A quick audit end to end: attacks, examples and bounds agree exactly; the run section says
    which executor ran how many tasks on how many workers."""
    local = run_audit(AuditOptions(**QUICK_RUN, out=str(tmp_path / "l")).validate())
    remote = run_audit(AuditOptions(**QUICK_RUN, out=str(tmp_path / "r"), executor="ray").validate())
    for name in QUICK_RUN["attacks"]:
        assert attack_numbers(remote["attacks"][name]) == attack_numbers(local["attacks"][name])
        assert remote["attacks"][name]["examples"] == local["attacks"][name]["examples"]
    assert remote["bounds"]["van_trees_mse"] == local["bounds"]["van_trees_mse"]
    assert (local["run"]["executor"], local["run"]["workers"]) == ("local", 1)
    assert (remote["run"]["executor"], remote["run"]["workers"]) == ("ray", 2)
    assert remote["run"]["dfil_shards"]["tasks"] >= 1 and remote["dfil"]["mean"] == pytest.approx(local["dfil"]["mean"])
    tasks = remote["run"]["tasks"]
    assert [t["attack"] for t in tasks] == QUICK_RUN["attacks"]
    assert all(t["status"] == "ok" and t["seconds"] > 0 and t["noise_sigma"] == 0.3 for t in tasks)


def test_workers_rebuild_an_onnx_model_with_external_data_from_the_object_store(ray_instance, tmp_path):
    """A dynamo ONNX export (weights in a .data file) is shipped with its data file: the files are
    deleted once the executor has put them in the object store, and Ray still gives local's numbers."""
    import numpy as np
    import torch

    from splitaudit.engine.pipeline import prepare_context
    from splitaudit.execution.recipe import model_files
    from tests.support.architectures import build, export_onnx

    model = export_onnx(build("mobilenet"), torch.rand(2, 3, 32, 32), tmp_path / "stem.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.random((64, 3, 32, 32), dtype=np.float32), y=rng.integers(0, 2, 64))
    options = AuditOptions(model=str(model), aux=str(tmp_path / "data.npz"), quick=True).validate()
    ctx = prepare_context(options)
    shipped = model_files(str(model))
    assert set(shipped) == {"stem.onnx", "stem.onnx.data"} and len(shipped["stem.onnx.data"]) > 1000
    local, _ = run_attack_grid(ctx, ["kmeans"], [0.1], LocalExecutor())
    executor = open_executor("ray", options, ctx)
    for path in tmp_path.glob("stem.onnx*"):
        path.unlink()
    remote, results = run_attack_grid(ctx, ["kmeans"], [0.1], executor)
    assert results[0].error is None
    assert attack_numbers(remote[0.1]["kmeans"]) == attack_numbers(local[0.1]["kmeans"])


def test_failing_task_is_retried_once_then_reported(ray_instance, cancer_ctx):
    """A task that raises on its worker is run twice, then comes back as a failure (no exception)."""
    options = AuditOptions(model=sample("breast_cancer_mlp.onnx"), aux=sample("breast_cancer.npz"))
    executor = open_executor("ray", options, cancer_ctx)
    ok, broken = SeedTask("kmeans", 0, 0.0), SeedTask("no-such-attack", 0, 0.0)
    results = executor.map(cancer_ctx, [ok, broken], NullBar())
    assert results[0].error is None and results[0].attempts == 1
    assert results[1].outcome is None and results[1].attempts == 2 and "KeyError" in results[1].error


def test_task_timeout_fails_the_attack_not_the_audit(ray_instance, cancer_ctx):
    """A task over --task-timeout is cancelled, retried once, then reported as failed: the map
    returns instead of hanging, and the attack's entry says why."""
    options = AuditOptions(
        model=sample("breast_cancer_mlp.onnx"), aux=sample("breast_cancer.npz"), executor="ray", task_timeout=0.05
    )
    executor = open_executor("ray", options, cancer_ctx)
    grid, results = run_attack_grid(cancer_ctx, ["decoder"], [0.0], executor)
    assert len(results) == 1 and results[0].attempts == 2 and "timed out after 0.05 s" in results[0].error
    entry = grid[0.0]["decoder"]
    assert entry["status"] == "failed" and "--task-timeout" in entry["reason"]


def test_without_ray_local_works_and_ray_says_how_to_install(monkeypatch, tmp_path, capsys):
    """With Ray hidden: the help and a local audit work (nothing imports Ray), and --executor ray
    stops before any work with exit 2 and the install command."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.delitem(sys.modules, "splitaudit.execution.ray_executor", raising=False)
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0
    result = run_audit(AuditOptions(**{**QUICK_RUN, "attacks": ["kmeans"]}, out=str(tmp_path)).validate())
    assert result["attacks"]["kmeans"]["status"] == "ok" and result["run"]["executor"] == "local"
    capsys.readouterr()
    args = [
        "run",
        QUICK_RUN["model"],
        "--aux",
        QUICK_RUN["aux"],
        "--quick",
        "--executor",
        "ray",
        "--out",
        str(tmp_path),
    ]
    with pytest.raises(SystemExit) as ray_exit:
        main(args)
    assert ray_exit.value.code == 2
    err = capsys.readouterr().err
    assert 'pip install "splitaudit[ray]"' in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flags",
    [
        ["--executor", "dask"],
        ["--task-timeout", "0"],
        ["--workers", "0"],
        ["--workers", "many"],
        ["--executor", "ray", "--workers", "2"],
    ],
)
def test_bad_executor_flags_exit_2(flags, capsys):
    flag = flags[-2]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", QUICK_RUN["model"], "--aux", QUICK_RUN["aux"], *flags])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_ray_sweep_points_equal_local(ray_instance, tmp_path):
    """A sweep submits every point's seed tasks at once; on Ray each point's attacks are exactly
    local's, and the run section lists a task per sigma x attack x seed."""
    from splitaudit.engine.sweep import run_sweep

    sweep_options = {**QUICK_RUN, "noise_sigmas": [0.0, 0.5], "attacks": ["kmeans", "decoder"]}
    local = run_sweep(AuditOptions(**sweep_options, out=str(tmp_path / "l")).validate())
    remote = run_sweep(AuditOptions(**sweep_options, out=str(tmp_path / "r"), executor="ray").validate())
    for before, after in zip(local["points"], remote["points"]):
        assert before["noise_sigma"] == after["noise_sigma"]
        for name in sweep_options["attacks"]:
            assert attack_numbers(after["attacks"][name]) == attack_numbers(before["attacks"][name])
    assert remote["recommendation"] == local["recommendation"]
    assert (local["run"]["executor"], remote["run"]["executor"], remote["run"]["workers"]) == ("local", "ray", 2)
    assert sorted((t["noise_sigma"], t["attack"]) for t in remote["run"]["tasks"]) == [
        (0.0, "decoder"),
        (0.0, "kmeans"),
        (0.5, "decoder"),
        (0.5, "kmeans"),
    ]


def test_worker_processes_give_the_in_process_numbers(tmp_path):
    """--workers 2: tasks run in two spawned processes that rebuilt the context from the recipe,
    and the report's numbers and examples are exactly the in-process loop's."""
    on_cpu = {**QUICK_RUN, "device": "cpu"}  # bit-identical where the computation is deterministic: on CPU
    local = run_audit(AuditOptions(**on_cpu, out=str(tmp_path / "l")).validate())
    pooled = run_audit(AuditOptions(**on_cpu, out=str(tmp_path / "p"), workers=2).validate())
    for name in QUICK_RUN["attacks"]:
        assert attack_numbers(pooled["attacks"][name]) == attack_numbers(local["attacks"][name])
        assert pooled["attacks"][name]["examples"] == local["attacks"][name]["examples"]
    assert (local["run"]["workers"], pooled["run"]["executor"], pooled["run"]["workers"]) == (1, "local", 2)
    workers = {t["worker"] for t in pooled["run"]["tasks"]}
    assert len(workers) == 2 and all(w.startswith("local/") for w in workers)
    # the dFIL traces ran as shards on the workers, to the same numbers (float rounding apart)
    assert "dfil_shards" not in local["run"] and pooled["run"]["dfil_shards"]["tasks"] >= 1
    assert pooled["dfil"]["mean"] == pytest.approx(local["dfil"]["mean"], rel=1e-6)
    assert pooled["bounds"]["van_trees_mse"] == pytest.approx(local["bounds"]["van_trees_mse"], rel=1e-6)


def test_randomised_dfil_shards_on_workers_give_the_in_process_estimate(tmp_path):
    """A ResNet-style stem whose trace is estimated with Hutchinson probes: its probe shards run on
    two worker processes (each with its own copy of the model) and give the estimate of one
    process, and the report says how many shard tasks ran."""
    import numpy as np
    import torch

    from tests.support.architectures import build

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.random((192, 3, 16, 16), dtype=np.float32), y=rng.integers(0, 3, 192))
    common = dict(
        aux=str(tmp_path / "data.npz"), attacks=["none"], prior="gaussian", quick=True, dfil_rtol=0.2, device="cpu"
    )
    torch.manual_seed(0)
    model = build("resnet", width=16, blocks=1)
    alone = run_audit(AuditOptions(model=model, **common, out=str(tmp_path / "a")).validate())
    pooled = run_audit(AuditOptions(model=model, **common, workers=2, out=str(tmp_path / "p")).validate())
    assert alone["dfil"]["method"].startswith("hutchinson")
    assert pooled["dfil"]["mean"] == pytest.approx(alone["dfil"]["mean"], rel=1e-5)
    assert pooled["dfil"]["stderr"] == pytest.approx(alone["dfil"]["stderr"], rel=1e-5)
    assert pooled["run"]["dfil_shards"]["tasks"] > 2 and pooled["run"]["dfil_shards"]["retried"] == 0


def test_worker_time_out_retry_and_death_are_reported_and_the_pool_goes_on(cancer_ctx):
    """A --task-timeout runs tasks in a worker process even with one worker, so a task can be
    stopped: it is stopped, retried once on a fresh worker, then reported as failed. A worker
    killed mid-task is reported as dead and replaced; the same pool then runs the next tasks."""
    import os
    import signal

    from splitaudit.execution.process_pool import ProcessPool

    options = AuditOptions(
        model=sample("breast_cancer_mlp.onnx"), aux=sample("breast_cancer.npz"), task_timeout=0.05
    ).validate()
    pool = open_executor("local", options, cancer_ctx)
    assert isinstance(pool, ProcessPool) and pool.workers == 1
    try:
        grid, results = run_attack_grid(cancer_ctx, ["decoder"], [0.0], pool)
        assert results[0].attempts == 2 and "timed out after 0.05 s" in results[0].error
        assert grid[0.0]["decoder"]["status"] == "failed"
        pool.task_timeout = None
        token = pool.start(SeedTask("decoder", 0, 0.0))
        os.kill(pool.pool[0].process.pid, signal.SIGKILL)
        [(finished, done)] = pool.wait([token], 60)
        assert finished == token and done.outcome is None and "worker process died" in done.error
        for _ in range(2):  # the replacement worker, twice
            ok, broken = pool.map(
                cancer_ctx, [SeedTask("kmeans", 0, 0.0), SeedTask("no-such-attack", 0, 0.0)], NullBar()
            )
            assert ok.error is None and ok.worker.startswith("local/")
            assert broken.attempts == 2 and "KeyError" in broken.error
    finally:
        pool.close()
    assert not any(worker.process.is_alive() for worker in pool.pool)


def test_an_unreachable_ray_cluster_is_bad_input_in_one_line(monkeypatch, capsys):
    """--ray-address to a cluster that refuses (here: ray.init raising as it does for a wrong
    address or a missing token) ends with exit 2 and one line that says what to check."""
    ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "splitaudit[ray]")')

    def refuse(*_args, **_kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    args = ["run", QUICK_RUN["model"], "--aux", QUICK_RUN["aux"], "--quick", "--attacks", "kmeans"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--prior", "gaussian", "--executor", "ray", "--ray-address", "127.0.0.1:1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot connect" in err and "RAY_AUTH_MODE=token" in err


def test_auto_workers_take_the_cores_that_half_the_memory_holds(cancer_ctx, monkeypatch):
    """--workers auto: one per core, but no more than half the machine's memory holds (each worker
    keeps its own model and data); one for --quick; a count given is taken as it is."""
    import os

    import torch

    from splitaudit.execution import executor

    on = lambda device: replace(cancer_ctx.encoder, device=torch.device(device))
    full = replace(cancer_ctx, quick=False, encoder=on("cpu"))
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(executor, "machine_memory_bytes", lambda: 10**15)
    assert executor.local_workers(None, full) == cores
    monkeypatch.setattr(executor, "machine_memory_bytes", lambda: 3 * executor.worker_bytes(full))
    assert executor.local_workers(None, full) == 1
    assert executor.local_workers(None, replace(full, quick=True)) == 1
    assert executor.local_workers(None, replace(full, encoder=on("cuda"))) == 1  # one GPU: one worker
    large = replace(full, aux=replace(full.aux, x=full.aux.x.new_zeros(executor.SMALL_WORK)))
    assert executor.local_workers(None, large) == 1  # its tasks already use every core
    assert executor.local_workers(3, full) == 3
    assert executor.worker_bytes(full) > executor.WORKER_BASE_BYTES


class SimulatedSlots:
    """Two workers on a simulated clock: a task takes `durations[attack]` time units; records when
    each task started."""

    workers = 2

    def __init__(self, durations: dict[str, float]):
        self.durations, self.now, self.running, self.started = durations, 0.0, {}, []

    def start(self, task):
        handle = len(self.started)
        self.started.append((self.now, task))
        self.running[handle] = (self.now + self.durations[task.attack], task)
        return handle

    def wait(self, handles, timeout):
        from splitaudit.execution.tasks import Finished

        self.now = min(self.running[h][0] for h in handles)
        done = [h for h in handles if self.running[h][0] == self.now]
        return [(h, Finished(self.running.pop(h)[1].seed, None, 1.0, "sim")) for h in done]


def test_a_further_seed_starts_when_its_attack_finishes_not_after_the_round():
    """The scheduler queues a follow-up task as soon as the result that calls for it settles, by
    weight: SDAR's third seed starts beside the short tasks (makespan 20) instead of after all of
    them (22, as rounds did), and every task's result comes back in the order of creation."""
    from splitaudit.execution.tasks import schedule

    first = [SeedTask("sdar", 0, 0.0), SeedTask("sdar", 1, 0.0)] + [SeedTask("kmeans", s, 0.0) for s in range(4)]
    slots = SimulatedSlots({"sdar": 10.0, "kmeans": 1.0})

    def follow_up(result):
        return [SeedTask("sdar", 2, 0.0)] if result.task == SeedTask("sdar", 1, 0.0) else []

    results = schedule(slots, first, NullBar(), None, follow_up)
    starts = {(task.attack, task.seed): when for when, task in slots.started}
    assert starts[("sdar", 2)] == 10.0 and slots.now == 20.0
    assert [r.task for r in results] == first + [SeedTask("sdar", 2, 0.0)]
    assert [r.outcome for r in results] == [0, 1, 0, 1, 2, 3, 2]
