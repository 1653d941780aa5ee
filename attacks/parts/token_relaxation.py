"""The optimisation attack on token inputs: gradient descent over the vocabulary simplex.

Why not on the embeddings themselves: after a transformer's first LayerNorm the blocks barely see
the scale of the input embeddings, so minimising ||f(E) - z||^2 over E leaves that scale free and
the iterate drifts far from every token while still fitting z (a post-norm 2-layer bottom: fit
residual 0.018 per value, embedding MSE 12 to 19 against 0.76 for guessing the aux mean). Every
real input holds a row of the embedding table at each position, so the attacker optimises
per-position logits over the vocabulary and feeds E = softmax(logits) @ table: the iterate stays
in the table's convex hull (the continuous relaxation used by white-box text inversion), and is
decoded to the nearest tokens afterwards like every reconstructed embedding.

The start is the log of the aux sentences' per-position token frequencies (add-one smoothed), whose
embedding is close to the aux mean, the start on continuous inputs. Steps are in units of log K
for K candidate tokens: the logit change that takes a token from uniform (1/K) to near certainty.
A vocabulary larger than MAX_CANDIDATES is cut to its MAX_CANDIDATES most frequent aux tokens
(a softmax over 50257 tokens at every position of every sentence and step costs more than the
blocks); the attack cannot recover the others, and says how many candidates it used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitaudit.attacks.parts.text_metrics import position_counts
from splitaudit.inputs.data import Dataset
from splitaudit.inputs.tokens import TokenSpace

MAX_CANDIDATES = 1024
# Under --quick the optimisation inverts sentences holding at most this many token positions: its
# cost is steps x sentences x T (forward and backward through the blocks), while token accuracy is
# a mean over positions, whose standard error at 1024 independent positions is at most 1.6 points
# (positions of one sentence are not independent, so more in practice). At T = 128
# (GPT-2-sized bottom) that is 8 sentences, the difference between over 40 CPU minutes and the
# 15-minute quick audit; short sentences (the text sample's T = 8) keep quick_samples (64).
QUICK_TOKEN_POSITIONS = 1024


@dataclass(frozen=True)
class VocabularySimplex:
    """Candidate rows of the table [K, D] and the starting logits [T, K]."""

    rows: torch.Tensor
    start: torch.Tensor

    @property
    def candidates(self) -> int:
        return self.rows.shape[0]

    @property
    def step_unit(self) -> float:
        """log K: the logit change from a uniform choice to a near-certain one."""
        return math.log(max(2, self.candidates))

    def inputs(self, logits: torch.Tensor) -> torch.Tensor:
        """Embeddings [N, T, D] of logits [N, T, K]: each position a convex combination of rows."""
        return logits.softmax(dim=-1) @ self.rows


def quick_token_sentences(length: int) -> int:
    """The most sentences of `length` positions the optimisation inverts under --quick (at least one)."""
    return max(1, QUICK_TOKEN_POSITIONS // length)


def vocabulary_simplex(tokens: TokenSpace, aux: Dataset) -> VocabularySimplex:
    """The simplex over the whole vocabulary, or over its MAX_CANDIDATES most frequent aux tokens."""
    counts = position_counts(aux.token_ids, tokens.size, aux.mask).cpu()
    keep = torch.arange(tokens.size)
    if tokens.size > MAX_CANDIDATES:
        keep = counts.sum(dim=0).topk(MAX_CANDIDATES).indices.sort().values
    counts = counts[:, keep] + 1
    start = (counts / counts.sum(dim=1, keepdim=True)).log()
    return VocabularySimplex(rows=tokens.table[keep.to(tokens.table.device)], start=start.to(tokens.table.device))
