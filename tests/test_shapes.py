"""Every input shape: anisotropic images (3x48x192 text lines, 1x64x400 spectrograms)
and 1-D sequences (C x T from 1-D conv bottoms) in every attack and estimator.

The networks the attacks build grow per axis and never past the input (a 16x3x96 map headed
for 48x192 must not pass through 24x768 as it did), sequences get 1-D networks, and the battery
runs on a 1-D conv audio bottom written in tests/support/architectures.py with every attack ok and the
reconstruction attacks better than their baseline. (The text-line and spectrogram batteries take
longer than a slow test's 600 s on 2 cores: benchmarks/shapes_scale.py measures the text line, on
a bottom trained briefly by `train_briefly`: the optimization attack is ok there from its learned
start, SDAR still fails; benchmarks/RESULTS.md says why.)
"""

from __future__ import annotations

import math

import pytest
import torch

import splitaudit
from splitaudit.attacks.optimization import _difference_count, fit_prior, total_variation
from splitaudit.attacks.parts.nets import Decoder, generic_encoder, stage_sizes
from splitaudit.attacks.parts.sdar_training import D2_CONVS, D2_SIDE, d1_discriminator, discriminator
from splitaudit.core.input_space import decide_space
from splitaudit.estimators import jacobian_sq_norm
from splitaudit.inputs.models import open_model, prepare_encoder
from tests.support.architectures import build, export_onnx, export_torchscript
from tests.support.shaped_data import audio_clips

TEXT_LINE, TEXT_EMBEDDING = (3, 48, 192), (16, 3, 96)
SPECTROGRAM, SPECTROGRAM_EMBEDDING = (1, 64, 400), (16, 4, 200)
AUDIO, AUDIO_EMBEDDING = (1, 1024), (16, 128)


def test_stage_sizes_grow_the_positions_4x_per_stage_and_never_pass_the_target():
    """Each stage grows the positions by Table IX's 4x, shared among the axes still short of the
    target: 3x96 -> 48x192 doubles both axes once, then quadruples the height alone (three stages
    where doubling one axis at a time took four); 1-D sequences quadruple; nothing passes the
    target, and square maps keep Table IX's stages (8x8 -> 32x32: 16x16, 32x32)."""
    assert stage_sizes((3, 96), (48, 192)) == [(6, 192), (24, 192), (48, 192)]
    assert stage_sizes((4, 200), (64, 400)) == [(8, 400), (32, 400), (64, 400)]
    assert stage_sizes((8, 8), (32, 32)) == [(16, 16), (32, 32)]
    assert stage_sizes((7, 7), (32, 32)) == [(14, 14), (28, 28), (32, 32)]
    assert stage_sizes((5,), (28,)) == [(20,), (28,)]
    assert stage_sizes((128,), (1024,)) == [(512,), (1024,)]
    assert stage_sizes((16, 16), (16, 16)) == []


@pytest.mark.parametrize(
    "size, target",
    [((3, 96), (48, 192)), ((4, 200), (64, 400)), ((2, 3), (50, 7)), ((16,), (1000,)), ((6, 6), (6, 99))],
)
def test_every_stage_grows_at_most_4x_and_lands_on_the_target(size, target):
    """Against the rule itself on odd shapes: positions at most 4x the previous map's, every axis
    within the target and never shrinking, the last map the target."""
    previous = size
    for stage in stage_sizes(size, target):
        assert math.prod(stage) <= 4 * math.prod(previous)
        assert all(p <= s <= t for p, s, t in zip(previous, stage, target))
        previous = stage
    assert previous == target


def upsampled_sizes(decoder: Decoder, z: torch.Tensor, y: torch.Tensor | None) -> list[tuple[int, ...]]:
    """The map size after every Upsample layer of a decoder's forward pass."""
    sizes = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: sizes.append(tuple(out.shape[2:])))
        for m in decoder.body
        if isinstance(m, torch.nn.Upsample)
    ]
    decoder(z, y)
    for hook in hooks:
        hook.remove()
    return sizes


