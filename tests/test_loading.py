"""Model and data loading: formats, parity with onnxruntime, opsets, shapes, fallbacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import sample
from PIL import Image

from splitaudit.core.errors import InputError
from splitaudit.inputs.data import load_dataset, split_dataset
from splitaudit.inputs.models import open_model, prepare_encoder
from tests.support.architectures import export_onnx

CPU = torch.device("cpu")


def encoder_for(path, x, normalize=None):
    return prepare_encoder(open_model(path, CPU), x, normalize)


@pytest.fixture(scope="module")
def digits():
    return load_dataset(sample("digits.npz"))


class SmoothNet(nn.Module):
    """Conv + BatchNorm + GELU + AveragePool + LayerNorm: the operators of current exporters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.AvgPool2d(2)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 12)

    def forward(self, x):
        h = self.pool(nn.functional.gelu(self.bn(self.conv(x))))
        return self.head(self.norm(h.flatten(1)))


@pytest.fixture(scope="module")
def opset20_pair(tmp_path_factory):
    """The same smooth net exported by current torch as ONNX opset 20 and as TorchScript."""
    torch.manual_seed(0)
    net = SmoothNet().eval()
    net.bn.running_mean.uniform_(-0.5, 0.5)
    net.bn.running_var.uniform_(0.5, 2.0)
    folder = tmp_path_factory.mktemp("opset20")
    example = torch.rand(2, 1, 8, 8)
    export_onnx(net, example, folder / "net.onnx", opset=20)
    torch.jit.trace(net, example).save(str(folder / "net.pt"))
    return folder / "net.onnx", folder / "net.pt", net


