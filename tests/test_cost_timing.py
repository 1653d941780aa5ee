"""The cost estimate's step timer and its busy-machine note, on fake clocks: which seconds a timed
step counts (CPU seconds over its threads on a CPU, wall seconds on a GPU, the median of the calls
after the first), how long it repeats, and when the machine counts as busy. No test here reads a
real clock's value: every time is injected, so the assertions are exact."""

from __future__ import annotations

import pytest
from test_scale import _cost_context

from splitaudit.stages import cost
from splitaudit.stages.cost import BUSY_SHARE, MAX_CALLS, MIN_CALLS, TIMING_SECONDS, Clocks, CostEstimate, StepTimer


class FakeMachine:
    """Clocks that move only when a step runs: each call of `step` takes the next (wall, CPU of all
    threads) pair of `calls` (the last repeated), on `threads` torch threads, at `load` on `cores`."""

    def __init__(self, calls: list[tuple[float, float]], threads: int = 1, load: float = 0.5, cores: int = 2):
        self.calls, self.threads, self.load, self.cores = calls, threads, load, cores
        self.wall = self.cpu = 0.0
        self.made = 0

    def clocks(self) -> Clocks:
        return Clocks(
            wall=lambda: self.wall,
            cpu=lambda: self.cpu,
            threads=lambda: self.threads,
            load=lambda: self.load,
            cores=lambda: self.cores,
        )

    def step(self) -> None:
        wall, cpu = self.calls[min(self.made, len(self.calls) - 1)]
        self.wall, self.cpu, self.made = self.wall + wall, self.cpu + cpu, self.made + 1


def test_a_cpu_step_counts_the_median_cpu_seconds_over_its_threads_after_the_first_call():
    """Two threads; the first call (5 s of warm-up) is not counted; the counted calls used 0.2, 0.6
    and 0.2 CPU seconds of both threads (0.1, 0.3, 0.1 over the threads: median 0.1) in 0.4, 0.3 and
    0.5 s of wall time, so the process got (0.1 + 0.3 + 0.1) / 1.2 of its threads' time. The window
    (TIMING_SECONDS) is spent after the warm-up, so the timer stops at MIN_CALLS counted calls."""
    machine = FakeMachine([(5.0, 10.0), (0.4, 0.2), (0.3, 0.6), (0.5, 0.2)], threads=2)
    timer = StepTimer(cpu_bound=True, clocks=machine.clocks())
    assert MIN_CALLS == 3 and TIMING_SECONDS < 5.0
    assert timer(machine.step) == pytest.approx(0.1)
    assert machine.made == MIN_CALLS + 1
    assert timer.share == pytest.approx(0.5 / 1.2)


def test_a_gpu_step_counts_the_median_wall_seconds_and_its_share_stays_whole():
    """On a GPU the device's time shows in wall seconds only: median of 0.4, 0.3, 0.5 is 0.4, and the
    CPU share says nothing about the GPU's load (1)."""
    machine = FakeMachine([(5.0, 10.0), (0.4, 0.2), (0.3, 0.6), (0.5, 0.2)], threads=2)
    timer = StepTimer(cpu_bound=False, clocks=machine.clocks())
    assert timer(machine.step) == pytest.approx(0.4) and timer.share == 1.0


def test_short_steps_repeat_for_the_window_up_to_the_call_cap():
    """Steps of 0.01 s repeat while the window lasts; at most MAX_CALLS are counted (150 would fit
    in TIMING_SECONDS). Steps of 0.25 s repeat until the window is spent: 6 calls."""
    fast = FakeMachine([(0.01, 0.01)])
    StepTimer(cpu_bound=True, clocks=fast.clocks())(fast.step)
    assert TIMING_SECONDS / 0.01 > MAX_CALLS and fast.made == MAX_CALLS + 1
    slow = FakeMachine([(0.25, 0.25)])
    StepTimer(cpu_bound=True, clocks=slow.clocks())(slow.step)
    assert TIMING_SECONDS / 0.25 == 6 and slow.made == 6


def test_the_timer_accumulates_its_share_over_every_step_it_timed():
    """One timer over two steps: the share is the counted calls' CPU over their wall, all steps
    together (five counted calls of 0.1 s on idle cores, then three of 0.1 s of CPU in 0.4 s:
    0.8 / 1.7)."""
    idle, busy = FakeMachine([(1.0, 1.0), (0.1, 0.1)]), FakeMachine([(1.0, 1.0), (0.4, 0.1)])
    timer = StepTimer(cpu_bound=True, clocks=idle.clocks())
    timer(idle.step)
    timer.clocks = busy.clocks()
    timer(busy.step)
    assert timer.share == pytest.approx(0.8 / 1.7)