@pytest.mark.parametrize(
    "embedding, sample",
    [(TEXT_EMBEDDING, TEXT_LINE), (SPECTROGRAM_EMBEDDING, SPECTROGRAM), (AUDIO_EMBEDDING, AUDIO)],
    ids=["text-line", "spectrogram", "audio"],
)
def test_decoder_grows_per_axis_never_past_the_input_and_costs_no_more_than_table_ix(embedding, sample):
    """Every intermediate map fits inside the input on every axis; sequences get Conv1d layers;
    no conv is wider than Table IX's for a map of as many positions (its last 32x32 stage: ConvT
    16, the conv before them 32; widths times sqrt(1024 / positions), rounded up), so a layer
    costs about what Table IX's last stage costs instead of growing with the positions."""
    decoder = Decoder(embedding, decide_space(sample, True, tokens=False), num_classes=2)
    z, y = torch.randn(2, *embedding), torch.tensor([0, 1])
    sizes = upsampled_sizes(decoder, z, y)
    assert sizes[-1] == sample[1:]
    assert all(s <= t for size in sizes for s, t in zip(size, sample[1:]))
    assert decoder(z, y).shape == (2, *sample)
    convs = [m for m in decoder.body.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)]
    assert all(m.weight.dim() == len(sample) + 1 for m in convs)  # Conv1d for (C, T), Conv2d for images
    stage = dict(zip([id(m) for m in decoder.body], range(len(decoder.body))))
    size = embedding[1:]
    for m in decoder.body:
        if isinstance(m, torch.nn.Upsample):
            size = tuple(m.size)
        elif isinstance(m, torch.nn.modules.conv._ConvNd) and stage[id(m)] < len(decoder.body) - 1:
            assert m.out_channels <= 2 * math.ceil(16 * math.sqrt(32 * 32 / math.prod(size)))


def test_text_line_decoder_is_several_times_cheaper_than_doubling_both_axes():
    """The same decoder built the old way (both axes doubled per stage, 24x768 at 64 channels)
    cost 596 GFLOP per training step of 32 lines (torch's FLOP counter); per axis it must cost
    under a tenth of that. Four stages doubling one axis at a time cost 11.2 GFLOP; three that
    grow the positions 4x each (Table IX's factor) 8.9, under 10."""
    from torch.utils.flop_counter import FlopCounterMode

    decoder = Decoder(TEXT_EMBEDDING, decide_space(TEXT_LINE, True, tokens=False), num_classes=2)
    z, y, x = torch.randn(32, *TEXT_EMBEDDING), torch.randint(0, 2, (32,)), torch.rand(32, *TEXT_LINE)
    with FlopCounterMode(display=False) as counter:
        (decoder(z, y) - x).pow(2).mean().backward()
    assert counter.get_total_flops() < 10e9


@pytest.mark.parametrize(
    "sample, embedding", [(TEXT_LINE, TEXT_EMBEDDING), (AUDIO, AUDIO_EMBEDDING), (SPECTROGRAM, SPECTROGRAM_EMBEDDING)]
)
def test_generic_encoder_halves_each_axis_down_to_the_embedding(sample, embedding):
    """The simulator of an unknown architecture maps the input's shape to the embedding's with
    strided convolutions (1-D for sequences), and trains: every weight gets a gradient."""
    encoder = generic_encoder(decide_space(sample, True, tokens=False), embedding)
    x = torch.rand(3, *sample)
    z = encoder(x)
    assert z.shape == (3, *embedding)
    z.pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters())
    strided = [m for m in encoder.modules() if isinstance(m, torch.nn.modules.conv._ConvNd) and max(m.stride) > 1]
    halvings = [math.ceil(math.log2(s / t)) for s, t in zip(sample[1:], embedding[1:])]
    assert len(strided) == max(halvings)


