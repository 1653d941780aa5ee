"""The sequential exact inversion (SIPIT, Nikolaou et al., ICLR 2026) on token bottoms: refused on
bidirectional bottoms with the first position that broke causality, exact at sigma 0 on causal ones
(a tiny one written here, padded sentences, the bundled text sample), weaker as the noise grows,
and exactly as many forward passes as vocabulary x positions x beam."""

from __future__ import annotations

import dataclasses
import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import sample
from test_tokens import token_context

from splitaudit.attacks import get_attack, sequential_inversion
from splitaudit.attacks.sequential_inversion import causality_violation
from splitaudit.stages.cost import StepTimer
from tests.support.token_models import LENGTH, VOCAB, TokenBottom, save_token_data, save_token_model

NAME = "sequential-inversion"


class CausalBottom(TokenBottom):
    """TokenBottom whose attention sees the current and earlier positions only (GPT-style)."""

    def from_embeddings(self, e: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(e.shape[1])
        return self.blocks(e + self.pos[: e.shape[1]], mask=causal, is_causal=True)


class CausalMaskedBottom(TokenBottom):
    """CausalBottom over (ids, attention_mask): padded keys are skipped as well."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(LENGTH)
        return self.blocks(self.tok(ids) + self.pos, mask=causal, src_key_padding_mask=mask == 0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sequential")
    save_token_data(folder, n=40)
    return folder


def context(model: nn.Module, folder, sigma: float = 0.0, **options):
    path = save_token_model(model, "torchscript", folder)
    ctx = token_context(str(path), str(folder / "tokens.npz"), str(folder / "vocab.json"), noise_sigma=sigma)
    return dataclasses.replace(ctx, attack_options={NAME: options})


def test_a_causal_bottom_is_inverted_exactly_at_sigma_zero(folder):
    ctx = context(CausalBottom().eval(), folder)
    entry = get_attack(NAME).run(ctx)
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["metrics"]["token_accuracy"] == 1.0 and entry["metrics"]["exact_match"] == 1.0
    assert entry["metrics"]["rouge_l"] == 1.0 and entry["baseline"]["token_accuracy"] < 0.2
    details = entry["details"]
    inverted = details["sentences_inverted"]
    assert inverted == min(16, len(ctx.target))  # quick_max_sentences under --quick
    # one hypothesis at sigma 0; each sentence stops at the chunk (16, then 32 more candidates...) holding its
    # token, so a position scores at least 16 and at most all of the vocabulary
    assert inverted * LENGTH * 16 <= details["forward_passes"] < inverted * LENGTH * VOCAB and details["beam"] == 1
    assert details["largest_squared_distance"] < 1e-8
    assert entry["outcome"] == "leakage" and entry["baseline_role"] == "floor"


def test_a_bidirectional_bottom_is_refused_naming_the_first_position_that_moved_an_earlier_state(folder):
    ctx = context(TokenBottom().eval(), folder)
    entry = get_attack(NAME).run(ctx)
    assert entry["status"] == "skipped"
    assert entry["reason"].startswith("the bottom is not causal: changing the token at position 2 moved the hidden ")
    assert "state at position 1" in entry["reason"]
    assert causality_violation(context(CausalBottom().eval(), folder)) is None


def test_accuracy_falls_with_the_noise_and_the_beam_spends_its_width(folder):
    """The hidden states are layer-normed (about unit scale in 8 coordinates per position): at sigma
    0.5 most tokens are still found, at 3 few; the beam keeps 4 prefixes after the first position."""
    accuracy = {}
    for sigma in (0.0, 0.5, 3.0):
        entry = get_attack(NAME).run(context(CausalBottom().eval(), folder, sigma, quick_max_sentences=8))
        accuracy[sigma] = entry["metrics"]["token_accuracy"]
        if sigma:
            details = entry["details"]
            assert details["beam"] == 4 and details["forward_passes"] == 8 * VOCAB * (1 + 4 * (LENGTH - 1))
    assert accuracy[0.0] == 1.0 > accuracy[0.5] > accuracy[3.0], accuracy
    assert accuracy[0.5] > 0.5, accuracy


def test_padded_sentences_are_recovered_at_their_real_positions(tmp_path):
    """Right-padded data through a bottom that takes (ids, attention_mask): every real token back,
    padded positions neither searched nor counted."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, LENGTH + 1, 30)
    mask = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1, VOCAB, (30, LENGTH)) * mask
    np.savez(tmp_path / "tokens.npz", x=ids, y=ids[:, 0] % 2, mask=mask)
    (tmp_path / "vocab.json").write_text(json.dumps([f"w{i}" for i in range(VOCAB)]))
    model = CausalMaskedBottom().eval()
    path = tmp_path / "masked.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example = torch.from_numpy(ids[:3]), torch.from_numpy(mask[:3])
        torch.jit.trace(model, example, check_trace=False).save(str(path))
    ctx = token_context(str(path), str(tmp_path / "tokens.npz"), str(tmp_path / "vocab.json"))
    entry = get_attack(NAME).run(ctx)
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["metrics"]["token_accuracy"] == 1.0 and entry["metrics"]["exact_match"] == 1.0
    real = int(ctx.target.mask[: entry["details"]["sentences_inverted"]].sum())
    # at sigma 0 a position stops at the first chunk holding every sentence's token: 16 or all 40 candidates
    assert real * 16 <= entry["details"]["forward_passes"] <= real * VOCAB


