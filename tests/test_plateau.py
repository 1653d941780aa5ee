"""Early stopping on the attacker's own signal (core/plateau.py) and its use in the attacks."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn as nn
from conftest import make_context, sample

from splitaudit.attacks import get_attack
from splitaudit.attacks.optimization import (
    OBJECTIVE_EVERY,
    PILOT_TARGETS,
    STEP_FRACTIONS,
    ObjectiveStopping,
    OptimizationOptions,
    check_steps,
    fit_prior,
    invert,
    invert_both,
    map_weight,
    plan_inversion,
)
from splitaudit.attacks.parts.sdar_training import FULL, BatchStream, Stopping, sdar_reconstruct
from splitaudit.attacks.sdar import PRESETS, sdar_settings
from splitaudit.core.plateau import Plateau, evaluating, restore, snapshot


def feed(plateau: Plateau, values: list[float]) -> int | None:
    """The step (1-based) at which the plateau says stop, or None; the state kept is the step."""
    for step, value in enumerate(values, start=1):
        if plateau.update(step, value, lambda step=step: step):
            return step
    return None


def test_plateau_stops_after_patience_evaluations_without_a_new_best():
    plateau = Plateau(patience=3)
    assert feed(plateau, [5.0, 4.0, 4.5, 3.0, 3.1, 3.2, 3.05, 1.0]) == 7  # 3.1, 3.2, 3.05: three stale
    assert (plateau.best, plateau.best_step, plateau.best_state) == (3.0, 4, 4)
    assert plateau.details("iterations") == {"iterations_trained": 7, "best_iteration": 4, "stopped_by": "plateau"}
    assert [value for _, value in plateau.history] == [5.0, 4.0, 4.5, 3.0, 3.1, 3.2, 3.05]


def test_a_new_best_resets_the_patience_and_the_cap_is_reported_as_such():
    plateau = Plateau(patience=2)
    assert feed(plateau, [3.0, 3.5, 2.0, 2.5, 1.0, 1.5]) is None
    assert plateau.details("epochs") == {"epochs_trained": 6, "best_epoch": 5, "stopped_by": "cap"}


def test_min_improvement_is_relative_and_strict():
    """With 1%: from 1.0 a new best must be below 0.99; 0.995 and 0.99 do not count."""
    plateau = Plateau(patience=2, min_improvement=0.01)
    assert feed(plateau, [1.0, 0.995, 0.98, 0.975, 0.9705]) == 5
    assert plateau.best == 0.98 and plateau.best_step == 3


def test_nan_never_improves_and_a_run_without_a_finite_value_cannot_be_restored():
    plateau = Plateau(patience=2)
    assert feed(plateau, [math.nan, math.nan]) == 2
    assert plateau.best_state is None
    with pytest.raises(RuntimeError, match="never finite"):
        restore(plateau.best_state, nn.Linear(2, 2))


def test_snapshot_is_a_copy_and_restore_brings_it_back():
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    state = snapshot(net)()
    before = [p.clone() for p in net.state_dict().values()]
    with torch.no_grad():
        net[0].weight.add_(1.0)
    net.train()(torch.randn(4, 3))  # moves the batch-norm statistics
    restore(state, net)
    assert all(torch.equal(a, b) for a, b in zip(before, net.state_dict().values()))


def test_evaluating_puts_each_module_back_in_its_mode():
    training, frozen = nn.Linear(2, 2).train(), nn.Linear(2, 2).eval()
    with evaluating(training, frozen):
        assert not training.training and not frozen.training
    assert training.training and not frozen.training


def test_parameters_are_checked():
    with pytest.raises(ValueError):
        Plateau(patience=0)
    with pytest.raises(ValueError):
        Plateau(patience=1, min_improvement=1.0)


# --- SDAR ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_top_ctx():
    """The undefended digits CNN with its top model g (quick: one seed)."""
    return make_context("digits_cnn.onnx", "digits.npz", top_model=sample("digits_cnn_top.pt"))


def test_a_batch_stream_over_a_pool_draws_only_its_entries_once_an_epoch():
    pool = torch.tensor([3, 7, 8, 11])
    stream = BatchStream(len(pool), 3, torch.Generator().manual_seed(0), pool)
    drawn = torch.cat([stream.next() for _ in range(4)])  # three epochs
    assert sorted(drawn[:4].tolist()) == sorted(drawn[4:8].tolist()) == [3, 7, 8, 11]


def sdar_run(ctx, iterations: int, stopping: Stopping | None):
    cpu = PRESETS["cpu"]
    observed = ctx.observed_embeddings("target", ctx.generator(0))
    return sdar_reconstruct(
        ctx, observed, ctx.target.y, 0, iterations, cpu["batch_size"], FULL, lr_scale=cpu["lr_scale"], stopping=stopping
    )


def test_sdar_stops_on_the_held_out_aux_signal_without_changing_the_training_before(digits_top_ctx):
    """The measurement has its own noise draw and runs in eval mode: a run that stops follows the run
    that only records, measurement for measurement, up to where it stops; the held-out slice never
    trains (sdar_training's pool) and its MSE is an independent reconstruction of those inputs."""
    recording = sdar_run(digits_top_ctx, 150, Stopping(every=10, patience=100, holdout_fraction=0.1))[3]
    stopped = sdar_run(digits_top_ctx, 150, Stopping(every=10, patience=1, holdout_fraction=0.1))[3]
    assert recording.details("iterations")["stopped_by"] == "cap" and len(recording.history) == 15
    values = [v for _, v in recording.history]
    first_stale = next(i for i in range(1, 15) if values[i] >= min(values[:i]))  # measured: at 110 iterations
    assert stopped.stopped and stopped.last_step == 10 * (first_stale + 1)
    assert stopped.history == recording.history[: first_stale + 1]
    assert values[-1] < 0.5 * values[0]  # the signal learns: measured 0.107 at 10 iterations, 0.020 at 150


def test_sdar_reports_how_many_iterations_ran_and_why(digits_top_ctx):
    run = lambda **options: get_attack("sdar").run(
        dataclasses.replace(digits_top_ctx, attack_options={"sdar": {"iterations": 40, **options}})
    )
    stopping = run(eval_every=10, patience=1)
    fixed = run(early_stopping=False)
    assert stopping["status"] == fixed["status"] == "ok"
    details = stopping["details"]
    assert details["iterations"] == 40 and details["iterations_trained"] <= 40
    assert details["stopped_by"] in ("plateau", "cap")
    assert [step for step, _ in details["holdout_curve"]] == list(range(10, details["iterations_trained"] + 1, 10))
    assert details["holdout_mse"] == min(v for _, v in details["holdout_curve"])
    assert {k: fixed["details"][k] for k in ("iterations_trained", "stopped_by")} == {
        "iterations_trained": 40,
        "stopped_by": "cap",
    }


def test_sdar_stopping_options_are_checked(digits_top_ctx):
    bad = dataclasses.replace(digits_top_ctx, attack_options={"sdar": {"holdout_fraction": 1.0}})
    with pytest.raises(Exception, match="holdout_fraction"):
        get_attack("sdar").run(bad)


# --- optimisation --------------------------------------------------------------------------------


def test_optimization_stops_on_its_objective_and_returns_the_best_checked_iterate(digits_ctx):
    """A demanding improvement (30% a check) stops the inversion early; the iterate returned is the one
    whose objective was the best check, recomputed here independently of the loop."""
    z = digits_ctx.observed_embeddings("target", digits_ctx.generator(0))[:8]
    aux = digits_ctx.aux.x
    weights = torch.zeros(len(z))
    stopping = ObjectiveStopping(patience=1, min_improvement=0.3)
    x = invert(
        digits_ctx.encoder,
        z,
        aux,
        fit_prior(aux, "gaussian", True),
        weights,
        200,
        0.1,
        stopping=stopping,
        unit_range=True,
    )
    (plateau,) = stopping.runs
    assert plateau.stopped and plateau.last_step < 200 and plateau.last_step % OBJECTIVE_EVERY == 0
    assert stopping.details(200) == {"steps_run": plateau.last_step, "stopped_by": "plateau"}
    with torch.no_grad():
        objective = float((digits_ctx.encoder(x) - z).flatten(1).pow(2).sum())
    assert objective == pytest.approx(plateau.best, rel=1e-4)


def test_optimization_at_its_cap_is_the_fixed_budget(digits_ctx):
    """Without a plateau before the cap the result is exactly the inversion without early stopping."""
    z = digits_ctx.observed_embeddings("target", digits_ctx.generator(0))[:4]
    weights = torch.zeros(len(z))
    stopping = ObjectiveStopping(patience=50, min_improvement=0.0)
    prior = fit_prior(digits_ctx.aux.x, "gaussian", True)
    inverted = functools.partial(
        invert, digits_ctx.encoder, z, digits_ctx.aux.x, prior, weights, 30, 0.1, unit_range=True
    )
    stopped = inverted(stopping=stopping)
    fixed = inverted()
    assert torch.equal(stopped, fixed)
    assert stopping.details(30) == {"steps_run": 30, "stopped_by": "cap"}


def test_sdar_holds_no_aux_out_when_no_plateau_could_end_training_before_the_cap(digits_top_ctx):
    """The earliest stop is eval_every x (patience + 1) iterations; at or below it (a quick run's
    150 against the defaults' 550 with g, 350 without) stopping is off, so no aux is held out for
    nothing. The default patience is 10 measurements where g labels the simulator's embeddings, 6
    without g, where stopping is off unless asked for (its signal does not track the targets there)."""
    settings = lambda ctx, **options: sdar_settings(dataclasses.replace(ctx, attack_options={"sdar": options}))
    with_g, without_g = digits_top_ctx, dataclasses.replace(digits_top_ctx, top_model=None)
    assert with_g.quick and settings(with_g).iterations == 150 and settings(with_g).stopping is None
    assert settings(with_g, iterations=550).stopping is None
    assert settings(with_g, iterations=551).stopping == Stopping(every=50, patience=10, holdout_fraction=0.1)
    assert settings(without_g, iterations=351).stopping is None
    assert settings(without_g, iterations=350, early_stopping=True).stopping is None
    asked = settings(without_g, iterations=351, early_stopping=True).stopping
    assert asked == Stopping(every=50, patience=6, holdout_fraction=0.1)
    assert settings(with_g, iterations=551, early_stopping=False).stopping is None
    assert settings(with_g, iterations=40, eval_every=10, patience=1).stopping is not None


def test_optimization_pilot_keeps_the_step_and_stop_that_best_invert_the_attackers_own_aux(digits_ctx):
    """plan_inversion tries every fraction of lr on the first PILOT_TARGETS aux samples, scores every
    check of each trajectory, keeps the lowest MSE, and the score it reports for the kept step is the
    one an independent inversion, stopped where the pilot chose, ends with. Stop 0 is the pilot
    samples' mean guess (the start). Called twice: the plan is deterministic."""
    weight = map_weight(digits_ctx)
    opts = OptimizationOptions(steps=20, lr=1.0, init="mean")
    plans = [plan_inversion(digits_ctx, 0, digits_ctx.generator(0), opts, weight, None) for _ in range(2)]
    plan = plans[0]
    assert plan.details() == plans[1].details()
    assert plan.init == "mean" and plan.decoder is None and plan.pilots == PILOT_TARGETS
    assert list(plan.scores) == [f"mean {fraction:.4g}" for fraction in STEP_FRACTIONS]
    assert plan.scores[f"mean {plan.lr:.4g}"] == min(plan.scores.values()) < plan.mean_guess
    assert plan.stop in check_steps(20) and plan.stop > 0
    x = digits_ctx.aux.x[:PILOT_TARGETS]
    z = digits_ctx.clean_embeddings("aux")[:PILOT_TARGETS]  # sigma = 0: observed = clean
    others = digits_ctx.aux.x[PILOT_TARGETS:]  # the pilot's prior and start leave its own samples out
    prior = fit_prior(others, "pca", True)
    for stop, expected in ((plan.stop, plan.scores[f"mean {plan.lr:.4g}"]), (0, plan.mean_guess)):
        x_unbiased, x_map = invert_both(digits_ctx, z, prior, weight, 20, plan.lr, prior_x=others, stop=stop)
        mse = float(((x_unbiased - x).pow(2).mean() + (x_map - x).pow(2).mean()) / 2)
        assert mse == pytest.approx(expected, rel=1e-4)
