"""Token inputs: bottoms over token ids cut at their embedding lookup, audited on the embeddings."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from conftest import sample
from test_cli import assert_one_line_error, run_cli

from splitaudit.core.config import AuditOptions
from splitaudit.core.input_space import InputSpace
from splitaudit.core.result import first_error
from splitaudit.engine.pipeline import prepare_context
from splitaudit.inputs.tokens import load_vocab
from splitaudit.stages import leakage
from tests.support.token_models import LENGTH, TokenBottom, save_token_data, save_token_model

FORMATS = ("torchscript", "legacy", "dynamo")


@pytest.fixture(scope="module")
def bottom():
    return TokenBottom().eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory, bottom):
    folder = tmp_path_factory.mktemp("tokens")
    models = {fmt: str(save_token_model(bottom, fmt, folder)) for fmt in FORMATS}
    data, vocab = save_token_data(folder)
    return models, data, vocab


def token_context(model, data, vocab, **overrides):
    options = AuditOptions(model=model, aux=data, vocab=vocab, quick=True, attacks=["none"], **overrides)
    return prepare_context(options.validate())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_model_is_cut_at_its_embedding_lookup(files, bottom, fmt):
    """x becomes table[ids]; the cut model on those embeddings gives the whole model's hidden
    states (within the ONNX parity tolerance), with autograd gradients."""
    models, data, vocab = files
    ctx = token_context(models[fmt], data, vocab)
    ids = ctx.target.token_ids
    assert ids.shape == (60, LENGTH) and ctx.target.x.shape == (60, LENGTH, 8)
    torch.testing.assert_close(ctx.tokens.table, bottom.tok.weight.detach())
    torch.testing.assert_close(ctx.target.x, bottom.tok.weight.detach()[ids])
    with torch.no_grad():
        expected = bottom(ids)
        for _ in range(2):  # a second call through the interpreter gives the same
            torch.testing.assert_close(ctx.encoder(ctx.target.x), expected, atol=1e-5, rtol=1e-5)
    assert ctx.encoder.differentiable and ctx.space == InputSpace("tokens", (LENGTH, 8), unit_range=False)
    assert ctx.tokens.nearest(ctx.target.x).equal(ids)


@pytest.mark.parametrize("fmt", ["torchscript", "dynamo"])
def test_dfil_is_the_jacobian_of_the_hidden_states_in_the_embeddings(files, bottom, fmt):
    """Per-sample ||J||_F^2 equals the trace from torch.autograd.functional.jacobian of the eager
    module's embeddings -> hidden states (rtol 1e-4: exact methods on both sides; 4 samples, as
    the eager reference is slow)."""
    models, data, vocab = files
    ctx = token_context(models[fmt], data, vocab, smoothing=0.0, noise_sigma=1.0)
    m = leakage.measure(ctx, prior="gaussian", smoothing=0.0)
    assert m.d == LENGTH * 8 and len(m.index) == len(ctx.target)
    x = ctx.target.x[m.index[:4]]
    jacobians = [torch.autograd.functional.jacobian(bottom.from_embeddings, e[None], vectorize=True) for e in x]
    expected = torch.stack([j.pow(2).sum() for j in jacobians])
    torch.testing.assert_close(m.traces.values[:4].double(), expected.double(), rtol=1e-4, atol=0)
    assert m.trace_over_d == pytest.approx(float(m.traces.values.double().mean()) / m.d, rel=1e-6)


def test_token_smoothing_defaults_to_a_quarter_of_the_table_spread(files, bottom):
    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab, noise_sigma=1.0)
    table = bottom.tok.weight.detach()
    spread = float((table - table.mean(0)).pow(2).mean().sqrt())
    assert leakage.resolve_smoothing(ctx, None) == pytest.approx(0.25 * spread, rel=1e-6)
    assert leakage.resolve_smoothing(ctx, 0.1) == 0.1


def test_unsmoothed_token_prior_is_infinite_so_van_trees_is_zero(files):
    """Embeddings of a finite vocabulary: a discrete prior, J = inf, no finite van Trees bound;
    Cramér-Rao (no prior) still holds."""
    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab, noise_sigma=1.0)
    section = leakage.assess(ctx, prior="ssm", smoothing=0.0)
    assert section["prior"]["valid"] is False and math.isinf(section["prior"]["J_over_d_used"])
    assert section["bounds"]["van_trees_mse"] == 0.0
    assert 0 < section["bounds"]["cramer_rao_mse"] < math.inf


def test_smoothed_token_prior_is_stams_limit_whatever_the_method(files):
    """tau > 0: J/d is Stam's limit 1/tau^2 (valid for every smoothed prior), never a score-matching
    or Gaussian estimate, which underestimate a finite vocabulary's peaked mixture; so the van Trees
    bound is at most tau^2 (closed form 1/(dFIL + 1/tau^2))."""
    models, data, vocab = files
    ctx = token_context(models["torchscript"], data, vocab, noise_sigma=1.0)
    tau = 0.3
    for method in ("gaussian", "ssm"):
        section = leakage.assess(ctx, prior=method, smoothing=tau)
        prior, bounds = section["prior"], section["bounds"]
        assert prior["valid"] and prior["J_over_d_used"] == pytest.approx(1 / tau**2)
        assert bounds["van_trees_mse"] == pytest.approx(1 / (bounds["dfil_used"] + 1 / tau**2), rel=1e-9)
        assert bounds["van_trees_mse"] < tau**2


def test_vocab_from_a_tokenizer_json(tmp_path):
    spec = {"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 2}}, "added_tokens": [{"id": 1, "content": "[P]"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert load_vocab(tmp_path / "tokenizer.json", 3) == ["a", "[P]", "b"]
    unigram = {"model": {"type": "Unigram", "vocab": [["x", -1.0], ["y", -2.0]]}}
    (tmp_path / "u.json").write_text(json.dumps(unigram))
    assert load_vocab(tmp_path / "u.json", 2) == ["x", "y"]


def test_a_model_without_an_embedding_lookup_is_refused(tmp_path, files, capsys):
    """A float model given token data: exit 2 naming what was looked for (ONNX and TorchScript)."""
    _, data, vocab = files
    linear = torch.nn.Linear(LENGTH, 4).eval()
    torch.jit.trace(linear, torch.rand(2, LENGTH)).save(str(tmp_path / "linear.pt"))
    code, _, err = run_cli(["run", str(tmp_path / "linear.pt"), "--aux", data, "--vocab", vocab], capsys)
    assert_one_line_error(code, err, "aten::embedding")
    torch.onnx.export(linear, (torch.rand(2, LENGTH),), str(tmp_path / "linear.onnx"), dynamo=False)
    code, _, err = run_cli(["run", str(tmp_path / "linear.onnx"), "--aux", data, "--vocab", vocab], capsys)
    assert_one_line_error(code, err, "Gather of a weight table by the integer ids input")


def test_bad_token_data_is_refused(tmp_path, files, capsys):
    models, _, vocab = files
    for name, arrays, fragment in [
        ("range", {"x": np.arange(20 * LENGTH).reshape(20, LENGTH) % 41}, "token ids must lie in [0, 40)"),
        ("float", {"x": np.random.rand(20, LENGTH)}, "integer token ids of shape [N, T]"),
        (
            "mask",
            {"x": np.arange(20 * LENGTH).reshape(20, LENGTH) % 40, "mask": np.tri(20, LENGTH, 2, dtype=int)},
            "'mask' pads some positions but the model has no attention-mask input",
        ),
    ]:
        np.savez(tmp_path / f"{name}.npz", **arrays)
        code, _, err = run_cli(
            ["run", models["torchscript"], "--aux", str(tmp_path / f"{name}.npz"), "--vocab", vocab], capsys
        )
        assert_one_line_error(code, err, fragment)
    (tmp_path / "big.json").write_text(json.dumps([str(i) for i in range(41)]))
    code, _, err = run_cli(["run", models["dynamo"], "--aux", files[1], "--vocab", str(tmp_path / "big.json")], capsys)
    assert_one_line_error(code, err, "embedding table has 40 rows")


def assert_done_with_reasons(code: int, err: str, result: dict) -> None:
    """Exit 0 (no threshold is set, so nothing an attack finds fails the gate), and every attack that
    did not learn says why (on random ids the attribute is one token, which a probe on the hidden
    states may not read: inconclusive, never privacy)."""
    assert code == 0, err
    for entry in result["attacks"].values():
        assert (entry.get("outcome") == "inconclusive") == bool(entry.get("failed_to_train")), entry


@pytest.mark.slow
@pytest.mark.parametrize("sigma", [0.0, 0.5, 2.0, 8.0])
def test_no_attack_beats_the_token_statement_and_the_report_shows_sentences(tmp_path, bottom, sigma, capsys):
    """The whole battery through the CLI on the TorchScript bottom: report.json validates (with its
    tokens section), no attack's token accuracy or exact match exceeds its ceiling, every token
    attack is compared, the ceiling says something at sigma = 8 (it falls below 1 from sigma ~ 4:
    48 layer-normed hidden coordinates, 40 tokens), and the report shows the sentences with the
    vocabulary's strings escaped."""
    model = save_token_model(bottom, "torchscript", tmp_path)
    data, _ = save_token_data(tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps([f"<b>w{i}" for i in range(40)]))
    out = tmp_path / "out"
    args = ["run", str(model), "--aux", data, "--vocab", str(tmp_path / "vocab.json"), "--quick"]
    code, _, err = run_cli([*args, "--noise-sigma", str(sigma), "--out", str(out), "--workers", "1"], capsys)
    result = json.loads((out / "report.json").read_text())
    assert_done_with_reasons(code, err, result)
    assert first_error(result) is None
    statement = result["tokens"]
    measured = {
        n: a["metrics"]
        for n, a in result["attacks"].items()
        if a["status"] == "ok" and "token_accuracy" in a["metrics"]
    }
    assert set(measured) == {"decoder", "optimization", "token-inversion"} == set(statement["compared_with"])
    for name, metrics in measured.items():
        assert metrics["token_accuracy"] <= statement["token_accuracy_ceiling"], (name, metrics, statement)
        assert metrics["exact_match"] <= statement["exact_match_ceiling"], (name, metrics, statement)
    assert statement["violated_by"] == []
    assert (statement["token_accuracy_ceiling"] < 1) == (sigma >= 8), statement
    if sigma <= 2:
        assert result["attacks"]["token-inversion"]["advantage"] > 0, "the hidden states leak tokens at these sigmas"
    html = (out / "report.html").read_text()
    assert "&lt;b&gt;w" in html and "<b>w" not in html and "generalised Fano" in html
    assert "original sentence" in (out / "report.md").read_text()


