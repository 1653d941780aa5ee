"""The optimisation attack on token inputs: gradient descent over the vocabulary simplex."""

from __future__ import annotations

import math

import pytest
import torch
from test_tokens import bottom, files, token_context  # noqa: F401  (bottom and files are fixtures)

from splitaudit.attacks import get_attack
from splitaudit.attacks.optimization import PILOT_TARGETS, STEP_FRACTIONS
from splitaudit.attacks.parts import token_relaxation as relaxation
from tests.support.token_models import VOCAB


def test_the_simplex_starts_at_the_smoothed_aux_frequencies_and_spans_the_table(files):  # noqa: F811
    """softmax(start) is the add-one smoothed per-position token frequency of the aux ids (counted
    independently here); near one-hot logits give exactly the table's rows."""
    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab)
    simplex = relaxation.vocabulary_simplex(ctx.tokens, ctx.aux)
    ids = ctx.aux.token_ids
    for position in (0, 3):
        counts = torch.bincount(ids[:, position], minlength=VOCAB).double() + 1
        torch.testing.assert_close(simplex.start[position].softmax(0).double(), counts / counts.sum())
    assert simplex.candidates == VOCAB and simplex.step_unit == pytest.approx(math.log(VOCAB))
    picks = torch.tensor([[3, 0, 39]])
    one_hot = torch.nn.functional.one_hot(picks, VOCAB).float() * 100
    torch.testing.assert_close(simplex.inputs(one_hot), ctx.tokens.table[picks])


def test_a_large_vocabulary_keeps_its_most_frequent_aux_tokens(files, monkeypatch):  # noqa: F811
    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab)
    monkeypatch.setattr(relaxation, "MAX_CANDIDATES", 5)
    simplex = relaxation.vocabulary_simplex(ctx.tokens, ctx.aux)
    totals = torch.bincount(ctx.aux.token_ids.flatten(), minlength=VOCAB)
    kept = [int(i) for i in range(VOCAB) if any(torch.equal(ctx.tokens.table[i], row) for row in simplex.rows)]
    assert len(kept) == 5 and min(totals[kept]) >= totals.sort(descending=True).values[4]
    assert simplex.start.shape == (ctx.aux.token_ids.shape[1], 5)


def test_the_optimisation_attack_recovers_tokens_and_beats_the_mean_guess(files):  # noqa: F811
    """At sigma = 0 on the tiny transformer the relaxation reads most tokens back: embedding MSE
    below half the mean guess and token accuracy far above the most-frequent-token baseline
    (random ids over 40 tokens: the baseline is near 1/40); the same seed gives the same result."""
    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab)
    entries = [get_attack("optimization").run(ctx) for _ in range(2)]
    entry = entries[0]
    assert entry["status"] == "ok" and not entry.get("failed_to_train"), entry.get("failed_to_train")
    assert entry["metrics"]["mse"] < 0.5 * entry["baseline"]["mse"]
    assert entry["metrics"]["token_accuracy"] > entry["baseline"]["token_accuracy"] + 0.4
    assert entry["details"]["candidate_tokens"] == VOCAB
    assert entries[1]["metrics"] == pytest.approx(entry["metrics"], nan_ok=True)


def test_the_cost_estimate_counts_nothing_for_an_attack_token_inputs_skip(files):  # noqa: F811
    """SDAR is skipped on token inputs, so the up-front estimate gives it 0 s (it gave the GPT-2-sized
    bottom 1.6 h); the optimisation attack, which runs, keeps a positive estimate."""
    from splitaudit.stages.cost import estimate_cost

    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab)
    stages = estimate_cost(ctx, "gaussian", 0.1, ["sdar", "optimization"]).stages
    assert stages["sdar"] == 0 and stages["optimization"] > 0


def test_under_quick_long_sentences_are_inverted_up_to_a_position_budget(files, monkeypatch):  # noqa: F811
    """QUICK_TOKEN_POSITIONS = 12 at T = 6: the optimisation inverts 2 sentences (not quick_samples = 64,
    nor the 60 targets), its token metrics count those 2 x 6 positions, and the up-front estimate
    (linear in the sentences inverted, the step pilot's 4 x 4 aux sentences added) falls from 60 + 16 to 2 + 16
    inverted; 1024 positions at GPT-2's
    T = 128 are 8 sentences."""
    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab)
    attack = get_attack("optimization")
    no_fit = lambda step: 0.0  # the prior's fits take no time: the encoder passes are counted
    full = attack.estimated_seconds(ctx, 1.0, no_fit)  # one second per encoder pass
    monkeypatch.setattr(relaxation, "QUICK_TOKEN_POSITIONS", 12)
    entry = attack.run(ctx)
    assert entry["details"]["samples"] == 2 and len(ctx.target) == 60
    assert entry["metrics"]["token_accuracy"] * 12 == pytest.approx(round(entry["metrics"]["token_accuracy"] * 12))
    inverted = lambda n: n + len(STEP_FRACTIONS) * PILOT_TARGETS  # the step pilot's aux samples
    assert attack.estimated_seconds(ctx, 1.0, no_fit) == pytest.approx(full * inverted(2) / inverted(60), rel=1e-12)
    monkeypatch.setattr(relaxation, "QUICK_TOKEN_POSITIONS", 1024)
    assert relaxation.quick_token_sentences(128) == 8 and relaxation.quick_token_sentences(100000) == 1
