"""What the audit means for tokens: a ceiling on any attacker's token accuracy from the information
the noisy hidden states carry about the sentence (generalised Fano). Pure computations, no I/O.

The channel is the one audited: Z = f(X) + N(0, sigma^2 I), the noise added on the hidden states
(--noise-sigma), X the sentence (its ids and, when the data has one, its attention mask).

Information (Cover & Thomas, 2006, chapters 8 and 17). For any input distribution,
I(X; Z) = h(Z) - h(Z | X) <= 1/2 log det(I + Cov(f)/sigma^2) <= 1/2 sum_j log(1 + Var(f_j)/sigma^2): the Gaussian maximises entropy at a given covariance,
h(Z | X = x) >= h(N) since the noise is independent of f (also when f itself is random: a
stochastic encoder's Var(f_j) is then over the inputs and the encoder's draws), and Hadamard's
inequality bounds the determinant by its diagonal. No smoothing and no prior are needed. Var(f_j),
one per hidden coordinate, is estimated on the audited data: each is replaced by its upper 95%
confidence bound s_j^2 + z se(s_j^2), se from the sample fourth moment, and as the bound grows with
every Var(f_j), the sum with these upper bounds is an upper bound on I whenever each holds.

Ceiling (Chen, Guntuboyina & Zhang, JMLR 2016, generalised Fano; Wilson, JASA 1927, for the
blind guess). An attacker guessing a discrete X' from Z (with any computation, randomness or auxiliary data independent of the target) succeeds
with probability p; against P_X' x P_Z (Z independent of X') the same guess succeeds with
probability q <= p0 = max_a P(X' = a). Data processing of the indicator "guess correct" gives
kl(p || q) <= I(X'; Z) <= I(X; Z), hence kl(p || p0) <= I(X; Z) when p >= p0 (kl(p || .) falls on
[0, p]). The ceiling is the largest such p. Per position t, X'_t is the token at t or "padding";
the blind guess p0_t is the most frequent of these at t in aux (the token metrics' baseline), taken
at its upper 95% (Wilson) bound. Padded positions count nowhere in the metrics: a correct real token
at t is a correct X'_t, so accuracy over the real positions (share r_t of the target's sentences)
is at most c_t / r_t, the token accuracy at most sum_t c_t / sum_t r_t, and an exact sentence
(every real token right) at most c_t + 1 - r_t for every t; without padding also the ceiling of
the whole sentence against the most frequent aux sentence.
"""

from __future__ import annotations

import math

import torch

from splitaudit.estimators.mean_trace import Z_95

MOMENT_CHUNK = 2**22  # hidden-state values whose moments are computed at a time (float64, 32 MiB)
SIGMA_SEARCH_STEPS = 60  # bisection steps for the noise at which the ceiling first says something


