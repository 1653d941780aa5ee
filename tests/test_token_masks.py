"""Padding masks on token inputs: bottoms whose forward takes (input_ids, attention_mask), data
with a `mask` beside `x`; the mask is held fixed per sample and padded positions count nowhere."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_cli import assert_one_line_error, run_cli

from splitaudit.attacks.parts.text_metrics import most_frequent_guess, position_accuracy, rare_tokens, token_metrics
from splitaudit.core.config import AuditOptions
from splitaudit.core.result import first_error
from splitaudit.engine.pipeline import prepare_context
from splitaudit.inputs.tokens import per_mask_pattern
from splitaudit.stages import leakage
from tests.support.token_models import DIM, LENGTH, VOCAB, TokenBottom

FORMATS = ("torchscript", "legacy", "dynamo")


class MaskedBottom(TokenBottom):
    """TokenBottom whose attention skips padded keys (src_key_padding_mask from the attention mask);
    positions are sliced to the sentence length, so exports can leave the length dynamic."""

    def from_embeddings(self, e: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.blocks(e + self.pos[: e.shape[1]], src_key_padding_mask=mask == 0)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.from_embeddings(self.tok(ids), mask)


def export_masked_onnx(bottom: nn.Module, exporter: str, path) -> str:
    """ONNX over (input_ids, attention_mask), both int64 with batch and length dynamic, by the
    legacy or the dynamo exporter (weights inside the file)."""
    ids, mask = (torch.from_numpy(a) for a in right_padded(3, seed=1))
    names = ["input_ids", "attention_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {name: {0: "batch", 1: "length"} for name in names}
            torch.onnx.export(bottom, (ids, mask), str(path), dynamo=False, input_names=names, dynamic_axes=axes)
        else:
            batch, length = torch.export.Dim("batch"), torch.export.Dim("length", min=2, max=LENGTH)
            shapes = ({0: batch, 1: length}, {0: batch, 1: length})
            torch.onnx.export(
                bottom,
                (ids, mask),
                str(path),
                dynamo=True,
                input_names=names,
                dynamic_shapes=shapes,
                external_data=False,
            )
    return str(path)


def right_padded(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, LENGTH], mask [n, LENGTH]): sentences of 2..LENGTH real tokens, then padding (id 0)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, LENGTH + 1, n)
    mask = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.int64)
    return rng.integers(1, VOCAB, (n, LENGTH)) * mask, mask


@pytest.fixture(scope="module")
def bottom():
    return MaskedBottom().eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory, bottom):
    folder = tmp_path_factory.mktemp("masks")
    ids, mask = right_padded(3, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(bottom, (torch.from_numpy(ids), torch.from_numpy(mask)), check_trace=False)
    traced.save(str(folder / "masked.pt"))
    models = {"torchscript": str(folder / "masked.pt")}
    models.update({fmt: export_masked_onnx(bottom, fmt, folder / f"masked_{fmt}.onnx") for fmt in FORMATS[1:]})
    x, mask = right_padded(120, seed=0)
    np.savez(folder / "padded.npz", x=x, mask=mask, y=x[:, 0] % 2, attr=(x[:, 1] >= VOCAB // 2).astype(int))
    np.savez(folder / "unpadded.npz", x=x, y=x[:, 0] % 2)
    (folder / "vocab.json").write_text(json.dumps([f"w{i}" for i in range(VOCAB)]))
    return models, str(folder / "padded.npz"), str(folder / "vocab.json")


def token_context(model, data, vocab, **overrides):
    options = AuditOptions(model=model, aux=data, vocab=vocab, quick=True, attacks=["none"], **overrides)
    return prepare_context(options.validate())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_cut_model_with_a_mask_is_the_whole_model_with_that_mask(files, bottom, fmt):
    """Each sample's hidden states from its embeddings under its own mask equal the whole model's on
    (ids, mask); the padding mask matters (all-ones gives different states), twice. For ONNX both
    routes get the mask: the converted module and onnxruntime (the black-box path)."""
    models, data, vocab = files
    ctx = token_context(models[fmt], data, vocab)
    ids, mask = ctx.target.token_ids, ctx.target.mask
    assert mask is not None and mask.dtype == torch.bool and not bool(mask.all())
    with torch.no_grad():
        expected = bottom(ids, mask.long())
        unmasked = bottom(ids, torch.ones_like(ids))
        for _ in range(2):
            ctx._clean.clear()
            torch.testing.assert_close(ctx.clean_embeddings("target"), expected, atol=1e-5, rtol=1e-5)
            black_box = per_mask_pattern(ctx.tokens, mask, ctx.target.x, ctx.encoder.blackbox_fn)
            torch.testing.assert_close(black_box, expected, atol=1e-5, rtol=1e-5)
    assert (expected - unmasked).abs().max() > 1e-2
    assert ctx.encoder.format == ("torchscript" if fmt == "torchscript" else "onnx")


def test_opening_an_onnx_token_model_leaves_no_scratch_files(files, tmp_path, monkeypatch):
    """The graph cut after the embedding lookup is written to a scratch folder that is gone once the
    model is open (a long CI job opening models would otherwise fill the disk), each of two opens; the
    opened model still runs."""
    import tempfile

    models, data, vocab = files
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for _ in range(2):
        ctx = token_context(models["legacy"], data, vocab)
        assert ctx.clean_embeddings("target").isfinite().all()
        assert not list(tmp_path.glob("splitaudit-tokens-*"))


@pytest.mark.parametrize("fmt", ["torchscript", "legacy"])
def test_dfil_is_the_jacobian_in_the_embeddings_under_each_samples_mask(files, bottom, fmt):
    """Per-sample ||J||_F^2 over the embeddings only (mask held fixed) equals the eager module's
    Jacobian trace under that sample's mask (rtol 1e-4: exact methods on both sides)."""
    models, data, vocab = files
    ctx = token_context(models[fmt], data, vocab, smoothing=0.0, noise_sigma=1.0)
    m = leakage.measure(ctx, prior="gaussian", smoothing=0.0)
    assert m.d == LENGTH * DIM and len(m.index) == len(ctx.target)
    assert len(torch.unique(ctx.target.mask, dim=0)) > 1  # several mask groups, merged in index order
    assert any("held fixed per sample" in w for w in ctx.encoder.warnings)
    for k in range(6):
        i = m.index[k]
        x, mask = ctx.target.x[i : i + 1], ctx.target.mask[i : i + 1]
        j = torch.autograd.functional.jacobian(lambda e: bottom.from_embeddings(e, mask), x, vectorize=True)
        assert float(m.mean_trace.traces.values[k]) == pytest.approx(float(j.pow(2).sum()), rel=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_mask_model_without_a_data_mask_runs_with_all_ones_and_says_so(files, bottom, fmt):
    models, data, vocab = files
    ctx = token_context(models[fmt], data.replace("padded", "unpadded"), vocab)
    assert ctx.target.mask is None
    with torch.no_grad():
        expected = bottom(ctx.target.token_ids, torch.ones_like(ctx.target.token_ids))
    torch.testing.assert_close(ctx.clean_embeddings("target"), expected, atol=1e-5, rtol=1e-5)
    assert any("all-ones mask" in w for w in ctx.encoder.warnings)


def test_padded_positions_count_nowhere():
    """A hand-built case: 2 sentences of 4 positions, the last two of sentence 1 padded (wrong guesses
    there must not count). Real positions: 6, hits: 5 (sentence 0 has one miss at t=1)."""
    true = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    pred = torch.tensor([[1, 9, 3, 4], [5, 6, 7, 7]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    rare = torch.zeros(10, dtype=torch.bool)
    rare[[2, 6]] = True
    m = token_metrics(true, pred, rare, valid)
    assert m["token_accuracy"] == pytest.approx(5 / 6)
    assert m["exact_match"] == pytest.approx(1 / 2)  # sentence 1 matches on its real tokens
    assert m["rare_token_recall"] == pytest.approx(1 / 2)  # token 2 missed, token 6 hit
    assert m["rouge_l"] == pytest.approx((2 * 0.75 * 0.75 / 1.5 + 1.0) / 2)  # LCS 3 of 4, then 2 of 2
    assert token_metrics(true, pred, rare)["token_accuracy"] == pytest.approx(5 / 8)  # without the mask
    assert position_accuracy(true, pred, valid) == [1.0, 0.5, 1.0, 1.0]
    aux = torch.tensor([[1, 2, 0], [1, 0, 0], [3, 0, 0]])
    aux_valid = torch.tensor([[True, True, False], [True, False, False], [True, False, False]])
    assert most_frequent_guess(aux, 1).tolist() == [[1, 0, 0]]  # padding id 0 wins unmasked
    guess = most_frequent_guess(aux, 1, aux_valid).tolist()[0]
    assert guess[:2] == [1, 2]  # padding never guessed from
    assert rare_tokens(aux, 4, aux_valid)[0] and not rare_tokens(aux, 4)[0]  # id 0 only ever pads


def test_bad_masks_are_refused(tmp_path, files, capsys):
    models, _, vocab = files
    x, mask = right_padded(20, seed=3)
    empty = mask.copy()
    empty[4] = 0
    for name, bad, fragment in [
        ("shape", mask[:, :-1], "'mask' has shape [20, 5], 'x' has [20, 6]"),
        ("values", mask * 2, "'mask' must hold 0 (padding) and 1 (real token) only"),
        ("float", mask.astype(float), "'mask' must be bool or integer 0/1"),
        ("empty", empty, "1 rows of 'mask' have no real token (first: row 4)"),
    ]:
        np.savez(tmp_path / f"{name}.npz", x=x, mask=bad)
        code, _, err = run_cli(
            ["run", models["torchscript"], "--aux", str(tmp_path / f"{name}.npz"), "--vocab", vocab], capsys
        )
        assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("fmt", ["torchscript", "dynamo"])
def test_a_padded_dataset_audits_end_to_end(tmp_path, files, capsys, fmt):
    """`splitaudit run --vocab --attacks token-inversion,kmeans --quick` on padded data: a valid report;
    the inversion beats its baseline on the real tokens, the sentences shown hold real tokens only
    (no padding id 0: the data pads with 0 and draws real tokens from 1..39), the mask note is in the
    model's warnings. k-means on this random bottom's noisy states may lose to k-means on the raw
    embeddings (which show the padding): then the gate says so (exit 1), never a silent pass."""
    models, data, vocab = files
    out = tmp_path / "out"
    args = ["run", models[fmt], "--aux", data, "--vocab", vocab, "--quick", "--noise-sigma", "0.5"]
    code, shown, err = run_cli(
        [*args, "--attacks", "token-inversion,kmeans", "--out", str(out), "--workers", "1"], capsys
    )
    result = json.loads((out / "report.json").read_text())
    assert first_error(result) is None
    inversion, kmeans = result["attacks"]["token-inversion"], result["attacks"]["kmeans"]
    assert inversion["status"] == "ok" and inversion["advantage"] > 0
    assert code == 0 or (code == 1 and kmeans["advantage"] < 0 and "FAILED to train" in shown), err
    tokens = inversion["details"]["tokens"]
    assert tokens["sentences"] and all("w0" not in s["original"].split() for s in tokens["sentences"])
    assert len(tokens["position_accuracy"]) == LENGTH
    assert any("held fixed per sample" in w for w in result["model"]["warnings"])
    statement = result["tokens"]  # padded: no whole-sentence term, positions guessed as a token or padding
    assert statement["sentence_blind_guess"] is None and any("padding" in a for a in statement["assumptions"])
    assert inversion["metrics"]["token_accuracy"] <= statement["token_accuracy_ceiling"]
    assert statement["violated_by"] == [] and statement["compared_with"] == ["token-inversion"]


def test_an_onnx_second_input_that_is_not_a_mask_is_refused(tmp_path, files, bottom, capsys):
    """ONNX (input_ids, token_types): feeding the attention mask to it would audit another function."""
    _, data, vocab = files
    ids, mask = (torch.from_numpy(a) for a in right_padded(3, seed=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            bottom,
            (ids, mask),
            str(tmp_path / "typed.onnx"),
            dynamo=False,
            input_names=["input_ids", "token_types"],
            dynamic_axes={"input_ids": {0: "batch"}, "token_types": {0: "batch"}},
        )
    code, _, err = run_cli(["run", str(tmp_path / "typed.onnx"), "--aux", data, "--vocab", vocab], capsys)
    assert_one_line_error(code, err, "second input 'token_types' is not an attention mask")


def test_a_second_input_that_is_not_a_mask_is_refused(tmp_path, files, bottom, capsys):
    """forward(ids, token_types): feeding it the attention mask would audit another function silently."""
    _, data, vocab = files

    class TypedBottom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = bottom

        def forward(self, ids: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
            return self.inner.from_embeddings(self.inner.tok(ids) + token_types[..., None], token_types)

    ids, mask = (torch.from_numpy(a) for a in right_padded(3, seed=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(TypedBottom().eval(), (ids, mask), check_trace=False).save(str(tmp_path / "typed.pt"))
    code, _, err = run_cli(["run", str(tmp_path / "typed.pt"), "--aux", data, "--vocab", vocab], capsys)
    assert_one_line_error(code, err, "second input 'token_types' is not an attention mask")


def test_the_python_api_carries_a_mask(files):
    """splitaudit.audit(model, {x, y, mask}, vocab=...) audits what the npz with the same mask gives
    (the same dFIL: the mask reached the model), which differs from the same ids without the mask;
    a bad mask or a mask without vocab raises InputError."""
    import splitaudit
    from splitaudit.core.errors import InputError

    models, data, vocab = files
    with np.load(data) as npz:
        ids, y, mask = npz["x"], npz["y"], npz["mask"]
    run = lambda source: splitaudit.audit(
        models["torchscript"], source, attacks="none", vocab=vocab, quick=True, noise_sigma=0.5, prior="gaussian"
    )
    from_api, from_file = run({"x": ids, "y": y, "mask": torch.from_numpy(mask)}), run(data)
    assert from_api["dfil"]["mean"] == pytest.approx(from_file["dfil"]["mean"], rel=1e-9)
    assert any("held fixed per sample" in w for w in from_api["model"]["warnings"])
    assert run({"x": ids, "y": y})["dfil"]["mean"] != pytest.approx(from_file["dfil"]["mean"], rel=1e-3)
    with pytest.raises(InputError, match="'mask' must hold 0"):
        run({"x": ids, "y": y, "mask": mask * 2})
    with pytest.raises(InputError, match="attention mask over token ids"):
        splitaudit.audit(nn.Linear(LENGTH, 3), {"x": ids.astype(float), "mask": mask}, attacks="none", quick=True)


def test_shapes_read_off_the_ids_are_read_off_the_embeddings():
    """A hand-built graph reads sizes off its ids [N, T] (Shape whole, from -1, and on their Cast up
    to 1); rewritten, it reads them off the embeddings [N, T, D] and onnxruntime gives the same
    sizes on ids [3, 5]."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from splitaudit.inputs.formats.onnx import _shapes_read_from_embeddings

    table = numpy_helper.from_array(np.zeros((7, 4), dtype=np.float32), "table")
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Gather", ["table", "ids"], ["emb"]),
        helper.make_node("Shape", ["ids"], ["whole"]),
        helper.make_node("Shape", ["ids"], ["last"], start=-1),
        helper.make_node("Shape", ["ids32"], ["first"], start=0, end=1),
    ]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, [k]) for n, k in (("whole", 2), ("last", 1), ("first", 1))
    ]
    graph = helper.make_graph(
        nodes,
        "sizes",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"])],
        [*outputs, helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["N", "T", 4])],
        [table],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    run = lambda model: ort.InferenceSession(model.SerializeToString()).run(None, {"ids": np.zeros((3, 5), np.int64)})
    before = run(proto)
    assert _shapes_read_from_embeddings(proto, "ids", "emb")
    onnx.checker.check_model(proto)
    assert all(n.input[0] == "emb" for n in proto.graph.node if n.op_type == "Shape")
    after = run(proto)
    assert [a.tolist() for a in after[:3]] == [b.tolist() for b in before[:3]] == [[3, 5], [5], [3]]