def test_opset20_onnx_is_differentiable_and_matches_torchscript(opset20_pair, digits):
    onnx_path, ts_path, net = opset20_pair
    import onnx

    ops = {n.op_type for n in onnx.load(str(onnx_path)).graph.node}
    assert {"Gelu", "AveragePool", "LayerNormalization"} <= ops
    x = digits.x[:50]
    from_onnx, from_ts = encoder_for(onnx_path, x), encoder_for(ts_path, x)
    assert from_onnx.gradient_mode == "autograd"
    assert from_onnx.parity_max_abs_err < 1e-4
    with torch.no_grad():
        expected = net(x)
    # Same embeddings from both formats and from the original module (float32 round-off).
    torch.testing.assert_close(from_onnx.embed(x), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(from_ts.embed(x), expected, rtol=1e-4, atol=1e-5)
    assert from_onnx.output_shape == (12,)


@pytest.mark.parametrize("stem", ["digits_cnn", "digits_mlp"])
def test_sample_models_agree_across_formats(stem, digits):
    x = digits.x[:64]
    onnx_enc, ts_enc = encoder_for(sample(f"{stem}.onnx"), x), encoder_for(sample(f"{stem}.pt"), x)
    assert onnx_enc.format == "onnx" and ts_enc.format == "torchscript"
    assert onnx_enc.parity_max_abs_err < 1e-4
    torch.testing.assert_close(onnx_enc.embed(digits.x), ts_enc.embed(digits.x), rtol=1e-4, atol=1e-5)
    assert not onnx_enc.stochastic and not onnx_enc.warnings


def test_fixed_batch_onnx_runs_any_number_of_samples(tmp_path, digits):
    torch.manual_seed(1)
    net = SmoothNet().eval()
    export_onnx(net, torch.rand(4, 1, 8, 8), tmp_path / "fixed.onnx", opset=20, fixed_batch=True)
    enc = encoder_for(tmp_path / "fixed.onnx", digits.x[:10])
    assert enc.fixed_batch == 4
    with torch.no_grad():
        torch.testing.assert_close(enc.embed(digits.x[:11]), net(digits.x[:11]), rtol=1e-4, atol=1e-5)


def test_blackbox_fallback_when_conversion_fails(tmp_path, digits, monkeypatch):
    import splitaudit.inputs.onnx_loading as onnx_loading

    monkeypatch.setattr(
        onnx_loading,
        "convert_onnx",
        lambda proto, device: iter([onnx_loading.Conversion("onnx2pytorch", None, "onnx2pytorch failed (test)")]),
    )
    enc = encoder_for(sample("digits_cnn.onnx"), digits.x[:20])
    assert enc.gradient_mode == "finite-difference" and not enc.differentiable
    assert any("black-box" in w for w in enc.warnings)
    reference = encoder_for(sample("digits_cnn.pt"), digits.x[:20])
    torch.testing.assert_close(enc.embed(digits.x[:20]), reference.embed(digits.x[:20]), rtol=1e-4, atol=1e-5)


def test_blackbox_fallback_when_parity_is_off(digits, monkeypatch):
    import splitaudit.inputs.models as models

    real = models._blackbox_fn

    def skewed(raw, mean, std):
        fn = real(raw, mean, std)
        return lambda x: fn(x) + 0.1

    monkeypatch.setattr(models, "_blackbox_fn", skewed)
    enc = encoder_for(sample("digits_cnn.onnx"), digits.x[:20])
    assert not enc.differentiable
    assert enc.parity_max_abs_err == pytest.approx(0.1, rel=1e-3)


class Dropoutish(nn.Module):
    """A randomized encoder (like R3eLU): fresh noise on every forward pass."""

    def forward(self, x):
        return x.flatten(1) + 0.1 * torch.randn(x.shape[0], x[0].numel())


class ReluNet(nn.Module):
    def forward(self, x):
        return torch.relu(nn.functional.max_pool2d(x, 2)).flatten(1)


def test_stochastic_and_non_smooth_models_are_reported(tmp_path, digits):
    x = digits.x[:8]
    torch.jit.script(Dropoutish()).save(str(tmp_path / "noisy.pt"))
    assert encoder_for(tmp_path / "noisy.pt", x).stochastic
    torch.jit.trace(ReluNet(), x).save(str(tmp_path / "relu.pt"))
    relu = encoder_for(tmp_path / "relu.pt", x)
    assert not relu.stochastic
    assert any("non-smooth" in w and "relu" in w and "max_pool2d" in w for w in relu.warnings)


class FunctionalReluNet(nn.Module):
    """F.relu and F.max_pool2d: scripted, each sits inside a prim::If block of the graph."""

    def forward(self, x):
        return nn.functional.relu(nn.functional.max_pool2d(x, 2, 2)).flatten(1)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_non_smooth_operators_inside_a_scripted_graphs_blocks_are_reported(tmp_path, digits, how):
    """A scripted module's F.relu lands in a control-flow block (its inplace branch) that a walk of the
    graph's top-level nodes missed: the scripted model got no non-smooth warning, the traced one did."""
    x = digits.x[:8]
    module = torch.jit.script(FunctionalReluNet()) if how == "script" else torch.jit.trace(FunctionalReluNet(), x)
    module.save(str(tmp_path / "relu.pt"))
    warnings = encoder_for(tmp_path / "relu.pt", x).warnings
    assert any("non-smooth" in w and "relu" in w for w in warnings), warnings


class ScaledGeluNet(nn.Module):
    """Smooth, but scripted F.interpolate computes its output size with aten::floor on a float."""

    def forward(self, x):
        return nn.functional.gelu(nn.functional.interpolate(x, scale_factor=1.5, mode="bilinear")).flatten(1)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_operators_on_sizes_are_not_reported_as_kinks(tmp_path, digits, how):
    """A floor of the output size is not a kink of the map from inputs to embeddings: no non-smooth
    warning (the scripted graph has an aten::floor on a float, the traced one none)."""
    x = digits.x[:8]
    module = torch.jit.script(ScaledGeluNet()) if how == "script" else torch.jit.trace(ScaledGeluNet(), x)
    module.save(str(tmp_path / "scaled.pt"))
    assert not any("non-smooth" in w for w in encoder_for(tmp_path / "scaled.pt", x).warnings)


def test_normalization_is_folded_into_the_encoder(digits):
    x = digits.x[:16]
    plain = encoder_for(sample("digits_cnn.pt"), x)
    folded = encoder_for(sample("digits_cnn.pt"), x, normalize=(0.5, 0.25))
    torch.testing.assert_close(folded.embed(x), plain.embed((x - 0.5) / 0.25))


def test_npz_flat_samples_are_reshaped_to_the_model_input(tmp_path):
    np.savez(tmp_path / "flat.npz", x=np.random.rand(10, 64).astype(np.float32), y=np.arange(10) % 3)
    data = load_dataset(tmp_path / "flat.npz", input_shape=(1, 8, 8))
    assert data.sample_shape == (1, 8, 8) and data.num_classes == 3


def test_csv_with_label_and_attribute_columns(tmp_path):
    rows = ["a,b,label,sex"] + [f"{i},{i * 2},{'cat' if i % 2 else 'dog'},{i % 3 == 0}" for i in range(12)]
    (tmp_path / "d.csv").write_text("\n".join(rows))
    data = load_dataset(tmp_path / "d.csv", label_column="label", attr_column="sex")
    assert data.sample_shape == (2,)
    assert data.class_names == ["cat", "dog"] and data.y.tolist()[:2] == [1, 0]
    assert data.attr.sum().item() == 4


def test_image_folder_is_resized_to_the_model_and_scaled(tmp_path):
    for cls, value in (("cats", 0), ("dogs", 255)):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.new("RGB", (20, 16), (value, value, value)).save(tmp_path / cls / f"{i}.png")
    data = load_dataset(tmp_path, input_shape=(1, 8, 8))
    assert data.sample_shape == (1, 8, 8) and data.class_names == ["cats", "dogs"]
    assert data.x[:3].max() == 0 and data.x[3:].min() == 1


def test_split_is_seeded_and_disjoint():
    from splitaudit.inputs.data import Dataset

    data = Dataset(x=torch.arange(100.0).reshape(100, 1), source="ids")
    aux, target = split_dataset(data, 0.5, seed=3)
    again, _ = split_dataset(data, 0.5, seed=3)
    other, _ = split_dataset(data, 0.5, seed=4)
    ids_aux, ids_target = set(aux.x.flatten().tolist()), set(target.x.flatten().tolist())
    assert len(ids_aux) == len(ids_target) == 50 and not ids_aux & ids_target
    assert torch.equal(aux.x, again.x) and not torch.equal(aux.x, other.x)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "not a valid ONNX model"),
        (b"this is not a model at all", "not a valid ONNX model"),
    ],
)
def test_non_models_are_rejected(tmp_path, content, message):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        open_model(path, CPU)