@pytest.mark.parametrize("shape", [TEXT_LINE, TEXT_EMBEDDING, AUDIO, AUDIO_EMBEDDING, SPECTROGRAM])
def test_discriminators_take_every_shape_with_a_label_channel(shape):
    """d1 and d2 give one logit per sample for images, sequences and their embeddings; a stride
    never shrinks an axis of length 1 to nothing."""
    y = torch.tensor([0, 1, 1])
    for net in (d1_discriminator(shape, 2), discriminator(shape, 2, D2_CONVS, D2_SIDE, last_activation=True)):
        logits = net(torch.randn(3, *shape), y)
        assert logits.shape == (3,) and torch.isfinite(logits).all()


def test_large_maps_get_narrower_discriminators_and_square_ones_keep_table_ix():
    """48x192 lines (9x Table IX's 32x32 positions): d2 widths a third of Table IX's (21-85);
    32x32 keeps 64-256."""
    widths = lambda shape: [
        m.out_channels
        for m in discriminator(shape, 2, D2_CONVS, D2_SIDE, True).modules()
        if isinstance(m, torch.nn.Conv2d)
    ]
    assert widths((3, 32, 32)) == [64, 128, 128, 256]
    assert widths(TEXT_LINE) == [21, 43, 43, 85]


def test_total_variation_of_a_hand_made_sequence_and_the_tv_prior_on_sequences():
    """1-D TV is the sum of |x[t+1] - x[t]| over time per channel: [0, 1, 1, 3] and [2, 2, 2, 2]
    give 3; a (2, 4) sample has 2 x 3 differences. The prior fitted to sequences is finite."""
    x = torch.tensor([[[0.0, 1.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]]])
    assert total_variation(x).item() == pytest.approx(3.0)
    assert _difference_count((2, 4)) == 6
    assert _difference_count((1, 3, 5)) == 2 * 5 + 3 * 4
    neg_log_prior = fit_prior(torch.rand(10, 2, 16), "tv", unit_range=True)
    assert torch.isfinite(neg_log_prior(torch.rand(3, 2, 16))).all()


BATTERY_OPTIONS = {
    "decoder": {"quick_epochs": 30, "patience": 30},
    "sdar": {"iterations": 60},
    "optimization": {"quick_steps": 60, "quick_samples": 16},
    "fine-tune": {"epochs": 100},
}


def audited(tmp_path, architecture: str, data, n_aux: int, n_target: int, **kwargs):
    """A quick `--attacks all` audit (noise 0.01: the dFIL is finite, the embeddings still leak)
    of a traced bottom of `architecture` on generated data."""
    x, y, attr = data(n_aux + n_target)
    model = build(architecture, seed=0, **kwargs)
    path = export_torchscript(model, torch.from_numpy(x[:2]), tmp_path / f"{architecture}.pt")
    part = lambda s: (x[s], y[s], attr[s])
    return splitaudit.audit(
        str(path),
        part(slice(0, n_aux)),
        part(slice(n_aux, None)),
        attacks="all",
        noise_sigma=0.01,
        prior="gaussian",
        quick=True,
        attack_options=BATTERY_OPTIONS,
    )


def assert_every_attack_ok_and_reconstructions_beat_the_baseline(result) -> None:
    attacks = dict(result["attacks"])
    for name in ("token-inversion", "sequential-inversion"):
        assert attacks.pop(name)["status"] == "skipped"  # they need token inputs (--vocab)
    assert set(attacks) == {"fine-tune", "kmeans", "attribute", "decoder", "optimization", "sdar"}
    assert {name: entry["status"] for name, entry in attacks.items()} == dict.fromkeys(attacks, "ok")
    for name in ("decoder", "optimization", "sdar"):
        assert attacks[name]["metrics"]["mse"] < attacks[name]["baseline"]["mse"], name
    assert 0 < result["dfil"]["mean"] < math.inf and result["bounds"]["van_trees_mse"] > 0


@pytest.mark.slow
def test_battery_on_a_1d_conv_audio_bottom(tmp_path):
    """1x1024 clips -> 16x128 (strided Conv1d + BatchNorm1d + GELU); data not in [0, 1]."""
    result = audited(tmp_path, "audio1d", audio_clips, 160, 80)
    assert tuple(result["model"]["output_shape"]) == AUDIO_EMBEDDING
    assert_every_attack_ok_and_reconstructions_beat_the_baseline(result)


