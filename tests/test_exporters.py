"""Loading ONNX graphs as other exporters write them, and errors that name their cause.

Graphs come from tests/support/exporter_graphs.py (Paddle2ONNX / tf2onnx / old-IR styles built from
small torch modules) or are written node by node with onnx.helper. Every converted model is
checked against the torch module it was exported from (an independent computation of f).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from conftest import make_context, sample
from onnx import TensorProto, helper, numpy_helper

import splitaudit.inputs.onnx_loading as onnx_loading
from splitaudit.attacks import get_attack
from splitaudit.cli import main
from splitaudit.core.errors import InputError
from splitaudit.inputs.models import open_model, prepare_encoder
from splitaudit.inputs.onnx_graph import declare_dynamic_dims
from tests.support.architectures import build, export_onnx
from tests.support.exporter_graphs import STYLES, TEXT_LINE, write_style

CPU = torch.device("cpu")


def encoder_for(path, x):
    return prepare_encoder(open_model(path, CPU), x)


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def save_graph(path, nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("style", STYLES, ids=[s.name.split(" (")[0] for s in STYLES])
def test_exporter_styles_load_differentiable_and_match_the_exported_module(style, tmp_path):
    path, module = write_style(style, tmp_path)
    x = torch.rand(5, *style.shape)
    encoder = encoder_for(path, x)
    assert encoder.gradient_mode == "autograd", encoder.warnings
    assert encoder.parity_max_abs_err < 1e-4
    assert encoder.fixed_batch is None  # -1, 0 and symbols are all a dynamic batch
    with torch.no_grad():
        expected = module(x)
    # a batch size the parity check did not see, and twice: the converted module is reused
    for batch in (x[:3], x[:3]):
        torch.testing.assert_close(encoder.embed(batch), expected[:3], rtol=1e-4, atol=1e-5)
    # gradients, not only values: a vector-Jacobian product with a random cotangent
    cotangent = torch.randn_like(expected[:2])
    grads = [torch.func.vjp(fn, x[:2])[1](cotangent)[0] for fn in (encoder, module)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)


def test_paddle_style_text_line_has_no_initializers_and_declares_minus_one(tmp_path):
    path, _ = write_style(STYLES[0], tmp_path)
    proto = onnx.load(str(path))
    assert len(proto.graph.initializer) == 0
    assert sum(n.op_type == "Constant" for n in proto.graph.node) >= 18  # one per weight (BN folded into convs)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == -1
    raw = open_model(path, CPU)
    assert raw.declared_input_shape == TEXT_LINE and raw.fixed_batch is None
    assert raw.converter == "onnx2pytorch"


@pytest.mark.parametrize(
    "dims, batch, shape",
    [
        ([-1, 3, 8], None, (3, 8)),
        ([0, 3, 8], None, (3, 8)),
        (["N", 3, 8], None, (3, 8)),
        ([4, 3, 8], 4, (3, 8)),
        ([-1, 3, -1], None, None),
        (["N", 3, "T"], None, None),
    ],
)
def test_declared_dims_read_as_dynamic_or_fixed(dims, batch, shape):
    info = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    proto = helper.make_model(helper.make_graph([], "g", [info], [info]))
    declare_dynamic_dims(proto)
    assert onnx_loading.onnx_input_shape(proto.graph.input[0]) == (batch, shape)


def identity_graph(tmp_path, batch_dim):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 6])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [batch_dim, 6])
    return save_graph(tmp_path / "tanh.onnx", [helper.make_node("Tanh", ["x"], ["z"])], [x], [z])


def test_batch_declared_as_zero_runs_in_onnxruntime_on_any_batch(tmp_path):
    # onnxruntime itself refuses a batch of 3 for an input declared [0, 6]: the graph is re-declared
    x = torch.rand(7, 6)
    encoder = encoder_for(identity_graph(tmp_path, 0), x)
    torch.testing.assert_close(encoder.blackbox_fn(x[:3]), torch.tanh(x[:3]))
    torch.testing.assert_close(encoder.embed(x), torch.tanh(x))


def shape_arithmetic_graph(tmp_path, kink_on_values: bool):
    """Tanh(x) reshaped to a shape computed at run time, as tf2onnx and dynamo exports compute sizes:
    Shape -> Cast -> Floor -> Cast -> Max. With kink_on_values, a Relu on the values as well."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 6])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Floor", ["sf"], ["sfl"]),
        helper.make_node("Cast", ["sfl"], ["si"], to=TensorProto.INT64),
        helper.make_node("Max", ["si", "one"], ["shape"]),
        helper.make_node("Tanh", ["x"], ["t"]),
        helper.make_node("Relu" if kink_on_values else "Identity", ["t"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["z"]),
    ]
    one = numpy_helper.from_array(np.ones(2, dtype=np.int64), "one")
    return save_graph(tmp_path / f"sizes_{kink_on_values}.onnx", nodes, [x], [z], [one])


