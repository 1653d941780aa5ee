"""Raw text as token data (--aux corpus.txt / corpus.jsonl): a tiny GPT-2 checkpoint built here, its
texts tokenised with the checkpoint's tokenizer (or --vocab's tokenizer.json), truncated and padded
as declared in report.json, audited end to end from the CLI; hostile text files exit 2 with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import SAMPLES
from test_cli import assert_one_line_error, run_cli

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_hf_checkpoints import tiny_checkpoint  # noqa: E402 (after the skips: it needs transformers)

from splitaudit.core.errors import InputError  # noqa: E402
from splitaudit.core.result import first_error  # noqa: E402
from splitaudit.inputs.hf_checkpoints import open_checkpoint  # noqa: E402
from splitaudit.inputs.text_data import load_text_data  # noqa: E402

MAX_LENGTH = 8
WORDS = [f"w{i}" for i in range(20, 48)]  # one token each (w0/w1 are added tokens, and would split 'w17')


def sentences(count: int, seed: int) -> list[str]:
    """`count` texts of 3 to 11 words (one token each), so that some exceed MAX_LENGTH."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    tiny_checkpoint("gpt2", folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A .txt of 24 texts with an empty and a blank line among them, and the texts."""
    texts = sentences(24, 0)
    lines = [*texts[:5], "", *texts[5:9], "   ", *texts[9:]]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, texts


def by_hand(folder, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [N, length]: the checkpoint's tokenizer truncating, then right-padding with its pad id."""
    from splitaudit.inputs.optional_imports import import_transformers

    tokenizer = import_transformers().AutoTokenizer.from_pretrained(str(folder))
    rows = tokenizer(texts, truncation=True, max_length=length)["input_ids"]
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), True
    return ids, mask


def test_a_text_file_is_tokenised_as_by_hand_and_its_truncation_declared(gpt2, corpus):
    path, texts = corpus
    raw = open_checkpoint(gpt2, torch.device("cpu"), 1)
    expected_ids, expected_mask = by_hand(gpt2, texts, MAX_LENGTH)
    for _ in range(2):  # a second load gives the same data (the tokenizer's truncation is reset each call)
        data = load_text_data(path, raw.tokens, max_length=MAX_LENGTH)
        assert torch.equal(data.token_ids, expected_ids) and torch.equal(data.mask, expected_mask)
        torch.testing.assert_close(data.x, raw.tokens.embed(expected_ids), rtol=0, atol=0)
    words = [len(t.split()) for t in texts]
    assert data.text == {
        "format": "txt",
        "tokenizer": type(raw.tokens.tokenizer).__name__,
        "tokenizer_source": "checkpoint",
        "lines": 26,
        "texts": 24,
        "empty_lines_skipped": 2,
        "max_length": MAX_LENGTH,
        "limit": MAX_LENGTH,
        "limit_source": "max-length",
        "length": MAX_LENGTH,
        "longest": max(words),
        "truncated": sum(n > MAX_LENGTH for n in words),
        "padded": sum(n < MAX_LENGTH for n in words),
        "pad_id": 0,
    }
    assert 0 < data.text["truncated"] < 24 and data.text["padded"] > 0


def test_short_texts_pad_to_the_longest_and_a_target_to_the_aux_length(gpt2, tmp_path):
    raw = open_checkpoint(gpt2, torch.device("cpu"), 1)
    short = tmp_path / "short.txt"
    short.write_text("w20 w21 w22\nw23 w24\nw25 w26 w27 w28\nw29 w30 w31\n", encoding="utf-8")
    data = load_text_data(short, raw.tokens, max_length=MAX_LENGTH)
    assert data.token_ids.shape == (4, 4) and data.text["length"] == 4 and data.text["truncated"] == 0
    assert data.mask.sum(dim=1).tolist() == [3, 2, 4, 3]
    target = load_text_data(short, raw.tokens, max_length=MAX_LENGTH, length=3)
    assert target.token_ids.shape == (4, 3) and target.text["truncated"] == 1 and target.text["padded"] == 1
    assert target.text["limit_source"] == "aux-length"


