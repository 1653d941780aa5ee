"""Token inputs in the report: the token statement, reconstructed sentences and per-position accuracy.

Reads the result only (the statement is computed in splitaudit.inputs.tokens, the sentences by the attacks);
the templates escape every string, so sentences from user vocabularies are shown as text.
"""

from __future__ import annotations

from splitaudit.reports.formatting import number


def token_statement_words(statement: dict) -> str:
    """The token ceilings in words: what no attacker can beat at the audited noise, why, under which
    assumptions, and which attacks were checked against them."""
    violated = statement.get("violated_by") or []
    informative = statement.get("informative_from_sigma")
    compared = statement.get("compared_with") or []
    words = (
        f"At sigma = {number(statement.get('noise_sigma'))} no attacker recovers more than "
        f"{number(statement.get('token_accuracy_ceiling'))} of the tokens on average ("
        + _range(statement.get("position_ceiling"))
        + f") or more than "
        f"{number(statement.get('exact_match_ceiling'))} of the sentences exactly: the noisy hidden states carry "
        f"at most {number(statement.get('information_nats'))} nats about a sentence (95% upper bound; point "
        f"estimate {number(statement.get('information_nats_point'))}, over "
        f"{statement.get('hidden_coordinates')} hidden coordinates and {statement.get('samples')} sentences), and "
        "by the generalised Fano inequality (Chen, Guntuboyina & Zhang, JMLR 2016) an attacker's accuracy p at a "
        "position satisfies kl(p || p0) <= that information, p0 being the best blind guess there (the most "
        "frequent aux token, at most " + _range(statement.get("position_blind_guess")) + "). "
    )
    words += (
        f"The token ceiling falls below 1 from sigma = {number(informative)} on. "
        if informative is not None
        else "The blind guesses alone reach 1: the ceiling stays 1 at every sigma. "
    )
    words += "Compared with: " + (", ".join(compared) if compared else "no attack that measured token accuracy") + ". "
    words += "Assumptions: " + "; ".join(statement.get("assumptions") or []) + "."
    if violated:
        words += f" Beaten by {', '.join(violated)}: the ceiling does not hold here."
    return words


def _range(values) -> str:
    values = [v for v in values or [] if v is not None]
    if not values:
        return "n/a"
    low, high = min(values), max(values)
    return number(low) if low == high else f"{number(low)} to {number(high)} by position"


def sentence_rows(attack: dict) -> list[list[str]]:
    """(original, reconstruction) rows of a token attack's example sentences."""
    sentences = ((attack.get("details") or {}).get("tokens") or {}).get("sentences") or []
    return [[str(s.get("original", "")), str(s.get("reconstruction", ""))] for s in sentences]


def position_words(attack: dict) -> str:
    """Token accuracy at each position against the baseline's, in words."""
    tokens = (attack.get("details") or {}).get("tokens") or {}
    ours, base = tokens.get("position_accuracy"), tokens.get("baseline_position_accuracy")
    if not ours:
        return ""
    listed = lambda values: ", ".join(number(v, 2) for v in values)
    return f"Token accuracy by position: {listed(ours)} (baseline {listed(base or [])})."