@pytest.mark.slow
def test_the_token_ceiling_says_something_on_the_demo_sample_at_large_noise(capsys):
    """The shipped text bottom at sigma = 60: the hidden states (256 coordinates, std about 3.5)
    carry under 1 nat, the token ceiling is below 1 (from sigma ~ 35 on: measured 34.6) and the
    exact-match ceiling below 0.5, and no attack beats either."""
    args = ["run", sample("text_bottom.onnx"), "--aux", sample("text.npz"), "--vocab", sample("text_vocab.json")]
    code, _, err = run_cli([*args, "--quick", "--noise-sigma", "60", "--out", "out", "--workers", "1"], capsys)
    result = json.loads(open("out/report.json").read())
    assert_done_with_reasons(code, err, result)
    statement = result["tokens"]
    assert 0 < statement["information_nats"] < 1 and 30 < statement["informative_from_sigma"] < 40
    assert statement["token_accuracy_ceiling"] < 1 and statement["exact_match_ceiling"] < 0.5
    assert set(statement["compared_with"]) == {"decoder", "optimization", "token-inversion", "sequential-inversion"}
    for name in statement["compared_with"]:
        metrics = result["attacks"][name]["metrics"]
        assert metrics["token_accuracy"] <= statement["token_accuracy_ceiling"], name
        assert metrics["exact_match"] <= statement["exact_match_ceiling"], name
    assert statement["violated_by"] == []


