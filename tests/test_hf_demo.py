"""`splitaudit demo --text`: the bundled Hugging Face checkpoint folder (text_gpt2/, a 3-block GPT-2
cut after block 2) on raw text (text.jsonl) with the hf extra; without it, one line saying how to
enable it and the ONNX sample over the same messages as token ids. The checkpoint's messages are the
ONNX sample's, the sequential inversion reads them back exactly at sigma 0, the package ships the
folder, and its build script gives back the shipped files."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from fnmatch import fnmatch
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLES, sample
from test_cli import run_cli

import splitaudit.cli
from splitaudit.attacks import get_attack
from splitaudit.core.config import AuditOptions
from splitaudit.engine.demo_samples import demo_inputs
from splitaudit.engine.pipeline import prepare_context

FOLDER = SAMPLES / "text_gpt2"
INTENTS = ["send", "owes", "book", "ask"]  # text_sample.TEMPLATES' intents, in order


@pytest.fixture
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")


@pytest.fixture
def handed_over(monkeypatch):
    """The options `demo` hands to the audit, which does not run."""
    seen = []
    monkeypatch.setattr(splitaudit.cli, "_audit_and_report", lambda options, _invocation: seen.append(options))
    return seen


def corpus_lines() -> list[dict]:
    return [json.loads(line) for line in (SAMPLES / "text.jsonl").read_text(encoding="utf-8").splitlines()]


def test_the_checkpoints_texts_are_the_onnx_samples_messages():
    """Word by word through the checkpoint's tokenizer: the token ids, intents and regions of
    text.jsonl are text.npz's x, y and attr, row for row."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    lines = corpus_lines()
    with np.load(sample("text.npz")) as npz:
        x, y, attr = npz["x"], npz["y"], npz["attr"]
    assert [tokenizer.encode(line["text"]).ids for line in lines] == x.tolist()
    assert [INTENTS.index(line["intent"]) for line in lines] == y.tolist()
    assert [line["region"] == "north" for line in lines] == attr.astype(bool).tolist()


def test_sequential_inversion_reads_the_demo_text_back_exactly_at_sigma_zero(hf):
    """The demo's bottom (checked at load against the checkpoint's hidden_states[2]) is causal: every
    token of 8 target sentences back, every sentence exact."""
    inputs, fallback = demo_inputs(text=True)
    ctx = prepare_context(AuditOptions(**inputs, quick=True, seed=0).validate())
    name = "sequential-inversion"
    entry = get_attack(name).run(dataclasses.replace(ctx, attack_options={name: {"quick_max_sentences": 8}}))
    assert fallback is None and entry["status"] == "ok", entry.get("reason")
    assert entry["metrics"]["token_accuracy"] == 1.0 and entry["metrics"]["exact_match"] == 1.0
    assert entry["details"]["sentences_inverted"] == 8


def test_demo_text_hands_the_checkpoint_folder_and_the_raw_text_to_the_audit(hf, handed_over, capsys):
    code, _, err = run_cli(["demo", "--text", "--quick"], capsys)
    (options,) = handed_over
    assert code == 0 and err == ""
    shipped = Path(str(files("splitaudit.sample_models")))  # the installed package's, which the demo reads
    assert Path(options.model) == shipped / "text_gpt2" and Path(options.aux) == shipped / "text.jsonl"
    assert (options.split_layer, options.label_column, options.attr_column, options.vocab) == (
        2,
        "intent",
        "region",
        None,
    )


def test_without_the_hf_extra_the_text_demo_says_how_to_get_it_and_audits_the_onnx_sample(
    monkeypatch, handed_over, capsys
):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: find_spec finds nothing
    code, _, err = run_cli(["demo", "--text", "--quick"], capsys)
    (options,) = handed_over
    assert code == 0 and len(err.strip().splitlines()) == 1
    assert err.startswith("splitaudit: ") and 'pip install "splitaudit[hf]"' in err
    assert Path(options.model).name == "text_bottom.onnx" and Path(options.vocab).name == "text_vocab.json"
    assert options.split_layer is None


def test_the_package_ships_the_checkpoint_folder_and_the_text():
    """Every file of text_gpt2/ and text.jsonl matches the package data globs of pyproject.toml."""
    pyproject = (SAMPLES.parent / "pyproject.toml").read_text(encoding="utf-8")  # tomllib: Python 3.11 on
    globs = json.loads(re.search(r'^"splitaudit\.sample_models" = (\[.*\])$', pyproject, re.M).group(1))
    shipped = ["text.jsonl", *(f"text_gpt2/{p.name}" for p in FOLDER.iterdir())]
    assert len(shipped) == 5
    assert all(any(fnmatch(name, glob) for glob in globs) for name in shipped), shipped


@pytest.mark.slow
def test_demo_text_audits_the_checkpoint_on_raw_text(hf, capsys):
    """`splitaudit demo --text --quick`: every attack ok but SDAR (not adapted to tokens); the text
    declared as read (jsonl, 8 tokens, nothing truncated or padded); sequential inversion exact."""
    code, out, err = run_cli(["demo", "--text", "--quick", "--out", "text-demo", "--workers", "1"], capsys)
    result = json.loads(open("text-demo/report.json").read())
    assert code == 0, err
    assert result["model"]["format"] == "huggingface" and result["data"]["sample_shape"] == [8, 32]
    text = result["data"]["text"]["aux"]
    assert (text["format"], text["length"], text["truncated"], text["padded"]) == ("jsonl", 8, 0, 0)
    statuses = {name: entry["status"] for name, entry in result["attacks"].items()}
    assert statuses == {**dict.fromkeys(statuses, "ok"), "sdar": "skipped"}, statuses
    sequential = result["attacks"]["sequential-inversion"]["metrics"]
    assert sequential["token_accuracy"] == 1.0 and sequential["exact_match"] == 1.0
    assert "In tokens" in out


@pytest.mark.slow
def test_the_build_script_gives_back_the_shipped_checkpoint(hf, tmp_path):
    """sample_models/text_checkpoint.py (seed 0) writes the shipped text and the same weights."""
    from safetensors.numpy import load_file

    sys.path.insert(0, str(SAMPLES))
    try:
        from text_checkpoint import build_text_checkpoint
    finally:
        sys.path.remove(str(SAMPLES))
    build_text_checkpoint(tmp_path)
    assert (tmp_path / "text.jsonl").read_bytes() == (SAMPLES / "text.jsonl").read_bytes()
    assert (tmp_path / "text_gpt2" / "tokenizer.json").read_bytes() == (FOLDER / "tokenizer.json").read_bytes()
    built, shipped = load_file(tmp_path / "text_gpt2" / "model.safetensors"), load_file(FOLDER / "model.safetensors")
    assert built.keys() == shipped.keys()
    for name in shipped:  # bit for bit on one machine; across CPU kinds kernels may differ in the last bits
        np.testing.assert_allclose(effective(name, built), effective(name, shipped), rtol=0, atol=1e-5, err_msg=name)


def effective(name: str, weights: dict) -> np.ndarray:
    """A tensor as it acts on the outputs: an attention's key bias adds the same amount to every score
    of a query, which softmax ignores, so its gradient is rounding noise that Adam amplifies differently
    on each CPU kind (seen: 1e-4 apart on an AMD EPYC) and it is left out of the comparison."""
    tensor = weights[name]
    if not name.endswith("attn.c_attn.bias"):
        return tensor
    width = len(tensor) // 3  # query, key, value
    return np.concatenate([tensor[:width], tensor[2 * width :]])