@pytest.mark.parametrize("kink_on_values", [False, True])
def test_only_operators_on_the_inputs_values_are_reported_as_kinks(tmp_path, kink_on_values):
    """Floor and Max on a size computed from Shape are no kink of the map x -> z: a smooth graph gets no
    non-smooth warning (it got "Floor, Max" before); a Relu on the values still gets one."""
    x = torch.rand(7, 6)
    encoder = encoder_for(shape_arithmetic_graph(tmp_path, kink_on_values), x)
    torch.testing.assert_close(encoder.embed(x), torch.tanh(x))
    kinks = [w for w in encoder.warnings if "non-smooth" in w]
    assert [w.split("(")[1].split(")")[0] for w in kinks] == (["Relu"] if kink_on_values else [])


def ml_graph(tmp_path, node, width: int = 6):
    """One ai.onnx.ml operator (as skl2onnx writes them) from x to z, both [batch, width]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", width])
    graph = helper.make_graph([node], "g", [x], [z])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)]
    path = tmp_path / f"{node.op_type}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=9), str(path))
    return path


def l2_normalizer(inputs: str, output: str):
    """skl2onnx's Normalizer (rows to unit L2 norm): onnxruntime runs it, neither converter converts it."""
    return helper.make_node("Normalizer", [inputs], [output], domain="ai.onnx.ml", norm="L2")


def test_operator_no_converter_supports_is_named_and_runs_black_box(tmp_path):
    x = torch.rand(6, 6)
    encoder = encoder_for(ml_graph(tmp_path, l2_normalizer("x", "z")), x)
    assert encoder.gradient_mode == "finite-difference"
    note = next(w for w in encoder.warnings if "Normalizer" in w)
    assert note.startswith("operator Normalizer is supported by no converter (onnx2pytorch, onnx2torch)")
    assert note.endswith("running black-box through onnxruntime")
    torch.testing.assert_close(encoder.embed(x), x / x.norm(dim=1, keepdim=True))


class Skewed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + 0.05


def test_a_converter_that_disagrees_hands_over_to_the_next(tmp_path, monkeypatch):
    path, module = write_style(STYLES[1], tmp_path)
    first = onnx_loading.CONVERTERS["onnx2pytorch"]
    monkeypatch.setattr(
        onnx_loading,
        "CONVERTERS",
        {"skewed": lambda p: Skewed(first(p)), "onnx2torch": onnx_loading.CONVERTERS["onnx2torch"]},
    )
    x = torch.rand(5, *STYLES[1].shape)
    raw = open_model(path, CPU)
    encoder = prepare_encoder(raw, x)
    assert raw.converter == "onnx2torch" and encoder.differentiable
    note = next(w for w in encoder.warnings if "skewed" in w)
    assert "disagrees with onnxruntime (max abs error 0.05" in note and "using onnx2torch's module" in note
    with torch.no_grad():
        torch.testing.assert_close(encoder.embed(x), module(x), rtol=1e-4, atol=1e-5)


def test_every_converter_disagreeing_runs_black_box_with_each_reason(tmp_path, monkeypatch):
    path, module = write_style(STYLES[1], tmp_path)
    skew = {name: (lambda p, c=c: Skewed(c(p))) for name, c in onnx_loading.CONVERTERS.items()}
    monkeypatch.setattr(onnx_loading, "CONVERTERS", skew)
    x = torch.rand(5, *STYLES[1].shape)
    encoder = encoder_for(path, x)
    assert not encoder.differentiable and encoder.parity_max_abs_err == pytest.approx(0.05, rel=1e-3)
    note = next(w for w in encoder.warnings if "black-box" in w)
    assert "onnx2pytorch: the converted model disagrees" in note and "onnx2torch: the converted model disagrees" in note


def test_several_inputs_are_refused_naming_them(tmp_path):
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("pixels", "mask")]
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])
    path = save_graph(tmp_path / "two.onnx", [helper.make_node("Mul", ["pixels", "mask"], ["z"])], inputs, [z])
    with pytest.raises(InputError, match=r"has 2 inputs \('pixels', 'mask'\)"):
        open_model(path, CPU)