@pytest.mark.parametrize("exporter", ["torchscript", "onnx-legacy", "onnx-dynamo"])
def test_an_lstm_bottom_gives_autograd_gradients_that_agree_with_finite_differences(tmp_path, exporter):
    """An LSTM over 1x64 series: on CPU the oneDNN LSTM kernel in eval mode keeps no backward
    workspace ("got None for argument 'workspace'", an internal error before) and has no forward-mode
    AD. The encoder's gradients flow, in every format, and their dFIL matches central differences
    of the same encoder within 2% (the finite differences' own error is far smaller; checked twice)."""
    x, _, _ = audio_clips(8, length=64)
    model = build("lstm", seed=0, in_channels=1)
    sample_x = torch.from_numpy(x[:2])
    if exporter == "torchscript":
        path = export_torchscript(model, sample_x, tmp_path / "lstm.pt")
    else:
        style = exporter.split("-")[1]
        path = export_onnx(
            model, sample_x, tmp_path / "lstm.onnx", exporter=style, opset=13 if style == "legacy" else 18
        )
    inputs = torch.from_numpy(x)
    encoder = prepare_encoder(open_model(path, torch.device("cpu")), inputs)
    assert encoder.gradient_mode == "autograd"
    for _ in range(2):
        for method in ("reverse", "forward"):
            exact = jacobian_sq_norm(encoder, inputs, method=method).double()
            assert torch.allclose(exact, finite_difference_sq_norm(encoder, inputs), rtol=0.02), method


def finite_difference_sq_norm(f, x: torch.Tensor, step: float = 1e-3) -> torch.Tensor:
    """||J_f(x_i)||_F^2 by central differences in float64 along every input coordinate (the reference)."""
    flat = x.flatten(1).double()
    total = torch.zeros(len(x), dtype=torch.float64)
    with torch.no_grad():
        for i in range(flat.shape[1]):
            shift = torch.zeros_like(flat)
            shift[:, i] = step
            up, down = (f((flat + s).view_as(x).float()).double() for s in (shift, -shift))
            total += ((up - down) / (2 * step)).flatten(1).pow(2).sum(1)
    return total


def test_score_network_of_sequences_is_a_1d_conv_net_starting_at_the_gaussian_score():
    """The ssm prior's score network on (C, T) sequences is convolutional along time (no dense
    layer over C x T, so long series fit) and starts at the fitted Gaussian's score."""
    from splitaudit.estimators.prior import make_score_net

    x = torch.randn(20, 2, 300)
    net = make_score_net(x, torch.arange(15), noise=0.1, seed=0)
    assert any(isinstance(m, torch.nn.Conv1d) for m in net.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in net.modules())
    assert torch.allclose(net(x[:3]), -(x[:3] - net.mean) * net.precision)


def test_train_briefly_gives_a_bottom_trained_statistics_and_spread_between_samples():
    """The benchmarks' stand-in for a user's trained bottom: after train_briefly the first
    BatchNorm's running mean and variance are those of its input over the training data
    (computed here independently from the conv's output), the model is in eval mode, and the
    embeddings of different clips differ by much more than a random bottom's."""
    from tests.support.architectures import train_briefly

    x, y, _ = audio_clips(64)
    x, y = torch.from_numpy(x), torch.from_numpy(y).long()
    random_bottom = build("audio1d", seed=0)
    with torch.no_grad():
        random_spread = float(random_bottom(x).std(0).mean() / random_bottom(x).std())
    model = train_briefly(build("audio1d", seed=0), x, y, epochs=2)
    conv, norm = model.body[0], model.body[1]
    with torch.no_grad():
        h = conv(x)
        z = model(x)
    assert not model.training
    assert torch.allclose(norm.running_mean, h.mean((0, 2)), atol=1e-5)
    assert torch.allclose(norm.running_var, h.var((0, 2)), rtol=1e-3)  # unbiased, as BatchNorm keeps it
    assert float(z.std(0).mean() / z.std()) > max(0.3, 2 * random_spread)
