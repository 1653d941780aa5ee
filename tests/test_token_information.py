"""The token ceiling's mathematics (splitaudit.token_information) against closed forms and
independent numerical computations."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from splitaudit.data import Dataset
from splitaudit.estimators.mean_trace import Z_95
from splitaudit.token_information import (
    binary_kl,
    fano_ceiling,
    information_upper,
    position_blind_guess,
    variance_upper,
    wilson_upper,
)
from splitaudit.token_statement import checked_against_attacks, token_statement
from splitaudit.tokens import TokenSpace


def binary_entropy(p: float) -> float:
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


def test_information_of_a_linear_gaussian_channel_is_its_closed_form():
    """X ~ N(0, diag(s^2)), f(x) = a * x (diagonal: Hadamard is tight), Z = f + N(0, sigma^2 I):
    I(X; Z) = 1/2 sum log(1 + a^2 s^2 / sigma^2) exactly. From 20000 samples the point estimate is
    within 3% of it and the upper bound (each variance at its 95% bound) is above it, by less than 6%."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.5, 1.0, 2.0, 4.0])
    hidden = 3.0 * scale * torch.randn(20000, 4, generator=gen)
    sigma = 2.0
    exact = 0.5 * float(torch.log1p((3.0 * scale) ** 2 / sigma**2).sum())
    variances, uppers = variance_upper(hidden)
    point, upper = information_upper(variances, sigma), information_upper(uppers, sigma)
    assert point == pytest.approx(exact, rel=0.03)
    assert exact < upper < 1.06 * exact
    assert information_upper(variances, 0.0) == math.inf


def test_variance_upper_bound_is_the_sample_variance_plus_z_standard_errors():
    """Against direct arithmetic on a small column (float64): s^2 (unbiased) + z sqrt((m4 - m2^2) / n)."""
    column = torch.tensor([1.0, 2.0, 4.0, 7.0, 11.0], dtype=torch.float64)
    n, centred = 5, column - column.mean()
    m2, m4 = float(centred.pow(2).mean()), float(centred.pow(4).mean())
    variances, uppers = variance_upper(column[:, None])
    assert float(variances[0]) == pytest.approx(float(column.var()), rel=1e-12)
    assert float(uppers[0]) == pytest.approx(float(column.var()) + Z_95 * math.sqrt((m4 - m2**2) / n), rel=1e-12)
    with pytest.raises(ValueError):
        variance_upper(column[:1, None])


@pytest.mark.parametrize("p", [0.55, 0.9, 0.999])
def test_fano_ceiling_solves_the_binary_kl_closed_form(p):
    """With p0 = 1/2, kl(p || 1/2) = log 2 - H(p): the information log 2 - H(p) gives ceiling p (1e-9)."""
    assert fano_ceiling(math.log(2) - binary_entropy(p), 0.5) == pytest.approx(p, abs=1e-9)
    assert binary_kl(p, 0.5) == pytest.approx(math.log(2) - binary_entropy(p), rel=1e-12)


def test_fano_ceiling_edges():
    """No information: the blind guess; log(1/p0) or more: certainty is allowed (ceiling 1)."""
    assert fano_ceiling(0.0, 0.3) == pytest.approx(0.3, abs=1e-12)
    assert fano_ceiling(math.log(4), 0.25) == 1.0 and fano_ceiling(math.inf, 0.25) == 1.0
    assert fano_ceiling(0.1, 1.0) == 1.0
    assert fano_ceiling(0.5, 0.2) < fano_ceiling(0.6, 0.2) < fano_ceiling(0.6, 0.3)


@pytest.mark.parametrize("a_over_sigma", [0.5, 1.0, 2.0])
def test_the_ceiling_holds_for_the_bayes_attacker_on_two_tokens(a_over_sigma):
    """Two equally likely tokens at +-a in one dimension, Z = X + N(0, sigma^2): the best attacker
    (the sign of Z) is right with probability Phi(a / sigma). The exact I(X; Z) = h(Z) - h(N) by
    quadrature (an independent computation) lies below the Gaussian bound 1/2 log(1 + a^2/sigma^2),
    and the ceilings from both lie above Phi(a / sigma).
    (The quadrature's own error is far below the margins: 400001 points over +-12 standard deviations.)"""
    a, sigma = a_over_sigma, 1.0
    z = torch.linspace(-a - 12, a + 12, 400001, dtype=torch.float64)
    normal = lambda m: torch.exp(-((z - m) ** 2) / 2) / math.sqrt(2 * math.pi)
    density = 0.5 * (normal(a) + normal(-a))
    entropy = float(-(density * torch.log(density)).sum() * (z[1] - z[0]))
    exact = entropy - 0.5 * math.log(2 * math.pi * math.e)
    gaussian = information_upper(torch.tensor([a**2]), sigma)
    assert 0 < exact < gaussian
    bayes = 0.5 * (1 + math.erf(a / sigma / math.sqrt(2)))
    assert bayes <= fano_ceiling(exact, 0.5) <= fano_ceiling(gaussian, 0.5) <= 1
    assert (fano_ceiling(gaussian, 0.5) < 1) == (gaussian < math.log(2))  # vacuous at a / sigma = 2 only


def test_wilson_upper_solves_the_score_equation():
    """u solves (k/n - u)^2 n = z^2 u (1 - u) above k/n (the Wilson interval's definition), 1e-9."""
    for k, n in [(3, 40), (0, 25), (17, 20)]:
        u = wilson_upper(k, n)
        assert u > k / n and (k / n - u) ** 2 * n == pytest.approx(Z_95**2 * u * (1 - u), abs=1e-9)
    assert wilson_upper(20, 20) == 1.0