@pytest.mark.parametrize(
    "share, load, cores, busy",
    [(1.0, 1.9, 2, False), (BUSY_SHARE, 2.0, 2, False), (0.9, 2.1, 2, True), (BUSY_SHARE - 0.01, 0.3, 2, True)],
)
def test_the_machine_is_busy_when_the_load_passes_its_cores_or_the_steps_got_under_half_their_time(
    share, load, cores, busy
):
    note = cost.busy_machine(share, load, cores)
    assert bool(note) == busy
    assert not busy or f"load average {load:.1f} on {cores} cores" in note and f"{share:.0%}" in note


def test_a_busy_estimate_says_so_and_what_the_load_makes_of_it():
    """The stages are CPU seconds; at a share of 0.25 the 10 minutes of work take 40 minutes of wall
    time, which the summary adds after the estimate. An idle estimate has no such note."""
    busy = CostEstimate(stages={"sdar": 600.0}, busy="load average 8.0 on 2 cores", share=0.25)
    assert busy.at_load == 2400.0
    assert busy.summary().startswith("this audit may take about 10 min (sdar 10 min)")
    assert busy.summary().endswith("; timed on a busy machine (load average 8.0 on 2 cores): at this load about 40 min")
    assert "busy" not in CostEstimate(stages={"sdar": 600.0}).summary()


def ticking_clocks(wall_per_read: float, cpu_per_read: float, load: float) -> Clocks:
    """Clocks that advance by a fixed amount at every reading, whatever runs in between: a real step
    timed with them takes wall_per_read of wall time and cpu_per_read of CPU time on one thread."""
    readings = {"wall": 0.0, "cpu": 0.0}

    def reading(name: str, tick: float) -> float:
        readings[name] += tick
        return readings[name] - tick

    return Clocks(
        wall=lambda: reading("wall", wall_per_read),
        cpu=lambda: reading("cpu", cpu_per_read),
        threads=lambda: 1,
        load=lambda: load,
        cores=lambda: 2,
    )


def test_the_estimate_on_a_busy_machine_keeps_its_cpu_seconds_and_notes_the_load():
    """A whole estimate (a ResNet stem's encoder pass, the Gaussian prior, one real SDAR iteration)
    on a machine where every timed call takes 0.4 s of wall time and 0.1 s of CPU at load 7 on 2
    cores: the stages count the 0.1 s (SDAR: its iterations over MIN_SEEDS seeds, its whole cap: without
    a top model it trains to it), the note gives the load and the 25% the steps got, and at this load
    4x the total."""
    from splitaudit.attacks.base import MIN_SEEDS
    from splitaudit.attacks.sdar import sdar_settings

    ctx = _cost_context(16)
    timer = StepTimer(cpu_bound=True, clocks=ticking_clocks(0.4, 0.1, load=7.0))
    estimate = cost.estimate_cost(ctx, "gaussian", 0.25, ["sdar"], timer=timer)
    assert sdar_settings(ctx).stopping is None
    assert estimate.stages["sdar"] == pytest.approx(MIN_SEEDS * sdar_settings(ctx).iterations * 0.1)
    assert estimate.share == pytest.approx(0.25)
    assert estimate.busy == "load average 7.0 on 2 cores, the timed steps got 25% of their threads' time"
    assert estimate.summary().endswith(f"at this load about {cost.duration(4 * estimate.total)}")


def test_the_dfil_estimate_follows_the_run_s_own_choice_and_prices_a_pilot_s_products_at_its_time():
    """On the 32 px ResNet stem (16 samples, --quick) auto takes random probes: the estimate runs the
    run's own pilot (64 products), plans the products the pilot predicts (within 2x of those the run
    takes) and prices each at what the pilot's took (6.4 CPU s over 64 here: 0.1), not at a forward +
    backward pass, which a forward-mode product outcosts (1.6x on a ResNet-18 at 224 px). At 16 px
    auto is exact: no pilot, each product at the pass's seconds."""
    from splitaudit.estimators.mean_trace import estimate_mean_trace, planned_products
    from splitaudit.stages.leakage import dfil_mean_options

    ctx = _cost_context(32, quick=True)
    planned = planned_products(ctx.encoder, ctx.target.x, "auto", dfil_mean_options(ctx, 0.02))
    taken = estimate_mean_trace(ctx.encoder, ctx.target.x, "auto", dfil_mean_options(ctx, 0.02)).total_products
    assert planned.pilot_products == 64 and 0.5 <= planned.products / taken <= 2.0
    reads = iter([0.0, 6.4])
    clocks = Clocks(cpu=lambda: next(reads), threads=lambda: 1)
    seconds = cost.dfil_seconds(ctx, len(ctx.target), 0.02, pass_seconds=99.0, clocks=clocks)
    assert seconds == pytest.approx(planned.products * 0.1)
    exact = _cost_context(16, quick=True)
    planned = planned_products(exact.encoder, exact.target.x, "auto", dfil_mean_options(exact, 0.02))
    assert planned.pilot_products == 0
    assert cost.dfil_seconds(exact, len(exact.target), 0.02, 0.5, Clocks()) == pytest.approx(planned.products * 0.5)