class IdsAndMask(nn.Module):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return ids * mask * scale


def test_torchscript_with_several_required_inputs_is_refused_naming_them(tmp_path):
    torch.jit.script(IdsAndMask()).save(str(tmp_path / "two.pt"))
    with pytest.raises(InputError, match=r"has 2 inputs \('ids', 'mask'\)"):  # scale has a default
        open_model(tmp_path / "two.pt", CPU)


def token_graph(tmp_path):
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 16])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 16, 4])
    table = numpy_helper.from_array(np.random.default_rng(0).random((50, 4), dtype=np.float32), "table")
    node = helper.make_node("Gather", ["table", "ids"], ["z"])
    return save_graph(tmp_path / "tokens.onnx", [node], [ids], [z], [table])


class TokenEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 4)

    def forward(self, ids):
        return self.embed(ids)


def test_integer_model_on_float_data_names_the_dtype_onnx(tmp_path):
    with pytest.raises(
        InputError, match=r"takes tensor\(int64\) values \(input 'ids'\), but the data holds torch.float32"
    ):
        encoder_for(token_graph(tmp_path), torch.rand(8, 16))


def test_integer_model_on_float_data_names_the_dtype_torchscript(tmp_path):
    torch.jit.script(TokenEmbedding()).save(str(tmp_path / "tokens.pt"))
    with pytest.raises(
        InputError, match=r"takes torch.int64 values \(it runs on them\), but the data holds torch.float32"
    ):
        encoder_for(tmp_path / "tokens.pt", torch.rand(8, 16) * 40)


def test_float_model_on_integer_data_names_the_dtype(tmp_path):
    # token ids (integer data whose shape fits no image) given to a float model: the cause is the dtype
    with pytest.raises(InputError, match=r"takes tensor\(float\) values \(input 'x'\), but the data holds torch.int64"):
        encoder_for(identity_graph(tmp_path, "batch"), torch.randint(0, 9, (8, 16)))


def test_dynamic_input_shape_failure_asks_for_input_shape(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, "h", "w"])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 1, "h2", "w2"])
    pool = helper.make_node("AveragePool", ["x"], ["z"], kernel_shape=[2, 2], strides=[2, 2])
    path = save_graph(tmp_path / "pool.onnx", [pool], [x], [z])
    np.savez(tmp_path / "flat.npz", x=np.random.rand(20, 64).astype(np.float32))
    code, _, err = run_cli(
        ["run", path, "--aux", tmp_path / "flat.npz", "--attacks", "none", "--out", tmp_path / "o"], capsys
    )
    line = err.strip()
    assert code == 2 and len(line.splitlines()) == 1 and "Traceback" not in err
    assert "declares its input as [batch, 1, h, w] with dynamic sizes" in line and "--input-shape" in line
    code, _, err = run_cli(
        [
            "run",
            path,
            "--aux",
            tmp_path / "flat.npz",
            "--attacks",
            "none",
            "--input-shape",
            "1,8,8",
            "--out",
            tmp_path / "o",
        ],
        capsys,
    )
    assert code == 0, err


def onnx_top_with_normalizer(tmp_path):
    """The digits top model as ONNX with an L2 Normalizer (no converter has it) after the logits:
    forward passes through onnxruntime give the TorchScript top model's logits, each row scaled by a
    positive number, so the same predicted classes."""
    path = tmp_path / "top.onnx"
    top = torch.jit.load(sample("digits_cnn_top.pt"))
    export_onnx(top, torch.rand(2, 128), path, exporter="legacy", opset=17)
    proto = onnx.load(str(path))
    proto.graph.output[0].name = "logits"
    proto.graph.node[-1].output[0] = "logits"  # Normalizer(logits) -> z
    proto.graph.node.append(l2_normalizer("logits", "z"))
    proto.graph.output[0].name = "z"
    proto.opset_import.append(helper.make_opsetid("ai.onnx.ml", 1))
    onnx.save(proto, str(path))
    return path


