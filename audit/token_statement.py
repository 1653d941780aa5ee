"""What the audit means for token inputs: ceilings on any attacker's token accuracy and exact
sentence match from the information the noisy hidden states carry (the mathematics is in
splitaudit.token_information), and their check against the token attacks' results.
"""

from __future__ import annotations

import math

import torch

from splitaudit.data import Dataset
from splitaudit.token_information import (
    ceilings,
    information_upper,
    informative_sigma,
    position_blind_guess,
    sentence_blind_guess,
    variance_upper,
)
from splitaudit.tokens import TokenSpace


def token_statement(
    tokens: TokenSpace, hidden: torch.Tensor, noise_sigma: float, aux: Dataset, target_mask: torch.Tensor | None
) -> dict:
    """Ceilings on any attacker's token accuracy and exact-sentence match at this noise, from the
    information the noisy hidden states carry about the sentence (splitaudit.token_information):
    hidden: the clean hidden states of the audited (target) sentences; aux: the sentences whose
    most frequent token per position is the blind guess."""
    variances, uppers = variance_upper(hidden)
    information = information_upper(uppers, noise_sigma)
    length = aux.token_ids.shape[1]
    real = [1.0] * length if target_mask is None else target_mask.double().mean(dim=0).tolist()
    position_blind = position_blind_guess(aux.token_ids.cpu(), _cpu(aux.mask), tokens.size)
    sentence_blind = sentence_blind_guess(aux.token_ids.cpu()) if aux.mask is None and target_mask is None else None
    return {
        "embedding_dim": tokens.table.shape[1],
        "vocab_size": tokens.size,
        "noise_sigma": noise_sigma,
        "hidden_coordinates": len(variances),
        "samples": len(hidden),
        "information_nats": information,
        "information_nats_point": information_upper(variances, noise_sigma),
        "position_blind_guess": position_blind,
        "sentence_blind_guess": sentence_blind,
        **ceilings(information, position_blind, real, sentence_blind),
        "informative_from_sigma": informative_sigma(uppers, position_blind, real),
        "assumptions": _statement_assumptions(noise_sigma, target_mask is not None),
    }


def _cpu(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.cpu()


def _statement_assumptions(noise_sigma: float, padded: bool) -> list[str]:
    notes = [
        "the noise is added on the hidden states as audited (Z = f(X) + N(0, sigma^2 I)); the ceilings hold "
        "for any attacker (any computation, auxiliary data or model access independent of the target)",
        "I(X; Z) <= 1/2 sum_j log(1 + Var(f_j)/sigma^2) over the hidden coordinates (Gaussian maximum "
        "entropy, Hadamard); each Var(f_j) is taken at its upper 95% bound on the audited sentences (normal "
        "approximation, per coordinate rather than simultaneous; for a stochastic encoder the variance over "
        "the inputs and its draws)",
        "the blind guesses (the most frequent token at each position, the most frequent sentence) come from "
        "aux at their upper 95% bounds: aux is assumed drawn like the target, with its positions as the target's",
        "the ceilings concern the expected accuracy over sentences like the audited ones; a measured accuracy "
        "carries sampling error",
    ]
    if noise_sigma <= 0:
        notes.append("no noise (sigma = 0): the hidden states may determine the sentence, so the ceilings are 1")
    if padded:
        notes.append(
            "padding: the mask counts as part of the private sentence in the information; each position's "
            "guess is a token or 'padding' and accuracy counts real positions only, so a position's ceiling is "
            "divided by its share of real tokens (at most 1)"
        )
    return notes


def checked_against_attacks(statement: dict, bounds: dict, attacks: dict) -> tuple[dict, dict]:
    """(tokens section, bounds section): the statement with the attacks it is compared with (those
    that measured token accuracy) and those whose token accuracy or exact match beats its ceilings,
    who also join the bound's violators. Neither input is changed."""
    compared = {
        name: entry["metrics"]
        for name, entry in attacks.items()
        if entry.get("status") == "ok" and "token_accuracy" in entry.get("metrics", {})
    }
    violated = [
        name
        for name, metrics in compared.items()
        if metrics["token_accuracy"] > statement["token_accuracy_ceiling"]
        or metrics.get("exact_match", -math.inf) > statement["exact_match_ceiling"]
    ]
    section = {**statement, "compared_with": list(compared), "violated_by": violated}
    if not violated:
        return section, bounds
    note = (
        f"{', '.join(violated)} recovered more tokens than the token statement allows (token accuracy "
        f"{statement['token_accuracy_ceiling']:.4g}, exact match {statement['exact_match_ceiling']:.4g}): "
        "an estimate it rests on does not hold for these inputs"
    )
    return section, {
        **bounds,
        "violated_by": bounds["violated_by"] + [name for name in violated if name not in bounds["violated_by"]],
        "notes": [*bounds.get("notes", []), note],
    }
