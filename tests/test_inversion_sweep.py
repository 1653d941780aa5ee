"""A sweep over sigma on a token bottom compares the sequential inversion (Nikolaou et al., ICLR 2026)
with the learned inversion at each sigma and says where the sequential one is weaker and why: the
margin against its closed form, the reasons by what the search ran with, and a real sweep on a tiny
causal checkpoint (a 2-block GPT-2 saved with save_pretrained) where the search is exact at sigma 0
and, with no aux prior, loses to the learned attack at sigma 100."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from splitaudit.core.config import AuditOptions
from splitaudit.core.result import first_error, sweep_json_schema
from splitaudit.engine.sweep import run_sweep
from splitaudit.reports.files import to_strict_json
from splitaudit.reports.sweep import build_sweep_view, sweep_summary, write_sweep_reports
from splitaudit.stages.inversion_comparison import compare_inversions


def entry(accuracy: float, spread: float = 0.0, seeds: int = 1, **details) -> dict:
    return {
        "status": "ok",
        "metrics": {"token_accuracy": accuracy},
        "metrics_std": {"token_accuracy": spread},
        "seeds": list(range(seeds)),
        "details": details,
    }


SEARCH = {"sentences_inverted": 64, "target_sentences": 300, "candidates": 68, "vocab_size": 68, "beam": 4}


def test_the_margin_is_1_96_standard_errors_of_the_difference():
    """sqrt(p(1-p)/n + s^2/k) for each attack (n: sentences it scored, s: its spread over k seeds);
    exact to 1e-12."""
    attacks = {
        "sequential-inversion": entry(0.75, 0.02, 2, **SEARCH, prior="aux"),
        "token-inversion": entry(0.9, 0.01, 2),
    }
    got = compare_inversions(attacks, 1.0)
    expected = 1.96 * math.sqrt(0.75 * 0.25 / 64 + 0.02**2 / 2 + 0.9 * 0.1 / 300 + 0.01**2 / 2)  # 0.1156 < 0.15
    assert got["margin"] == pytest.approx(expected, rel=1e-12, abs=0)
    assert (got["sequential_sentences"], got["learned_sentences"]) == (64, 300)
    assert got["weaker"] and len(got["reasons"]) == 1 and "aux bigram prior" in got["reasons"][0]


@pytest.mark.parametrize(
    ("sequential", "learned", "weaker"),
    [(1.0, 0.98, False), (0.9, 0.95, False), (0.5, 0.95, True)],  # margin here: 1.96 sqrt(.09/64 + ...) ~ 0.08
)
def test_weaker_only_beyond_the_margin(sequential, learned, weaker):
    attacks = {"sequential-inversion": entry(sequential, **SEARCH, prior="aux"), "token-inversion": entry(learned)}
    got = compare_inversions(attacks, 0.5)
    assert got["weaker"] is weaker and bool(got["reasons"]) is weaker


def test_the_reasons_name_what_the_search_ran_with():
    narrow = {**SEARCH, "candidates": 10, "prior": "none"}
    attacks = {"sequential-inversion": entry(0.2, **narrow), "token-inversion": entry(0.9)}
    noisy, clean = compare_inversions(attacks, 2.0)["reasons"], compare_inversions(attacks, 0.0)["reasons"]
    assert "10 most frequent aux tokens of 68" in noisy[0] and "prior=none" in noisy[1]
    assert len(clean) == 1 and "10 most frequent" in clean[0]  # at sigma 0 noise is no reason
    full = compare_inversions({**attacks, "sequential-inversion": entry(0.2, **SEARCH)}, 0.0)["reasons"]
    assert full == [full[0]] and "first 64 of 300 target sentences" in full[0]


def test_no_comparison_where_either_attack_did_not_run():
    skipped = {"status": "skipped", "reason": "bidirectional"}
    assert compare_inversions({"sequential-inversion": skipped, "token-inversion": entry(0.9)}, 0.0) is None
    assert compare_inversions({"token-inversion": entry(0.9)}, 0.0) is None


@pytest.fixture(scope="module")
def token_sweep(tmp_path_factory):
    """sweep over sigma 0 and 100 on a tiny GPT-2 cut after block 1, 120 random 8-word texts, both
    inversions, the sequential one without its aux prior."""
    from test_hf_checkpoints import tiny_checkpoint

    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gpt2")
    tiny_checkpoint("gpt2", folder)
    rng = np.random.default_rng(0)
    text = folder.parent / "corpus.txt"
    text.write_text("".join(" ".join(f"w{i}" for i in rng.integers(2, 48, 8)) + "\n" for _ in range(120)))
    options = AuditOptions(
        model=str(folder),
        split_layer=1,
        aux=str(text),
        attacks=["token-inversion", "sequential-inversion"],
        attack_options={"sequential-inversion": {"prior": "none"}},
        noise_sigmas=[0.0, 100.0],
        quick=True,
        prior="gaussian",
        device="cpu",
        workers=1,
        out=str(tmp_path_factory.mktemp("out")),
        formats=["json"],
    )
    return run_sweep(options.validate())


def test_a_token_sweep_says_where_the_sequential_inversion_is_weaker_and_why(token_sweep, tmp_path):
    clean, noisy = (p["inversions"] for p in token_sweep["points"])
    assert clean["sequential"] == 1.0 and not clean["weaker"] and clean["reasons"] == []
    # at sigma 100 the states are noise: the learned attack falls back on the aux distribution (its
    # most frequent tokens), the search without a prior guesses blindly
    assert noisy["weaker"] and noisy["learned"] - noisy["sequential"] > noisy["margin"] > 0
    assert "prior=none" in noisy["reasons"][0]
    assert first_error(to_strict_json(token_sweep), sweep_json_schema()) is None
    view = build_sweep_view(token_sweep, with_figures=False)
    (item,) = [item for item in view.summary if item.label == "Text inversions"]
    assert item.tone == "warn" and "recovers fewer tokens than the learned inversion at σ = 100: " in item.text
    assert "σ = 0: " not in item.text and "prior=none" in item.text
    assert "Text inversions: The sequential inversion" in sweep_summary(token_sweep)  # the terminal's
    notes = [p.notes[-1] for p in view.points]
    assert notes[0].endswith("at least as strong.") and "weaker here, because" in notes[1]
    written = write_sweep_reports(json.loads(json.dumps(to_strict_json(token_sweep))), tmp_path, ["md", "html"])
    assert all("Text inversions" in path.read_text(encoding="utf-8") for path in written)