def test_blind_guess_counts_padding_as_a_symbol():
    """Position 0: token 1 in 3 of 4 sentences; position 1: padded in 3 of 4, which beats every token."""
    ids = torch.tensor([[1, 5], [1, 0], [1, 0], [2, 0]])
    mask = torch.tensor([[True, True], [True, False], [True, False], [True, False]])
    assert position_blind_guess(ids, mask, 6) == [wilson_upper(3, 4), wilson_upper(3, 4)]
    assert position_blind_guess(ids, None, 6) == [wilson_upper(3, 4), wilson_upper(3, 4)]
    assert position_blind_guess(ids[:, 1:], None, 6)[0] == wilson_upper(3, 4)  # token 0 three times


def token_case(n: int = 400, length: int = 3, sigma: float = 4.0, mask=None) -> tuple[dict, torch.Tensor]:
    """A statement on random ids (8 tokens) with hidden states one-hot(ids) (variance 7/64 each)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (n, length), generator=gen)
    hidden = torch.nn.functional.one_hot(ids, 8).float()
    tokens = TokenSpace(torch.eye(8), [f"t{i}" for i in range(8)])
    aux = Dataset(x=tokens.embed(ids), y=None, source="aux", token_ids=ids, mask=mask)
    return token_statement(tokens, hidden, sigma, aux, mask), hidden


def test_token_statement_composes_the_position_ceilings():
    """Without padding: token ceiling = mean of the per-position ceilings, exact ceiling = the least
    of them and of the whole-sentence ceiling; the information is the Gaussian bound of the hidden
    states' variance upper bounds; the ceilings are below 1 at sigma = 4 and 1 without noise."""
    statement, hidden = token_case()
    _, uppers = variance_upper(hidden)
    information = information_upper(uppers, 4.0)
    assert statement["information_nats"] == pytest.approx(information, rel=1e-12)
    per_position = [fano_ceiling(information, p0) for p0 in statement["position_blind_guess"]]
    assert statement["position_ceiling"] == pytest.approx(per_position)
    assert statement["token_accuracy_ceiling"] == pytest.approx(sum(per_position) / 3)
    exact = min(*per_position, fano_ceiling(information, statement["sentence_blind_guess"]))
    assert statement["exact_match_ceiling"] == pytest.approx(exact)
    assert statement["token_accuracy_ceiling"] < 1 and statement["samples"] == 400
    sigma = statement["informative_from_sigma"]
    assert token_case(sigma=0.99 * sigma)[0]["token_accuracy_ceiling"] == 1
    assert token_case(sigma=1.01 * sigma)[0]["token_accuracy_ceiling"] < 1
    silent, _ = token_case(sigma=0.0)
    assert silent["token_accuracy_ceiling"] == silent["exact_match_ceiling"] == 1.0
    assert any("sigma = 0" in note for note in silent["assumptions"])


def test_padded_positions_divide_the_ceiling_by_their_real_share():
    """Position 2 real in a quarter of the sentences: its ceiling c / 0.25 (at most 1); the token
    ceiling sum c_t / sum r_t; the exact ceiling min_t c_t + 1 - r_t (no whole-sentence term)."""
    mask = torch.ones(400, 3, dtype=torch.bool)
    mask[100:, 2] = False
    statement, _ = token_case(mask=mask, sigma=8.0)
    information = statement["information_nats"]
    c = [fano_ceiling(information, p0) for p0 in statement["position_blind_guess"]]
    real = [1.0, 1.0, 0.25]
    assert statement["position_ceiling"] == pytest.approx([c[0], c[1], min(1.0, c[2] / 0.25)])
    assert statement["token_accuracy_ceiling"] == pytest.approx(min(1.0, sum(c) / sum(real)))
    assert statement["exact_match_ceiling"] == pytest.approx(min(ct + 1 - r for ct, r in zip(c, real)))
    assert statement["sentence_blind_guess"] is None
    assert any("padding" in note for note in statement["assumptions"])


def test_checked_against_attacks_returns_new_sections_and_leaves_its_inputs_alone():
    """An attack above the token ceiling or the exact-match ceiling is flagged in both sections;
    attacks without token accuracy (or not ok) are not compared; the inputs are unchanged."""
    statement = {"token_accuracy_ceiling": 0.5, "exact_match_ceiling": 0.2}
    bounds = {"violated_by": ["decoder"], "notes": []}
    attacks = {
        "token-inversion": {"status": "ok", "metrics": {"token_accuracy": 0.6, "exact_match": 0.1}},
        "optimization": {"status": "ok", "metrics": {"token_accuracy": 0.4, "exact_match": 0.3}},
        "decoder": {"status": "ok", "metrics": {"token_accuracy": 0.3, "exact_match": 0.0}},
        "kmeans": {"status": "ok", "metrics": {"nmi": 0.9}},
        "sdar": {"status": "skipped", "metrics": {"token_accuracy": 1.0}},
    }
    before = copy.deepcopy((statement, bounds, attacks))
    tokens, checked = checked_against_attacks(statement, bounds, attacks)
    assert (statement, bounds, attacks) == before
    assert tokens["compared_with"] == ["token-inversion", "optimization", "decoder"]
    assert tokens["violated_by"] == ["token-inversion", "optimization"]
    assert checked["violated_by"] == ["decoder", "token-inversion", "optimization"]
    assert "token statement" in checked["notes"][0]
    calm, same = checked_against_attacks(
        {**statement, "token_accuracy_ceiling": 0.7, "exact_match_ceiling": 0.5}, bounds, attacks
    )
    assert calm["violated_by"] == [] and same is bounds