def test_the_cost_estimate_counts_vocabulary_times_positions_per_sentence(folder):
    ctx = context(CausalBottom().eval(), folder, max_sentences=4, quick_max_sentences=4)
    attack = get_attack(NAME)
    timed_calls = []

    def one_second(step) -> float:  # each timed call: 1 s, for as many candidates as one call of the search
        timed_calls.append(len(step()))
        return 1.0

    one = attack.estimated_seconds(ctx, 0.0, one_second)
    per_call = min(VOCAB, sequential_inversion.whole_sequences_per_call(ctx, 1, LENGTH, ctx.device))
    assert timed_calls == [per_call] and per_call > 1
    assert one == pytest.approx(len(ctx.seeds) * 4 * LENGTH * VOCAB / per_call)
    twice = dataclasses.replace(ctx, attack_options={NAME: {"quick_max_sentences": 8}})
    assert attack.estimated_seconds(twice, 0.0, lambda step: 1.0) == pytest.approx(2 * one)
    assert attack.estimated_seconds(ctx, 0.0, StepTimer(cpu_bound=True)) > 0


def test_the_bundled_text_sample_is_recovered_exactly_at_sigma_zero_and_the_aux_prior_helps_under_noise():
    """The shipped ONNX text bottom is causal (GPT-style attention): every token of the inverted
    target sentences back at sigma 0. At sigma 4 the maximum-likelihood choice alone finds about 0.57
    of the tokens and the aux bigram prior (maximum a posteriori) about 0.93 (32 sentences; 8 here)."""
    ctx = token_context(sample("text_bottom.onnx"), sample("text.npz"), sample("text_vocab.json"))
    entry = get_attack(NAME).run(dataclasses.replace(ctx, attack_options={NAME: {"quick_max_sentences": 8}}))
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["metrics"]["token_accuracy"] == 1.0 and entry["metrics"]["exact_match"] == 1.0
    assert entry["details"]["sentences_inverted"] == 8
    noisy = {
        prior: get_attack(NAME).run(
            dataclasses.replace(ctx.at_sigma(4.0), attack_options={NAME: {"quick_max_sentences": 8, "prior": prior}})
        )["metrics"]["token_accuracy"]
        for prior in ("aux", "none")
    }
    assert noisy["aux"] > noisy["none"] + 0.15 and noisy["aux"] > 0.8, noisy


def test_the_aux_prior_keeps_its_mass_on_the_text_aux_showed_over_a_large_vocabulary():
    """With 50,257 entries and 200 aux sentences of a 300-token language, add-one smoothing gave over 99%
    of the prior's mass to tokens aux never showed (a flat prior: under heavy noise the search followed
    the noise). Witten-Bell backs off by how often a new token appeared: the tokens aux showed keep most
    of the mass, the prior is a distribution, and a token that always follows another there leads."""
    size, language, length = 50257, 300, 16
    ids = torch.randint(0, language, (200, length), generator=torch.Generator().manual_seed(0))
    ids[:, 5], ids[:, 6] = 7, 11  # 11 always follows 7 at position 6
    ctx = SimpleNamespace(aux=SimpleNamespace(token_ids=ids, mask=None), tokens=SimpleNamespace(size=size))
    hyps = torch.zeros(1, 2, length, dtype=torch.long)
    hyps[0, :, 5] = torch.tensor([7, 3])  # a hypothesis after 7, one after a token aux never shows there
    prior = sequential_inversion.aux_log_prior(ctx, hyps, 6, torch.arange(size)).exp()[0]  # [2, size]
    assert torch.allclose(prior.sum(dim=-1), torch.ones(2), atol=1e-4)
    assert bool((prior[:, :language].sum(dim=-1) > 0.9).all())
    assert int(prior[0].argmax()) == 11 and float(prior[0, 11]) > 0.5
