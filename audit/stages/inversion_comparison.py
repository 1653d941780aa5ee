"""Sequential against learned inversion at one noise sigma of a sweep on a token bottom.

The sequential inversion (SIPIT, Nikolaou et al., ICLR 2026) is exact at sigma 0 on a causal bottom;
under noise it searches for the most likely sentence, position by position, while the learned
inversion is trained on aux sentences at that noise. Where the learned attack recovers more tokens,
a sweep must not let the sequential number stand for what an attacker reaches: this says where and
why. A pure function of the point's two attack entries, as the regression test is of its reports.

Weaker means: the learned token accuracy exceeds the sequential one by more than Z standard errors
of the difference. Each standard error is sqrt(p (1 - p) / n + s^2 / k): n the sentences the
attack scored (the sequential search inverts the first max_sentences of the target, the learned
attack scores all of them; per-sentence accuracy lies in [0, 1], so its variance is at most p (1 - p)
whatever the correlation of tokens within a sentence), s the spread over its k seeds.
"""

from __future__ import annotations

import math

SEQUENTIAL, LEARNED = "sequential-inversion", "token-inversion"
METRIC = "token_accuracy"
Z = 1.96  # two-sided 95%


def compare_inversions(attacks: dict, sigma: float) -> dict | None:
    """The comparison at noise `sigma` when both attacks measured token accuracy there, else None."""
    sequential, learned = attacks.get(SEQUENTIAL) or {}, attacks.get(LEARNED) or {}
    if sequential.get("status") != "ok" or learned.get("status") != "ok":
        return None
    details = sequential.get("details") or {}
    scored = int(details.get("sentences_inverted") or 0)
    target = int(details.get("target_sentences") or scored)
    p_seq, p_learned = sequential["metrics"][METRIC], learned["metrics"][METRIC]
    margin = Z * math.hypot(standard_error(sequential, scored), standard_error(learned, target))
    weaker = p_learned - p_seq > margin
    return {
        "sequential": p_seq,
        "learned": p_learned,
        "margin": margin,
        "sequential_sentences": scored,
        "learned_sentences": target,
        "weaker": weaker,
        "reasons": why_weaker(details, sigma, scored, target) if weaker else [],
    }


def standard_error(entry: dict, sentences: int) -> float:
    """Of an attack's mean token accuracy: sentence sampling (at most p(1 - p) per sentence) and seeds."""
    p = entry["metrics"][METRIC]
    spread = (entry.get("metrics_std") or {}).get(METRIC) or 0.0
    seeds = max(len(entry.get("seeds") or []), 1)
    return math.sqrt(p * (1 - p) / max(sentences, 1) + spread**2 / seeds)


def why_weaker(details: dict, sigma: float, scored: int, target: int) -> list[str]:
    """What in the sequential search, as run, lets the learned attack recover more tokens."""
    reasons = []
    candidates, vocab = details.get("candidates"), details.get("vocab_size")
    if candidates is not None and vocab is not None and candidates < vocab:
        reasons.append(
            f"the search scored only the {candidates} most frequent aux tokens of {vocab} at each position "
            "(option candidates): a token outside them is never recovered"
        )
    if sigma > 0:
        reasons.append(noise_reason(details.get("prior"), details.get("beam")))
    if not reasons:
        reasons.append(
            f"it inverted the first {scored} of {target} target sentences (option max_sentences) and the learned "
            "attack scored all of them: the gap may lie in which sentences were scored"
        )
    return reasons


def noise_reason(prior: str | None, beam) -> str:
    """Why a search by likelihood loses to a decoder trained at the noise, for the prior it used."""
    if prior == "aux":
        return (
            f"under noise it ranks tokens by each position's Gaussian likelihood and the aux bigram prior, keeping "
            f"the {beam} most likely prefixes, so a wrong early token misleads the later positions; the learned "
            "attack, trained on aux sentences at this noise, uses the aux distribution of tokens given the noisy "
            "states, which a bigram prior only approximates"
        )
    return (
        f"under noise it ranks tokens by each position's Gaussian likelihood alone (prior=none: no aux "
        f"distribution), keeping the {beam} most likely prefixes: where the noise drowns a state it guesses "
        "blindly, while the learned attack, trained on aux sentences at this noise, falls back on the aux "
        "distribution (prior=aux gives the search a bigram prior of it)"
    )
