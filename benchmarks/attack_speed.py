"""Seconds per SDAR training iteration: ways to speed it up, against the attack as it is, side by side in one process.

SDAR is the bulk of a full audit's estimate (3.4 h of 3.8 h on the 64 px ResNet stem, 2 CPU cores).
Each variant gets its own networks, built from the same seed by the attack's own
`sdar_training`, and the variants' iterations are timed interleaved in rounds (round-robin, so
that a burst of load from other processes hits every variant alike); the table gives the
median process CPU seconds per iteration over the rounds and baseline / variant (above 1: faster). A variant
that fails to build or to run (torch.compile without a compiler, say) is reported, not fatal.

Then each variant is trained alone for `--check` iterations from the same seed and its
decoder's output on a fixed batch is compared with the baseline's: "identical" only when bit-equal;
otherwise the largest absolute difference (floating-point reordering grows through training,
so a variant that is kept must show its final MSE within the seeds' spread, benchmarks/RESULTS.md).

    python -m benchmarks.attack_speed                                # digits CNN with g (batch 32)
    python -m benchmarks.attack_speed --architecture resnet --size 64 --width 64 --rounds 3 --per-round 2
    python -m benchmarks.attack_speed --threads 2                    # torch threads for the runs
    python -m benchmarks.attack_speed --profile 50 --shape textline  # where one iteration's time goes
    python -m benchmarks.attack_speed --variants baseline bfloat16 --check 0   # the bf16 forward passes

The baseline runs in float32 (sdar_training's default precision); the attack's own default,
precision=auto, is the "bfloat16" variant on CPUs with native bf16 for inputs of 1024+ values a sample.

`--profile N` prints, instead of the variants' table, where the baseline iteration's time goes
(`iteration_profile`): torch.profiler over N iterations, each network's forward and each
optimiser's step labelled, the backward passes (all networks together), the other top-level ops
(batch indexing, noise, losses) and the Python remainder outside any op; then each network's
forward and forward+backward timed alone on one batch, and the held-out measurement of early
stopping spread over the iterations between measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.sdar_stopping import context
from benchmarks.shapes_scale import SHAPES
from splitaudit.attacks.parts.sdar_training import ADAM_EPS, EVAL_EVERY, FULL, SDARNets, sdar_training
from splitaudit.attacks.sdar import PRESETS

Step = Callable[[], None]


def _optimisers(nets: SDARNets, step: Step, **adam: bool) -> Step:
    """Every optimiser of the nets rebuilt with these Adam flags (fused, or foreach off: torch's
    per-parameter loop, CPU's default, which the attack used before its foreach update), same rates."""
    for name in ("simulator_opt", "decoder_opt", "d1_opt", "d2_opt"):
        opt = getattr(nets, name)
        if opt is not None:
            group = opt.param_groups[0]
            setattr(nets, name, torch.optim.Adam(group["params"], lr=group["lr"], eps=ADAM_EPS, **adam))
    return step


def _contiguous(nets: SDARNets, step: Step) -> Step:
    """The networks' weights back in the contiguous layout (the attack keeps them channels_last on CPU)."""
    for net in (nets.simulator, nets.decoder, nets.d1, nets.d2):
        if net is not None:
            net.to(memory_format=torch.contiguous_format)
    return step


def _compiled(nets: SDARNets, step: Step) -> Step:
    """Each network through torch.compile (inductor; compiles on the first calls, the warm-up)."""
    for name in ("simulator", "decoder", "d1", "d2"):
        if getattr(nets, name) is not None:
            setattr(nets, name, torch.compile(getattr(nets, name)))
    return step


def _threads(count: int) -> Callable[[SDARNets, Step], Step]:
    """The step run with `count` torch threads (the attack's policy gives small data one)."""

    def wrap(nets: SDARNets, step: Step) -> Step:
        def threaded() -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(count)
            try:
                step()
            finally:
                torch.set_num_threads(before)

        return threaded

    return wrap


def _bfloat16(nets: SDARNets, step: Step) -> Step:
    """The attack's precision=bfloat16: forward passes under CPU autocast to bf16 (the baseline runs float32)."""
    nets.precision = "bfloat16"
    return step


VARIANTS: dict[str, Callable[[SDARNets, Step], Step]] = {
    "baseline": lambda nets, step: step,
    "per-parameter Adam": lambda nets, step: _optimisers(nets, step, foreach=False),
    "fused Adam": lambda nets, step: _optimisers(nets, step, fused=True),
    "contiguous": _contiguous,
    "torch.compile": _compiled,
    "bfloat16": _bfloat16,
    "1 thread": _threads(1),
    "2 threads": _threads(2),
}


def time_variants(ctx, names: list[str], rounds: int, per_round: int, warmup: int) -> dict[str, list[float] | str]:
    """Process CPU seconds per iteration of each variant in every round (or why it failed),
    interleaved: on cores shared with other jobs, CPU seconds do not count the time spent waiting
    for a core (with one torch thread they are the iteration's own work)."""
    observed = ctx.observed_embeddings("target", ctx.generator(0))
    preset = PRESETS["cpu"]
    known = ctx.target.y
    part = "classifier" if ctx.top_model is not None else "none"
    times: dict[str, list[float] | str] = {}
    with contextlib.ExitStack() as stack:
        steps = {}
        for name in names:
            nets, step, _ = stack.enter_context(
                sdar_training(
                    ctx, observed, known, 0, preset["batch_size"], FULL, lr_scale=preset["lr_scale"], server_part=part
                )
            )
            try:
                step = VARIANTS[name](nets, step)
                for _ in range(warmup):
                    step()
                steps[name], times[name] = step, []
            except Exception as exc:  # a variant that cannot run here is a finding, not a crash
                times[name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        for _ in range(rounds):
            for name, step in steps.items():
                start = time.process_time()
                for _ in range(per_round):
                    step()
                times[name].append((time.process_time() - start) / per_round)
    return times


NETWORKS = ("simulator", "classifier", "decoder", "d1", "d2")
OPTIMISERS = ("simulator_opt", "decoder_opt", "d1_opt", "d2_opt")


def _labelled(name: str, call: Callable) -> Callable:
    """`call` run inside a profiler range named `name`."""

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(name):
            return call(*args, **kwargs)

    return labelled


def _median_ms(call: Step, repeats: int) -> float:
    """Median process CPU milliseconds of `call`."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def iteration_profile(ctx, iterations: int, warmup: int) -> list[tuple[str, float]]:
    """(what, milliseconds per iteration) of the baseline SDAR iteration, from torch.profiler's
    top-level events (wall time): each network's forwards and each optimiser's steps (labelled
    here), the backward passes, other ops and the Python time outside any op; in process CPU
    time (median): the unprofiled iteration, each
    network's forward and forward+backward alone on one batch (batch norm and dropout in training
    mode, as in the iteration); the held-out measurement per iteration (one every EVAL_EVERY)."""
    observed = ctx.observed_embeddings("target", ctx.generator(0))
    preset = PRESETS["cpu"]
    part = "classifier" if ctx.top_model is not None else "none"
    training = sdar_training(
        ctx,
        observed,
        ctx.target.y,
        0,
        preset["batch_size"],
        FULL,
        lr_scale=preset["lr_scale"],
        server_part=part,
        holdout_fraction=0.1,
    )
    with training as (nets, step, holdout_mse):
        for _ in range(warmup):
            step()
        rows = [("iteration, not profiled", _median_ms(step, iterations))]
        for name in NETWORKS + OPTIMISERS:
            part_ = getattr(nets, name)
            if part_ is not None:
                method = "forward" if name in NETWORKS else "step"
                setattr(part_, method, _labelled(name, getattr(part_, method)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(iterations):
                step()
            wall = time.perf_counter() - start
        rows += _top_level_shares(prof.events(), wall, iterations)
        rows += _alone(ctx, nets, observed, preset["batch_size"])
        rows.append((f"held-out measurement / {EVAL_EVERY}", _median_ms(holdout_mse, 3) / EVAL_EVERY))
    return rows


def _top_level_shares(events, wall: float, iterations: int) -> list[tuple[str, float]]:
    """Milliseconds per iteration of the profiled run by top-level event kind."""
    totals: dict[str, float] = {}
    for event in events:
        if event.cpu_parent is not None:
            continue
        if event.name in NETWORKS:
            kind = f"{event.name} forward"
        elif event.name in OPTIMISERS:
            kind = f"{event.name[:-4]} optimiser step"
        elif event.name.startswith("autograd::engine"):
            kind = "backward passes (all networks)"
        else:
            kind = f"other ops ({event.name.removeprefix('aten::')})"
        totals[kind] = totals.get(kind, 0.0) + event.cpu_time_total / 1000
    listed = sorted(totals.items(), key=lambda kv: -kv[1])
    others = [(k, v) for k, v in listed if k.startswith("other ops")]
    main = [(k, v) for k, v in listed if not k.startswith("other ops")]
    per = lambda ms: ms / iterations
    rows = [("iteration, profiled", 1000 * wall / iterations)]
    rows += [(k, per(v)) for k, v in main]
    rows += [(k, per(v)) for k, v in others[:4]]
    rest = sum(v for _, v in others[4:])
    rows.append((f"other ops ({len(others) - 4} more kinds)", per(rest)))
    rows.append(("Python outside any op", 1000 * wall / iterations - per(sum(totals.values()))))
    return rows


def _alone(ctx, nets: SDARNets, observed: torch.Tensor, batch: int) -> list[tuple[str, float]]:
    """Each network's forward and forward+backward on one batch, timed alone."""
    x, y, z = ctx.aux.x[:batch], ctx.aux.y[:batch], observed[:batch]
    c = nets.condition(y)
    calls = {
        "simulator": lambda: nets.simulator(x),
        "classifier": lambda: nets.classifier(z),
        "decoder": lambda: nets.decoder(z, c),
        "d1": (lambda: nets.d1(z, c)) if nets.d1 is not None else None,
        "d2": (lambda: nets.d2(x, c)) if nets.d2 is not None else None,
    }
    rows = []
    for name, forward in calls.items():
        if forward is None:
            continue
        params = [p for p in getattr(nets, name).parameters() if p.requires_grad]
        backward = lambda forward=forward, params=params: (
            torch.autograd.grad(forward().float().pow(2).sum(), params) if params else forward()
        )
        rows.append((f"{name} alone: forward", _median_ms(forward, 9)))
        rows.append((f"{name} alone: forward+backward", _median_ms(backward, 9)))
    return rows


def trained_output(ctx, name: str, iterations: int) -> torch.Tensor:
    """The decoder's output on the first target embeddings after `iterations` of one variant, seed 0."""
    observed = ctx.observed_embeddings("target", ctx.generator(0))
    preset = PRESETS["cpu"]
    part = "classifier" if ctx.top_model is not None else "none"
    training = sdar_training(
        ctx, observed, ctx.target.y, 0, preset["batch_size"], FULL, lr_scale=preset["lr_scale"], server_part=part
    )
    with training as (nets, step, _):
        step = VARIANTS[name](nets, step)
        for _ in range(iterations):
            step()
        x_hat, _ = nets.decode(observed[:64])
    return x_hat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="digits_cnn", help="a bundled sample model's name (with its g)")
    parser.add_argument("--architecture", help="a stem of tests/support/architectures.py instead of a sample model")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="shapes_scale.py's bottom and data instead (no g)")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check", type=int, default=30, help="iterations of the identity check (0: none)")
    parser.add_argument("--threads", type=int, help="torch threads (the attack itself uses 1 on small data)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--profile", type=int, default=0, help="profile this many baseline iterations instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ctx, name = context(args, Path(tmp))
        if args.profile:
            print(f"{name}; SDAR cpu preset; {args.profile} iterations; load average {os.getloadavg()[0]:.1f}")
            for what, ms in iteration_profile(ctx, args.profile, args.warmup):
                print(f"{what:>52} {ms:9.2f} ms")
            return
        names = ["baseline", *[v for v in args.variants if v != "baseline"]]
        times = time_variants(ctx, names, args.rounds, args.per_round, args.warmup)
        reference = trained_output(ctx, "baseline", args.check) if args.check else None
        print(
            f"{name}; SDAR cpu preset (batch {PRESETS['cpu']['batch_size']}), torch threads in the attack "
            f"{'1 (small data)' if ctx.aux.x.numel() < 1_000_000 else torch.get_num_threads()}; "
            f"{args.rounds} rounds of {args.per_round} iterations; load average {os.getloadavg()[0]:.1f}"
        )
        baseline = statistics.median(times["baseline"])
        print(
            f"{'variant':>18} {'CPU s/iteration':>15} {'baseline/variant':>16}  {'after ' + str(args.check) + ' iterations'}"
        )
        for variant in names:
            if isinstance(times[variant], str):
                print(f"{variant:>18} {times[variant]}")
                continue
            seconds = statistics.median(times[variant])
            check = ""
            if reference is not None and variant != "baseline":
                try:
                    diff = float((trained_output(ctx, variant, args.check) - reference).abs().max())
                    check = "identical" if diff == 0 else f"max |difference| {diff:.2e}"
                except Exception as exc:
                    check = f"check failed: {type(exc).__name__}"
            print(f"{variant:>18} {seconds:>15.4f} {baseline / seconds:>16.2f}  {check}")


if __name__ == "__main__":
    main()
