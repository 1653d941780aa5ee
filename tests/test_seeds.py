"""Seeds added by their spread: at least two, a third only while the mean advantage is uncertain."""

from __future__ import annotations

import dataclasses
import math

import pytest
from scipy import stats

from splitaudit.attacks import get_attack
from splitaudit.attacks.base import MIN_SEEDS, SEED_TOLERANCE, SeedOutcome, mean_is_uncertain
from splitaudit.execution.executor import LocalExecutor, run_attack_grid


def test_interval_rule_against_the_student_t_closed_form():
    # Two values a, b: half-width = t(0.975, 1) * |a - b| / 2 (s = |a - b| / sqrt 2, n = 2).
    t1 = stats.t.ppf(0.975, 1)
    assert t1 == pytest.approx(12.706, abs=1e-3)
    gap = 2 * SEED_TOLERANCE * 1.0 / t1  # the widest gap that is certain around a mean of 1
    assert not mean_is_uncertain([1 - 0.49 * gap, 1 + 0.49 * gap])
    assert mean_is_uncertain([1 - 0.51 * gap, 1 + 0.51 * gap])
    assert not mean_is_uncertain([0.3, 0.3, 0.3])  # no spread at all
    assert mean_is_uncertain([0.02, -0.02])  # straddles the baseline
    assert mean_is_uncertain([1.0, math.nan]) and mean_is_uncertain([1.0])


def outcomes(*accuracies: float) -> list[SeedOutcome]:
    return [SeedOutcome(metrics={"accuracy": a}, baseline={"accuracy": 0.1}) for a in accuracies]


def test_next_seed_runs_two_then_a_third_only_when_they_disagree():
    kmeans, seeds = get_attack("kmeans"), [7, 8, 9]
    assert [kmeans.next_seed(seeds, outcomes(*[0.9] * k)) for k in range(MIN_SEEDS)] == seeds[:MIN_SEEDS]
    assert kmeans.next_seed(seeds, outcomes(0.90, 0.901)) is None  # advantages 0.8 and 0.801 agree
    assert kmeans.next_seed(seeds, outcomes(0.6, 0.9)) == 9
    assert kmeans.next_seed(seeds, outcomes(0.6, 0.9, 0.7)) is None  # never past the planned seeds
    assert kmeans.next_seed([7], outcomes()) == 7 and kmeans.next_seed([7], outcomes(0.5)) is None  # --quick


def test_grid_and_run_add_the_same_seeds(cancer_ctx):
    """The executor's rounds and Attack.run take the same decisions, and the entry lists the
    seeds that ran (one task each)."""
    ctx = dataclasses.replace(cancer_ctx, quick=False)
    grid, results = run_attack_grid(ctx, ["kmeans"], [0.0], LocalExecutor())
    entry = grid[0.0]["kmeans"]
    assert entry["seeds"] == get_attack("kmeans").run(ctx)["seeds"]
    assert len(results) == len(entry["seeds"]) >= MIN_SEEDS