def test_onnx_top_model_no_converter_loads_still_measures_utility(tmp_path):
    from splitaudit.stages.utility import utility_section

    contexts = {
        kind: make_context("digits_cnn.pt", "digits.npz", top_model=str(top), noise_sigma=0.5)
        for kind, top in (("torchscript", sample("digits_cnn_top.pt")), ("onnx", onnx_top_with_normalizer(tmp_path)))
    }
    black_box = contexts["onnx"]
    assert black_box.top_model is None and black_box.top_model_forward is not None
    assert any(
        w.startswith("--top-model: operator Normalizer is supported by no converter")
        for w in black_box.encoder.warnings
    )
    utilities = {kind: utility_section(ctx) for kind, ctx in contexts.items()}
    assert utilities["onnx"]["source"] == "top-model" and utilities["onnx"]["status"] == "ok"
    # same noise draws (same seed), same function: the same accuracies, clean and noisy
    for key in ("accuracy", "clean_accuracy"):
        assert utilities["onnx"][key] == pytest.approx(utilities["torchscript"][key], abs=1e-12)
    assert utilities["onnx"]["clean_accuracy"] > 0.8  # the digits split model works
    ctx = dataclasses.replace(black_box, attack_options={"fine-tune": {"head": "top-model"}})
    result = get_attack("fine-tune").run(ctx)
    assert result["status"] == "skipped" and "no converter loads this --top-model" in result["reason"]


def test_converted_vit_runs_without_the_converters_warnings_on_the_terminal(tmp_path):
    """onnx2pytorch's Gather and Slice index with lists, and torch warns about it on each forward
    pass of a ViT graph: lines of a dependency's paths in every audit, which the loader silences."""
    x = torch.rand(4, 3, 32, 32)
    path = export_onnx(build("vit"), x, tmp_path / "vit.onnx", exporter="legacy", opset=17)
    with warnings.catch_warnings(record=True) as seen:
        encoder = encoder_for(path, x)
        encoder.embed(x)
    assert encoder.gradient_mode == "autograd"
    assert [str(w.message)[:80] for w in seen if "onnx2" in w.filename] == []


def test_skl2onnx_scaler_is_rewritten_and_differentiated_exactly(tmp_path):
    """StandardScaler -> PCA as skl2onnx writes it (Scaler in ai.onnx.ml, then Sub and MatMul) ran
    black-box; the Scaler is rewritten as Sub and Mul, so it converts. The map is linear, so its
    Jacobian is the closed form diag(scale) @ W, checked in the VJP."""
    rng = np.random.default_rng(0)
    offset, scale = rng.normal(size=6).astype(np.float32), rng.uniform(0.5, 2, 6).astype(np.float32)
    mean, weights = rng.normal(size=6).astype(np.float32), rng.normal(size=(6, 3)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 3])
    nodes = [
        helper.make_node("Scaler", ["x"], ["s"], domain="ai.onnx.ml", offset=offset.tolist(), scale=scale.tolist()),
        helper.make_node("Sub", ["s", "mean"], ["c"]),
        helper.make_node("MatMul", ["c", "weights"], ["z"]),
    ]
    initializers = [numpy_helper.from_array(mean, "mean"), numpy_helper.from_array(weights, "weights")]
    graph = helper.make_graph(nodes, "pca", [x], [z], initializer=initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=9), str(tmp_path / "pca.onnx"))
    data = torch.rand(8, 6)
    encoder = encoder_for(tmp_path / "pca.onnx", data)
    assert encoder.gradient_mode == "autograd" and not any("Scaler" in w for w in encoder.warnings)
    expected = ((data.numpy() - offset) * scale - mean) @ weights
    for _ in range(2):
        np.testing.assert_allclose(encoder.embed(data).numpy(), expected, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(8, 3)
    vjp = torch.func.vjp(encoder, data)[1](cotangent)[0]
    np.testing.assert_allclose(vjp.numpy(), (cotangent.numpy() @ weights.T) * scale, rtol=1e-5, atol=1e-5)


def test_integer_first_output_names_the_floating_point_outputs_to_choose(tmp_path, capsys):
    """skl2onnx classifiers output (label, probabilities): the label first, int64."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    label = helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"])
    probabilities = helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 4])
    nodes = [
        helper.make_node("Softmax", ["x"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0),
    ]
    path = save_graph(tmp_path / "classifier.onnx", nodes, [x], [label, probabilities])
    np.savez(tmp_path / "rows.npz", x=np.random.default_rng(0).random((20, 4)).astype(np.float32))
    code, _, err = run_cli(["run", path, "--aux", tmp_path / "rows.npz", "--attacks", "none", "--quick"], capsys)
    assert code == 2 and "'label' is tensor(int64)" in err and "with --output-name (probabilities)" in err
