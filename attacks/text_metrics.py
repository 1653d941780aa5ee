"""Token metrics for attacks that reconstruct text, and their no-model baseline.

Reconstructions are compared with the true token ids position by position (token accuracy,
exact sentence match, per-position accuracy), as sequences (ROUGE-L F-measure from Google's
`rouge-score`, corpus BLEU-4 from NLTK with Chen & Cherry's method-1 smoothing, both on token
ids so that no tokenizer re-splits them), and on the rare tokens: those in fewer than 1% of the
aux sentences (names, numbers, the private content). The baseline guesses the most frequent aux
token at every position, without the model.
"""

from __future__ import annotations

import math

import torch
from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu
from rouge_score import rouge_scorer

RARE_SENTENCE_FRACTION = 0.01  # a token in fewer than 1% of the aux sentences is rare
TOKEN_METRICS = ("token_accuracy", "exact_match", "rouge_l", "bleu", "rare_token_recall")
EXAMPLE_SENTENCES = 5


class _IdTokenizer:
    """rouge-score's tokenizer interface over space-joined ids: no re-splitting, no stemming."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


def rare_tokens(aux_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool mask [V]: tokens present in fewer than 1% of the aux sentences (never-seen included)."""
    present = torch.zeros(len(aux_ids), vocab_size, dtype=torch.bool, device=aux_ids.device)
    present.scatter_(1, aux_ids, True)
    return present.float().mean(dim=0) < RARE_SENTENCE_FRACTION


def token_metrics(true_ids: torch.Tensor, pred_ids: torch.Tensor, rare: torch.Tensor) -> dict:
    """The five token metrics of predicted ids [N, T] against the true ones (rare: mask [V]).
    rare_token_recall is NaN when no target token is rare."""
    true_ids, pred_ids = true_ids.cpu(), pred_ids.cpu()
    hits = true_ids == pred_ids
    is_rare = rare.cpu()[true_ids]
    true_rows, pred_rows = true_ids.tolist(), pred_ids.tolist()
    return {
        "token_accuracy": float(hits.float().mean()),
        "exact_match": float(hits.all(dim=1).float().mean()),
        "rouge_l": _rouge_l(true_rows, pred_rows),
        "bleu": float(corpus_bleu([[t] for t in true_rows], pred_rows, smoothing_function=SmoothingFunction().method1)),
        "rare_token_recall": float(hits[is_rare].float().mean()) if is_rare.any() else math.nan,
    }


def _rouge_l(true_rows: list[list[int]], pred_rows: list[list[int]]) -> float:
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_IdTokenizer())
    join = lambda row: " ".join(map(str, row))
    scores = [scorer.score(join(t), join(p))["rougeL"].fmeasure for t, p in zip(true_rows, pred_rows)]
    return sum(scores) / len(scores)


def position_accuracy(true_ids: torch.Tensor, pred_ids: torch.Tensor) -> list[float]:
    """Token accuracy at each position t (where in the sentence the attack recovers text)."""
    return (true_ids.cpu() == pred_ids.cpu()).float().mean(dim=0).tolist()


def most_frequent_guess(aux_ids: torch.Tensor, n: int) -> torch.Tensor:
    """The baseline's prediction for n targets: the most frequent aux token at each position."""
    return aux_ids.mode(dim=0).values.expand(n, -1)


def token_baseline(aux_ids: torch.Tensor, target_ids: torch.Tensor, rare: torch.Tensor) -> dict:
    """The token metrics of guessing the most frequent aux token per position (no model)."""
    return token_metrics(target_ids, most_frequent_guess(aux_ids.cpu(), len(target_ids)), rare)


def token_outcome(ctx, target_ids: torch.Tensor, pred_ids: torch.Tensor) -> tuple[dict, dict, dict]:
    """(metrics, baseline, details) for predicted target ids: the token metrics against the
    most-frequent-token baseline, per-position accuracy and a few sentences beside their originals."""
    aux_ids = ctx.aux.token_ids
    rare = rare_tokens(aux_ids, ctx.tokens.size)
    details = {
        "position_accuracy": position_accuracy(target_ids, pred_ids),
        "baseline_position_accuracy": position_accuracy(
            target_ids, most_frequent_guess(aux_ids.cpu(), len(target_ids))
        ),
        "rare_tokens": int(rare.sum()),
        "sentences": [
            {"original": ctx.tokens.text(t), "reconstruction": ctx.tokens.text(p)}
            for t, p in zip(target_ids[:EXAMPLE_SENTENCES].tolist(), pred_ids[:EXAMPLE_SENTENCES].tolist())
        ],
    }
    return token_metrics(target_ids, pred_ids, rare), token_baseline(aux_ids, target_ids, rare), details


def with_token_metrics(ctx, outcome, x_hat: torch.Tensor, index: torch.Tensor | None = None):
    """A reconstruction attack's SeedOutcome with the token metrics of its reconstructed
    embeddings decoded to the nearest tokens (token inputs only; index: the target rows of x_hat)."""
    if ctx.tokens is None:
        return outcome
    ids = ctx.target.token_ids if index is None else ctx.target.token_ids[index]
    metrics, baseline, details = token_outcome(ctx, ids, ctx.tokens.nearest(x_hat))
    outcome.metrics.update(metrics)
    outcome.baseline.update(baseline)
    outcome.details["tokens"] = details
    return outcome
