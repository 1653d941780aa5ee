"""Token metrics for attacks that reconstruct text, and their no-model baseline.

Reconstructions are compared with the true token ids position by position (token accuracy,
exact sentence match, per-position accuracy), as sequences (ROUGE-L F-measure from Google's
`rouge-score`, corpus BLEU-4 from NLTK with Chen & Cherry's method-1 smoothing, both on token
ids so that no tokenizer re-splits them), and on the rare tokens: those in fewer than 1% of the
aux sentences (names, numbers, the private content). The baseline guesses the most frequent aux
token at every position, without the model.

Padded positions (attention mask 0) count nowhere: not in the accuracies, not in the sequences
ROUGE-L and BLEU compare, not among the rare tokens, not in the baseline's most frequent token.
"""

from __future__ import annotations

import math

import torch
from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu
from rouge_score import rouge_scorer

from splitaudit.estimators.token_information import position_counts

RARE_SENTENCE_FRACTION = 0.01  # a token in fewer than 1% of the aux sentences is rare
TOKEN_METRICS = ("token_accuracy", "exact_match", "rouge_l", "bleu", "rare_token_recall")
EXAMPLE_SENTENCES = 5


class _IdTokenizer:
    """rouge-score's tokenizer interface over space-joined ids: no re-splitting, no stemming."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


def rare_tokens(aux_ids: torch.Tensor, vocab_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """A bool mask [V]: tokens present (at a real, unpadded position) in fewer than 1% of the aux
    sentences (never-seen included)."""
    valid = _all_real(aux_ids) if valid is None else valid.to(aux_ids.device)
    present = torch.zeros(len(aux_ids), vocab_size, dtype=torch.bool, device=aux_ids.device)
    rows = torch.arange(len(aux_ids), device=aux_ids.device)[:, None].expand_as(aux_ids)
    present[rows[valid], aux_ids[valid]] = True
    return present.float().mean(dim=0) < RARE_SENTENCE_FRACTION


def token_metrics(
    true_ids: torch.Tensor, pred_ids: torch.Tensor, rare: torch.Tensor, valid: torch.Tensor | None = None
) -> dict:
    """The five token metrics of predicted ids [N, T] against the true ones (rare: mask [V]; valid:
    the attention mask [N, T], False at padded positions, which no metric counts).
    rare_token_recall is NaN when no target token is rare."""
    true_ids, pred_ids = true_ids.cpu(), pred_ids.cpu()
    valid = _all_real(true_ids) if valid is None else valid.cpu()
    hits = (true_ids == pred_ids) & valid
    is_rare = rare.cpu()[true_ids] & valid
    true_rows, pred_rows = _real_tokens(true_ids, valid), _real_tokens(pred_ids, valid)
    return {
        "token_accuracy": float(hits.sum() / valid.sum()),
        "exact_match": float((hits | ~valid).all(dim=1).float().mean()),
        "rouge_l": _rouge_l(true_rows, pred_rows),
        "bleu": float(corpus_bleu([[t] for t in true_rows], pred_rows, smoothing_function=SmoothingFunction().method1)),
        "rare_token_recall": float(hits[is_rare].float().mean()) if is_rare.any() else math.nan,
    }


def _all_real(ids: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(ids, dtype=torch.bool)


def _real_tokens(ids: torch.Tensor, valid: torch.Tensor) -> list[list[int]]:
    """Each sentence's ids at its real (unpadded) positions."""
    return [row[keep].tolist() for row, keep in zip(ids, valid)]


def _rouge_l(true_rows: list[list[int]], pred_rows: list[list[int]]) -> float:
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_IdTokenizer())
    join = lambda row: " ".join(map(str, row))
    scores = [scorer.score(join(t), join(p))["rougeL"].fmeasure for t, p in zip(true_rows, pred_rows)]
    return sum(scores) / len(scores)


def position_accuracy(true_ids: torch.Tensor, pred_ids: torch.Tensor, valid: torch.Tensor | None = None) -> list:
    """Token accuracy at each position t over the sentences that have a real token there (where in
    the sentence the attack recovers text); NaN at a position padded in every sentence."""
    true_ids = true_ids.cpu()
    valid = _all_real(true_ids) if valid is None else valid.cpu()
    hits = ((true_ids == pred_ids.cpu()) & valid).sum(dim=0)
    counts = valid.sum(dim=0)
    return [float(h / c) if c else math.nan for h, c in zip(hits, counts)]


def most_frequent_guess(aux_ids: torch.Tensor, n: int, aux_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The baseline's prediction for n targets: the most frequent aux token at each position
    (among the aux sentences with a real token there; padding is never guessed from)."""
    return position_counts(aux_ids, int(aux_ids.max()) + 1, aux_valid).argmax(dim=1).expand(n, -1)


def token_outcome(ctx, target_ids: torch.Tensor, pred_ids: torch.Tensor, index=None) -> tuple[dict, dict, dict]:
    """(metrics, baseline, details) for predicted target ids (index: the target rows they are, all
    when None): the token metrics against the most-frequent-token baseline, per-position accuracy
    and a few sentences beside their originals, all over real (unpadded) positions only."""
    aux_ids, aux_valid = ctx.aux.token_ids, ctx.aux.mask
    target_valid = ctx.target.mask
    if target_valid is not None and index is not None:
        target_valid = target_valid[index]
    valid = _all_real(target_ids.cpu()) if target_valid is None else target_valid.cpu()
    rare = rare_tokens(aux_ids, ctx.tokens.size, aux_valid)
    guess = most_frequent_guess(aux_ids.cpu(), len(target_ids), None if aux_valid is None else aux_valid.cpu())
    true_rows, pred_rows = _real_tokens(target_ids.cpu(), valid), _real_tokens(pred_ids.cpu(), valid)
    details = {
        "position_accuracy": position_accuracy(target_ids, pred_ids, valid),
        "baseline_position_accuracy": position_accuracy(target_ids, guess, valid),
        "rare_tokens": int(rare.sum()),
        "sentences": [
            {"original": ctx.tokens.text(t), "reconstruction": ctx.tokens.text(p)}
            for t, p in zip(true_rows[:EXAMPLE_SENTENCES], pred_rows[:EXAMPLE_SENTENCES])
        ],
    }
    return token_metrics(target_ids, pred_ids, rare, valid), token_metrics(target_ids, guess, rare, valid), details


def with_token_metrics(ctx, outcome, x_hat: torch.Tensor, index: torch.Tensor | None = None):
    """A reconstruction attack's SeedOutcome with the token metrics of its reconstructed
    embeddings decoded to the nearest tokens (token inputs only; index: the target rows of x_hat)."""
    if ctx.space.kind != "tokens":
        return outcome
    ids = ctx.target.token_ids if index is None else ctx.target.token_ids[index]
    metrics, baseline, details = token_outcome(ctx, ids, ctx.tokens.nearest(x_hat), index)
    outcome.metrics.update(metrics)
    outcome.baseline.update(baseline)
    outcome.details["tokens"] = details
    return outcome