@pytest.mark.slow
def test_demo_text_audits_the_bundled_transformer_bottom(capsys, monkeypatch):
    """`splitaudit demo --text --quick` without the hf extra: one line saying how to get the checkpoint
    demo, then the shipped ONNX bottom, corpus and vocabulary pass with every attack ok (SDAR
    skipped); the learned inversion and the optimisation over the vocabulary simplex read most tokens
    back at sigma = 0, far above the most-frequent-token baseline, and the attribute probe reads the
    city's region as well as the raw-text probe does."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the hf extra were not installed
    code, out, err = run_cli(["demo", "--text", "--quick", "--out", "text-demo", "--workers", "1"], capsys)
    result = json.loads(open("text-demo/report.json").read())
    assert code == 0, err
    assert 'pip install "splitaudit[hf]"' in err.splitlines()[0]
    assert result["model"]["format"] == "onnx" and result["data"]["sample_shape"] == [8, 32]
    statuses = {name: entry["status"] for name, entry in result["attacks"].items()}
    assert statuses == {**dict.fromkeys(statuses, "ok"), "sdar": "skipped"}, statuses
    assert not any(entry.get("failed_to_train") for entry in result["attacks"].values())
    for name in ("token-inversion", "optimization"):
        entry = result["attacks"][name]
        assert entry["metrics"]["token_accuracy"] > entry["baseline"]["token_accuracy"] + 0.3, name
    assert (
        result["attacks"]["optimization"]["metrics"]["mse"] < 0.5 * result["attacks"]["optimization"]["baseline"]["mse"]
    )
    assert result["attacks"]["sdar"]["status"] == "skipped" and "In tokens" in out


def test_python_api_takes_token_arrays_and_a_vocab(files):
    """splitaudit.audit(model file, (ids, y), vocab=...): the same cut and token attack as the CLI."""
    import splitaudit

    models, data, vocab = files
    with np.load(data) as npz:
        ids, y = npz["x"], npz["y"]
    result = splitaudit.audit(models["legacy"], (ids, y), attacks="token-inversion", vocab=vocab, quick=True)
    assert result["data"]["sample_shape"] == [LENGTH, 8] and "tokens" in result.data
    entry = result["attacks"]["token-inversion"]
    assert entry["status"] == "ok" and entry["metrics"]["token_accuracy"] > entry["baseline"]["token_accuracy"]


class TupleTokenBottom(TokenBottom):
    """Returns (hidden states, their mean), as a traced Hugging Face model returns a tuple."""

    def forward(self, ids: torch.Tensor):
        hidden = self.from_embeddings(self.tok(ids))
        return hidden, hidden.mean(1)


def test_a_token_model_returning_a_tuple_is_cut_and_audits_its_first_output(tmp_path, files):
    _, data, vocab = files
    model = TupleTokenBottom().eval()
    path = save_token_model(model, "torchscript", tmp_path)
    ctx = token_context(str(path), data, vocab)
    with torch.no_grad():
        torch.testing.assert_close(ctx.encoder(ctx.target.x), model(ctx.target.token_ids)[0], atol=1e-5, rtol=1e-5)
    assert any("tuple of 2 outputs" in note for note in ctx.encoder.warnings)
