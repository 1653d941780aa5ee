"""Hugging Face checkpoint folders as token bottoms (the splitaudit[hf] extra): tiny GPT-2, Llama and
BERT checkpoints built here from configs and saved with save_pretrained; the cut bottom equals the
checkpoint's hidden_states[N]; the sequential inversion recovers the causal ones exactly and is
refused on BERT; pickled weights are refused (exit 2) without being unpickled."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from test_cli import assert_one_line_error, run_cli
from test_tokens import token_context

from splitaudit.attacks import get_attack
from splitaudit.core.errors import InputError
from splitaudit.inputs.hf_checkpoints import open_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB, HIDDEN, LENGTH = 48, 16, 8


def tiny_checkpoint(kind: str, folder):
    """A 2-block checkpoint of `kind` with random weights (seed 0), saved as safetensors, with a
    word-level tokenizer over w0..w47 written beside it."""
    from splitaudit.inputs.optional_imports import import_transformers

    transformers = import_transformers()
    torch.manual_seed(0)
    small = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2}
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32)
    elif kind == "llama":
        config = transformers.LlamaConfig(**small, intermediate_size=32, max_position_embeddings=32)
    else:
        config = transformers.BertConfig(**small, intermediate_size=32, max_position_embeddings=32)
    model = transformers.AutoModel.from_config(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    word_tokenizer(transformers).save_pretrained(str(folder))
    return model


def word_tokenizer(transformers):
    """A whitespace word-level fast tokenizer over w0..w{VOCAB-1} (w0 doubles as padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folders = {}
    for kind in ("gpt2", "llama", "bert"):
        folder = tmp_path_factory.mktemp(kind)
        tiny_checkpoint(kind, folder)
        folders[kind] = folder
    return folders


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hfdata")
    rng = np.random.default_rng(0)
    x = rng.integers(2, VOCAB, (40, LENGTH))
    np.savez(folder / "tokens.npz", x=x, y=x[:, 0] % 2)
    return str(folder / "tokens.npz")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("split_layer", [1, 2])
def test_the_cut_bottom_is_the_checkpoints_hidden_state_after_block_n(checkpoints, kind, split_layer):
    from splitaudit.inputs.optional_imports import import_transformers

    full = import_transformers().AutoModel.from_pretrained(str(checkpoints[kind]), attn_implementation="eager").eval()
    raw = open_checkpoint(checkpoints[kind], torch.device("cpu"), split_layer)
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = full(ids, output_hidden_states=True).hidden_states[split_layer]
        got = raw.torch_module(raw.tokens.embed(ids))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert raw.tokens.vocab[:3] == ["w0", "w1", "w2"] and raw.tokens.tokenizer is not None
    assert raw.format == "huggingface" and f"--split-layer {split_layer}" in raw.notes[0]


@pytest.mark.parametrize("kind, causal", [("gpt2", True), ("llama", True), ("bert", False)])
def test_sequential_inversion_recovers_causal_checkpoints_and_refuses_bert(checkpoints, token_data, kind, causal):
    ctx = token_context(str(checkpoints[kind]), token_data, None, split_layer=2)
    assert ctx.encoder.format == "huggingface" and ctx.encoder.differentiable
    entry = get_attack("sequential-inversion").run(ctx)
    if causal:
        assert entry["status"] == "ok", entry.get("reason")
        assert entry["metrics"]["token_accuracy"] == 1.0 and entry["metrics"]["exact_match"] == 1.0
    else:
        assert entry["status"] == "skipped" and entry["reason"].startswith("the bottom is not causal: changing the")


def test_a_gpt2_checkpoint_is_audited_from_the_cli_with_dfil(checkpoints, token_data, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["run", str(checkpoints["gpt2"]), "--aux", token_data, "--split-layer", "1", "--quick", "--noise-sigma", "1"]
    code, _, err = run_cli([*args, "--attacks", "sequential-inversion", "--out", str(out), "--workers", "1"], capsys)
    assert code == 0, err
    result = json.loads((out / "report.json").read_text())
    assert result["model"]["format"] == "huggingface" and result["data"]["sample_shape"] == [LENGTH, HIDDEN]
    assert 0 < result["dfil"]["mean"] < math.inf and result["attacks"]["sequential-inversion"]["status"] == "ok"


class Exploding:
    def __reduce__(self):
        return (pytest.fail, ("a pickled checkpoint was unpickled",))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pkl"])
def test_a_pickled_checkpoint_is_refused_without_unpickling(checkpoints, tmp_path, name, token_data, capsys):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((checkpoints["gpt2"] / "config.json").read_text())
    (folder / name).write_bytes(pickle.dumps(Exploding()))
    with pytest.raises(
        InputError, match=rf"must hold its weights as \*\.safetensors \(it holds pickled weights \({name}"
    ):
        open_checkpoint(folder, torch.device("cpu"), 1)
    args = ["run", str(folder), "--aux", token_data, "--split-layer", "1", "--attacks", "none", "--quick"]
    code, _, err = run_cli([*args, "--out", str(tmp_path / "out")], capsys)
    assert_one_line_error(code, err, "pickled weights")


def test_a_split_layer_outside_the_checkpoint_or_missing_is_refused(checkpoints):
    for split_layer in (None, 0, 3):
        with pytest.raises(InputError, match=r"gpt2 checkpoint of 2 blocks: give --split-layer N, 1 <= N <= 2"):
            open_checkpoint(checkpoints["gpt2"], torch.device("cpu"), split_layer)


@pytest.fixture(scope="module")
def padded_token_data(tmp_path_factory):
    """Sentences of 5 to 8 real tokens, right-padded with w0, with their attention mask."""
    folder = tmp_path_factory.mktemp("hfpadded")
    rng = np.random.default_rng(2)
    x = rng.integers(2, VOCAB, (40, LENGTH))
    mask = np.arange(LENGTH)[None, :] < rng.integers(5, LENGTH + 1, (40, 1))
    np.savez(folder / "tokens.npz", x=np.where(mask, x, 0), y=x[:, 0] % 2, mask=mask)
    return str(folder / "tokens.npz")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_prefix_cache_gives_the_whole_sequence_search_its_exact_answers(
    checkpoints, padded_token_data, kind, monkeypatch
):
    """The cached search (one position per candidate after the prefix's keys and values) recovers
    padded sentences exactly at sigma 0 and, under noise, picks the very sentences the whole-sequence
    search picks (same seed, same beam): the two differ in cost only. Called twice: identical."""
    import splitaudit.attacks.sequential_inversion as sipit

    def entries(sigma):
        ctx = token_context(str(checkpoints[kind]), padded_token_data, None, split_layer=2, noise_sigma=sigma)
        return [get_attack("sequential-inversion").run(ctx) for _ in range(2)]

    exact, noisy = entries(0.0), entries(4.0)
    for entry in exact + noisy:
        assert entry["status"] == "ok" and entry["details"]["prefix_states"].startswith("cached")
    assert exact[0]["metrics"]["token_accuracy"] == 1.0 and exact[0]["metrics"]["exact_match"] == 1.0
    assert noisy[0]["metrics"] == noisy[1]["metrics"] and noisy[0]["metrics"]["token_accuracy"] < 1.0
    monkeypatch.setattr(sipit, "prefix_cached_bottom", lambda ctx: None)
    whole = entries(4.0)[0]
    assert whole["details"]["prefix_states"].startswith("recomputed")
    assert whole["metrics"] == noisy[0]["metrics"]


def test_a_prefix_cache_that_does_not_reproduce_the_bottom_stops_the_attack(checkpoints, token_data, monkeypatch):
    """States from the cache 1e-3 off the whole-sequence ones (a cache bug) are an error, not a silently
    wrong inversion."""
    from splitaudit.inputs.hf_checkpoints import CheckpointBottom

    extend = CheckpointBottom.extend
    monkeypatch.setattr(CheckpointBottom, "extend", lambda self, *args: extend(self, *args) + 1e-3)
    ctx = token_context(str(checkpoints["gpt2"]), token_data, None, split_layer=2)
    entry = get_attack("sequential-inversion").run(ctx)
    assert entry["status"] == "failed"
    assert "cached prefix states at position 1 differ from running the whole sequence" in entry["reason"]


def test_at_sigma_zero_the_search_stops_at_the_chunk_holding_each_exact_match(checkpoints, token_data, monkeypatch):
    """Candidates scored most frequent first, a few per call: the search stops once every sentence's
    token is found, scoring fewer than the whole vocabulary at each position, and still recovers every
    sentence exactly (the final residual check would fail otherwise)."""
    import splitaudit.attacks.sequential_inversion as sipit

    monkeypatch.setattr(sipit, "CANDIDATE_VALUES", 2**13)  # a handful of candidates per call
    ctx = token_context(str(checkpoints["gpt2"]), token_data, None, split_layer=2)
    entry = get_attack("sequential-inversion").run(ctx)
    details = entry["details"]
    assert entry["status"] == "ok" and entry["metrics"]["exact_match"] == 1.0
    assert details["forward_passes"] < details["sentences_inverted"] * LENGTH * VOCAB


def test_the_cost_estimate_times_a_call_as_full_as_the_cached_search_makes(checkpoints, token_data, monkeypatch):
    """A GPU's time per candidate falls many times over until its calls are full (on an H200 a call of 32
    candidates made the estimate 50 times the run): the timed call holds as many candidates as one call
    of the search, and the estimate is (positions x candidates) pairs at that call's time per pair."""
    import splitaudit.attacks.sequential_inversion as sipit

    monkeypatch.setattr(sipit, "CANDIDATE_VALUES", 2**12)  # fewer candidates per call than the vocabulary
    ctx = token_context(str(checkpoints["gpt2"]), token_data, None, split_layer=2)
    bottom = sipit.prefix_cached_bottom(ctx)
    cache = bottom.prefix_cache(ctx.tokens.embed(ctx.target.token_ids[:1, : LENGTH // 2]), None)
    per_call = bottom.candidates_per_call(cache, sipit.CANDIDATE_VALUES)
    timed_calls = []

    def one_second(step) -> float:
        timed_calls.append(step().shape[1])  # extend's states [rows, candidates, hidden]
        return 1.0

    seconds = get_attack("sequential-inversion").estimated_seconds(ctx, 0.0, one_second)
    assert 1 < per_call < VOCAB and timed_calls == [per_call]
    sentences = min(sipit.SequentialInversionOptions().quick_max_sentences, len(ctx.target))
    assert seconds == pytest.approx(len(ctx.seeds) * sentences * LENGTH * VOCAB / per_call)
