"""Token inputs in the report: the token statement, reconstructed sentences and per-position accuracy.

Reads the result only (the statement is computed in splitaudit.tokens, the sentences by the attacks);
the templates escape every string, so sentences from user vocabularies are shown as text.
"""

from __future__ import annotations

from splitaudit.reports.formatting import number


def token_statement_words(statement: dict) -> str:
    """The bound read in tokens, with its assumptions."""
    violated = statement.get("violated_by") or []
    words = (
        f"No attacker recovers more than {number(statement.get('token_accuracy_ceiling'))} of the tokens on "
        f"average ({number(statement.get('token_accuracy_ceiling_unbiased'))} for unbiased attackers). The bound "
        f"forces an RMS error of {number(statement.get('radius'))} per position in the {statement.get('embedding_dim')}"
        f"-dimensional embedding space, against a median distance of "
        f"{number(statement.get('nearest_neighbour_median'))} from a token to its nearest other token: a median of "
        f"{number(statement.get('tokens_within_radius_median'))} other tokens lie within that error of a token, and "
        f"{number(statement.get('share_separable'))} of the tokens are farther than twice that error from every other. "
        "Assumptions: " + "; ".join(statement.get("assumptions") or []) + "."
    )
    if violated:
        words += f" Beaten by {', '.join(violated)}: the ceiling does not hold here."
    return words


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
