"""Token metrics against hand-computed values: accuracy, exact match, ROUGE-L (LCS), BLEU, rare recall."""

from __future__ import annotations

import math

import pytest
import torch

from splitaudit.attacks.parts.text_metrics import most_frequent_guess, position_accuracy, rare_tokens, token_metrics


def test_metrics_of_a_hand_made_case():
    true = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    pred = torch.tensor([[1, 2, 3, 4], [6, 5, 7, 9]])  # row 2: LCS 2 of 4 ("5 7" or "6 7")
    rare = torch.zeros(10, dtype=torch.bool)
    rare[[4, 8]] = True  # token 4 recovered, token 8 not
    m = token_metrics(true, pred, rare)
    assert m["token_accuracy"] == pytest.approx(5 / 8)
    assert m["exact_match"] == pytest.approx(1 / 2)
    assert m["rouge_l"] == pytest.approx((1.0 + 2 / 4) / 2)  # F1 of LCS/length, equal lengths
    assert m["rare_token_recall"] == pytest.approx(1 / 2)
    assert position_accuracy(true, pred) == [0.5, 0.5, 1.0, 0.5]


def test_bleu_is_one_for_a_perfect_copy_and_small_for_a_shuffle():
    true = torch.arange(40).reshape(4, 10)
    assert token_metrics(true, true, torch.zeros(40, dtype=torch.bool))["bleu"] == pytest.approx(1.0)
    shuffled = true.flip(1)  # every unigram right, no bigram: smoothed BLEU far below 1
    m = token_metrics(true, shuffled, torch.zeros(40, dtype=torch.bool))
    assert m["bleu"] < 0.2 and m["token_accuracy"] == 0.0
    assert math.isnan(m["rare_token_recall"])  # no rare token among the targets: undefined, not 0


def test_rare_tokens_are_those_in_under_one_percent_of_aux_sentences():
    aux = torch.zeros(200, 3, dtype=torch.long)
    aux[0, 0] = 1  # token 1 in 1 of 200 sentences (0.5%): rare
    aux[:2, 1] = 2  # token 2 in 2 of 200 (1%): not rare
    rare = rare_tokens(aux, 4)
    assert rare.tolist() == [False, True, False, True]  # token 3 never seen: rare
    assert most_frequent_guess(aux, 2).tolist() == [[0, 0, 0]] * 2