def test_texts_longer_than_the_context_window_are_truncated_to_it(gpt2, tmp_path, capsys):
    """The tiny GPT-2 takes 32 positions: 40-token texts at the default --max-length 128 keep 32."""
    long = tmp_path / "long.txt"
    long.write_text("\n".join(" ".join([sentence] * 4) for sentence in sentences(12, 3)) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = ["run", str(gpt2), "--split-layer", "1", "--aux", str(long), "--attacks", "none", "--quick"]
    code, _, err = run_cli([*args, "--out", str(out)], capsys)
    assert code == 0, err
    text = json.loads((out / "report.json").read_text())["data"]["text"]["aux"]
    assert (text["max_length"], text["limit"], text["limit_source"], text["length"]) == (128, 32, "context-window", 32)
    assert text["truncated"] == sum(4 * len(s.split()) > 32 for s in sentences(12, 3)) > 0


def test_vocab_tokenizer_json_gives_the_checkpoints_ids(gpt2, corpus):
    path, texts = corpus
    raw = open_checkpoint(gpt2, torch.device("cpu"), 1, vocab_path=gpt2 / "tokenizer.json")
    assert raw.tokens.tokenizer is None
    data = load_text_data(path, raw.tokens, vocab_path=gpt2 / "tokenizer.json", max_length=MAX_LENGTH)
    assert torch.equal(data.token_ids, by_hand(gpt2, texts, MAX_LENGTH)[0])
    assert data.text["tokenizer"] == "tokenizers.Tokenizer" and data.text["tokenizer_source"] == "vocab"


def test_a_txt_corpus_is_audited_from_the_cli_and_recovered_exactly(gpt2, corpus, tmp_path, capsys):
    path, texts = corpus
    out = tmp_path / "out"
    args = ["run", str(gpt2), "--split-layer", "1", "--aux", str(path), "--max-length", str(MAX_LENGTH)]
    attacks = ["--attacks", "sequential-inversion,token-inversion", "--quick", "--workers", "1"]
    code, _, err = run_cli([*args, *attacks, "--out", str(out)], capsys)
    assert code == 0, err
    result = json.loads((out / "report.json").read_text())
    assert first_error(result) is None  # data.text is in report.json's schema
    assert result["data"]["text"]["aux"]["truncated"] == sum(len(t.split()) > MAX_LENGTH for t in texts)
    assert result["data"]["n_aux"] + result["data"]["n_target"] == 24
    assert result["data"]["sample_shape"] == [MAX_LENGTH, 16]
    sequential = result["attacks"]["sequential-inversion"]
    assert sequential["status"] == "ok" and sequential["metrics"]["token_accuracy"] == 1.0
    assert result["attacks"]["token-inversion"]["status"] == "ok"
    assert any("24 texts (2 empty lines skipped)" in note for note in result["model"]["warnings"])


def test_a_jsonl_corpus_with_labels_and_a_target_is_audited_from_the_cli(gpt2, tmp_path, capsys):
    def jsonl(name, texts, seed):
        rows = [{"text": t, "topic": ["news", "chat"][i % 2], "minor": bool(i % 3)} for i, t in enumerate(texts)]
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
        return str(tmp_path / name)

    aux, target = jsonl("aux.jsonl", sentences(12, 1), 1), jsonl("target.jsonl", sentences(8, 2), 2)
    out = tmp_path / "out"
    args = ["run", str(gpt2), "--split-layer", "1", "--aux", aux, "--target", target, "--max-length", "6"]
    labels = ["--label-column", "topic", "--attr-column", "minor", "--quick", "--workers", "1"]
    attacks = ["--attacks", "sequential-inversion,token-inversion,attribute"]
    code, _, err = run_cli([*args, *labels, *attacks, "--out", str(out)], capsys)
    assert code == 0, err
    result = json.loads((out / "report.json").read_text())
    assert first_error(result) is None  # data.text is in report.json's schema
    data = result["data"]
    assert data["class_names"] == ["chat", "news"] and data["has_attr"] and (data["n_aux"], data["n_target"]) == (12, 8)
    assert data["text"]["aux"]["format"] == "jsonl" and data["text"]["target"]["length"] == 6
    assert result["attacks"]["sequential-inversion"]["metrics"]["token_accuracy"] == 1.0
    assert result["attacks"]["attribute"]["status"] == "ok"


HOSTILE = {
    "huge line": ("corpus.txt", b"w20 w21\nw22\n" + b"w23 " * 300_000 + b"\n", "line 3: longer than 1 MiB"),
    "invalid UTF-8": ("corpus.txt", b"w20 w21\nw22 \xff\xfe\n", "line 2: not UTF-8 text"),
    "a jsonl list": ("corpus.jsonl", b'{"text": "w20"}\n["w21"]\n', "line 2: a JSON list, not an object"),
    "invalid JSON": ("corpus.jsonl", b'{"text": "w20"}\n\n{"text": \n', "line 3: not JSON"),
    "no text field": ("corpus.jsonl", b'{"text": "w20"}\n{"body": "w21"}\n', "line 2: no 'text' field"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_text_files_exit_2_naming_the_line(gpt2, tmp_path, capsys, case):
    name, content, fragment = HOSTILE[case]
    (tmp_path / name).write_bytes(content)
    args = ["run", str(gpt2), "--split-layer", "1", "--aux", str(tmp_path / name), "--attacks", "none", "--quick"]
    code, _, err = run_cli([*args, "--out", str(tmp_path / "out")], capsys)
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "out" / "report.json").exists()


def test_text_beyond_the_memory_limit_is_refused_before_it_is_read(gpt2, corpus, monkeypatch):
    raw = open_checkpoint(gpt2, torch.device("cpu"), 1)
    # 20 kB: 26 lines x 8 tokens x (8 + 4 + 1 + 4 x 16) bytes is 16 kB, x 16 tokens 32 kB
    monkeypatch.setenv("SPLITAUDIT_MEMORY_LIMIT_GIB", str(20_000 / 1024**3))
    load_text_data(corpus[0], raw.tokens, max_length=MAX_LENGTH)
    with pytest.raises(InputError, match=r"has 26 lines: at 16 tokens each .* take 0.0305 MiB; .* at most 0.0191 MiB"):
        load_text_data(corpus[0], raw.tokens, max_length=16)


def test_text_for_a_model_without_tokens_and_labels_in_plain_text_are_refused(gpt2, corpus, tmp_path, capsys):
    args = ["run", str(SAMPLES / "digits_mlp.onnx"), "--aux", str(corpus[0]), "--attacks", "none", "--quick"]
    code, _, err = run_cli([*args, "--out", str(tmp_path / "a")], capsys)
    assert_one_line_error(code, err, "is raw text, and this model does not take tokens")
    args = ["run", str(gpt2), "--split-layer", "1", "--aux", str(corpus[0]), "--label-column", "topic"]
    code, _, err = run_cli([*args, "--attacks", "none", "--quick", "--out", str(tmp_path / "b")], capsys)
    assert_one_line_error(code, err, "is plain text (one text a line, no fields)")


def test_a_jsonl_line_without_the_label_field_is_refused_naming_it(gpt2, tmp_path):
    raw = open_checkpoint(gpt2, torch.device("cpu"), 1)
    path = tmp_path / "labels.jsonl"
    first = json.dumps({"text": "w20 w21", "topic": "a"})
    for second, fragment in (({"text": "w22"}, "is missing"), ({"text": "w22", "topic": None}, "is null")):
        path.write_text(f"{first}\n{json.dumps(second)}\n", encoding="utf-8")
        with pytest.raises(InputError, match=f"line 2: --label-column field 'topic' {fragment}"):
            load_text_data(path, raw.tokens, label_column="topic")


def test_an_onnx_token_model_reads_text_with_vocab_tokenizer_json(tmp_path, capsys):
    """The bundled text bottom (ONNX, ids only) with a word-level tokenizer.json over its vocabulary:
    its sentences written as text come back as the sample's ids, and are recovered exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from splitaudit.inputs.model_format import ModelRequest
    from splitaudit.inputs.token_models import ModelSource, open_audited_model

    vocab = json.loads((SAMPLES / "text_vocab.json").read_text())
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token=vocab[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with np.load(SAMPLES / "text.npz") as npz:
        ids = npz["x"][:40]
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(vocab[i] for i in row) for row in ids) + "\n")
    source = ModelSource(SAMPLES / "text_bottom.onnx", ModelRequest(vocab=tmp_path / "tokenizer.json"))
    raw = open_audited_model(source, torch.device("cpu"))
    data = load_text_data(tmp_path / "corpus.txt", raw.tokens, vocab_path=tmp_path / "tokenizer.json")
    assert torch.equal(data.token_ids, torch.from_numpy(ids)) and data.mask is None  # no padding: no mask
    assert (data.text["length"], data.text["padded"], data.text["truncated"]) == (8, 0, 0)
    out = tmp_path / "out"
    args = ["run", str(SAMPLES / "text_bottom.onnx"), "--vocab", str(tmp_path / "tokenizer.json")]
    attacks = ["--aux", str(tmp_path / "corpus.txt"), "--attacks", "sequential-inversion", "--quick"]
    code, _, err = run_cli([*args, *attacks, "--workers", "1", "--out", str(out)], capsys)
    assert code == 0, err
    result = json.loads((out / "report.json").read_text())
    assert result["data"]["text"]["aux"]["tokenizer_source"] == "vocab"
    assert result["attacks"]["sequential-inversion"]["metrics"]["token_accuracy"] == 1.0