def variance_upper(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample variance, its upper 95% bound) of each hidden coordinate over the samples [N, ...]:
    s^2 + z sqrt((m4 - m2^2) / N), the normal approximation of the sampling error of s^2."""
    flat = hidden.detach().flatten(1)
    n = len(flat)
    if n < 2:
        raise ValueError("the variance of the hidden states needs at least two samples")
    columns = max(1, MOMENT_CHUNK // n)
    variances, uppers = [], []
    for part in flat.split(columns, dim=1):
        centred = part.double() - part.double().mean(dim=0)
        m2, m4 = centred.pow(2).mean(dim=0), centred.pow(4).mean(dim=0)
        s2 = m2 * n / (n - 1)
        variances.append(s2)
        uppers.append(s2 + Z_95 * ((m4 - m2**2).clamp(min=0) / n).sqrt())
    return torch.cat(variances), torch.cat(uppers)


def information_upper(variances: torch.Tensor, sigma: float) -> float:
    """1/2 sum_j log(1 + Var_j / sigma^2) in nats: the most I(X; Z) can be (infinite without noise)."""
    if sigma <= 0:
        return math.inf
    return 0.5 * float(torch.log1p(variances.double() / sigma**2).sum())


def binary_kl(p: float, q: float) -> float:
    """kl(p || q) between Bernoulli(p) and Bernoulli(q), nats (0 log 0 = 0), for q in (0, 1)."""
    return (p * math.log(p / q) if p > 0 else 0.0) + ((1 - p) * math.log((1 - p) / (1 - q)) if p < 1 else 0.0)


def fano_ceiling(information: float, blind: float) -> float:
    """The largest p in [blind, 1] with kl(p || blind) <= information: no attacker guesses a discrete
    variable right more often when its best blind guess is right with probability `blind` and the
    observation carries at most `information` nats about it. Checked at run time: kl(ceiling || blind)
    brackets the information (RuntimeError otherwise, as a wrong ceiling would be silent)."""
    if blind >= 1 or information >= -math.log(blind):
        return 1.0  # kl(1 || blind) = log(1 / blind): even certainty is allowed
    low, high = blind, 1.0
    while high - low > 1e-12 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if binary_kl(middle, blind) <= information else (low, middle)
    if not binary_kl(low, blind) <= information < binary_kl(high, blind):
        raise RuntimeError(f"token ceiling {high} does not solve kl(p || {blind}) = {information}")
    return high


def wilson_upper(successes: float, trials: int, z: float = Z_95) -> float:
    """Upper end of the Wilson score interval for a binomial share (the blind guess's sampling error)."""
    centre = (successes + z**2 / 2) / (trials + z**2)
    half = z / (trials + z**2) * math.sqrt(successes * (trials - successes) / trials + z**2 / 4)
    return min(1.0, centre + half)


def position_counts(aux_ids: torch.Tensor, vocab_size: int, aux_valid: torch.Tensor | None = None) -> torch.Tensor:
    """How often each token occurs at each position of the aux sentences [T, V], counting real
    (unpadded) positions only."""
    valid = torch.ones_like(aux_ids, dtype=torch.bool) if aux_valid is None else aux_valid.to(aux_ids.device)
    counts = torch.zeros(aux_ids.shape[1], vocab_size, device=aux_ids.device)
    positions = torch.arange(aux_ids.shape[1], device=aux_ids.device).expand_as(aux_ids)
    counts.index_put_((positions[valid], aux_ids[valid]), torch.ones(()), accumulate=True)
    return counts


def position_blind_guess(ids: torch.Tensor, mask: torch.Tensor | None, vocab_size: int) -> list[float]:
    """p0_t for each position: the upper 95% bound on how often the most frequent of (each token,
    padding) occurs at t in the aux sentences [N, T]."""
    counts = position_counts(ids, vocab_size, mask).max(dim=1).values
    padded = torch.zeros_like(counts) if mask is None else (~mask).sum(dim=0).to(counts)
    return [wilson_upper(float(c), len(ids)) for c in torch.maximum(counts, padded)]


def sentence_blind_guess(ids: torch.Tensor) -> float:
    """p0 for whole sentences: the upper 95% bound on the share of the most frequent aux sentence."""
    _, counts = torch.unique(ids, dim=0, return_counts=True)
    return wilson_upper(float(counts.max()), len(ids))


def ceilings(information: float, position_blind: list[float], real: list[float], sentence_blind: float | None) -> dict:
    """The per-position, token-accuracy and exact-sentence ceilings for an information upper bound
    (real: the share of the target's sentences with a real token at each position)."""
    per_position = [fano_ceiling(information, p0) for p0 in position_blind]
    exact = min(c + 1 - r for c, r in zip(per_position, real))
    if sentence_blind is not None:
        exact = min(exact, fano_ceiling(information, sentence_blind))
    return {
        "position_ceiling": [min(1.0, c / r) if r > 0 else 1.0 for c, r in zip(per_position, real)],
        "token_accuracy_ceiling": min(1.0, sum(per_position) / sum(real)),
        "exact_match_ceiling": min(1.0, exact),
    }


def informative_sigma(variances: torch.Tensor, position_blind: list[float], real: list[float]) -> float | None:
    """The smallest noise sigma at which the token-accuracy ceiling falls below 1 (None: at no sigma,
    when the blind guesses alone reach 1). The ceiling only falls as sigma grows."""
    below_one = lambda s: (
        ceilings(information_upper(variances, s), position_blind, real, None)["token_accuracy_ceiling"] < 1
    )
    high = max(float(variances.max().sqrt()), 1e-12)
    for _ in range(200):
        if below_one(high):
            break
        high *= 2
    else:
        return None
    low = 0.0
    for _ in range(SIGMA_SEARCH_STEPS):
        middle = (low + high) / 2
        low, high = (low, middle) if below_one(middle) else (middle, high)
    return high