def test_truncated_onnx_is_rejected(tmp_path):
    data = open(sample("digits_cnn.onnx"), "rb").read()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="truncated or corrupt"):
        open_model(path, CPU)


def test_pickled_torch_model_is_rejected_with_advice(tmp_path):
    path = tmp_path / "eager.pt"
    torch.save(nn.Linear(3, 2), path)
    with pytest.raises(InputError, match="torch.jit.trace"):
        open_model(path, CPU)


class SeveralOutputs(nn.Module):
    """A bottom that returns its feature map and a pooled vector, as a tuple or, like Hugging Face
    models, a dict."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor):
        z = torch.tanh(self.conv(x))
        return {"hidden": z, "pooled": z.mean((2, 3))} if self.as_dict else (z, z.mean((2, 3)))


@pytest.mark.parametrize(("as_dict", "names"), [(False, ("0", "1")), (True, ("hidden", "pooled"))])
def test_torchscript_with_several_outputs_audits_the_chosen_one(tmp_path, as_dict, names):
    """Refused before ("returns tuple, not one tensor"); now the first output, or --output-name's,
    as for ONNX models. The reference is the module's own output."""
    module = SeveralOutputs(as_dict).eval()
    path = tmp_path / "several.pt"
    torch.jit.trace(module, torch.rand(2, 3, 9, 9), strict=False).save(str(path))
    x = torch.rand(5, 3, 9, 9)
    with torch.no_grad():
        expected = module(x)
    expected = list(expected.values()) if as_dict else list(expected)
    first = prepare_encoder(open_model(path, CPU), x)
    assert any("auditing" in note and "--output-name" in note for note in first.warnings)
    for index, name in enumerate(names):
        encoder = first if index == 0 else prepare_encoder(open_model(path, CPU, output_name=name), x)
        for _ in range(2):
            torch.testing.assert_close(encoder.embed(x), expected[index])
    with pytest.raises(InputError, match="--output-name 'logits'"):
        prepare_encoder(open_model(path, CPU, output_name="logits"), x)


def test_output_name_on_a_torchscript_model_with_one_output_is_refused(tmp_path):
    path = tmp_path / "one.pt"
    torch.jit.trace(nn.Conv2d(3, 2, 3).eval(), torch.rand(1, 3, 5, 5)).save(str(path))
    with pytest.raises(InputError, match="returns one tensor"):
        open_model(path, CPU, output_name="0")
