"""The input space: one rule decides the kind of the audited inputs, the context applies it once,
and the result and the reports read it (nothing else looks at shapes or values to guess it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from splitaudit.context.audit_context import AuditContext
from splitaudit.core.input_space import INPUT_KINDS, KIND_METRICS, TEXT_METRICS, InputSpace, decide_space
from splitaudit.inputs.data import Dataset
from splitaudit.inputs.models import prepare_encoder, wrap_module
from splitaudit.inputs.tokens import TokenSpace
from splitaudit.reports import charts


@pytest.mark.parametrize(
    "shape, unit_range, tokens, kind, spatial_axes",
    [
        ((3, 32, 32), True, False, "image", 2),
        ((1, 128, 40), False, False, "image", 2),  # a one-channel spectrogram is an image
        ((2, 16), False, False, "sequence", 1),  # channels over time, never an image without its channel axis
        ((1, 500), True, False, "sequence", 1),
        ((29,), False, False, "tabular", 0),
        ((2, 4, 8, 8), True, False, "tabular", 0),  # four axes: no network convolves them, treated as flat
        ((16, 32), False, True, "tokens", 0),  # token embeddings T x D: positions are not a signal's axis
        ((16, 32), True, True, "tokens", 0),
    ],
)
def test_one_rule_decides_the_kind_from_the_shape_and_the_declared_tokens(
    shape, unit_range, tokens, kind, spatial_axes
):
    space = decide_space(shape, unit_range, tokens)
    assert (space.kind, space.sample_shape, space.spatial_axes) == (kind, shape, spatial_axes)
    assert space.unit_range == (unit_range and not tokens), "token embeddings are never a [0, 1] space"


def test_each_kind_names_its_metrics_and_its_continuous_view():
    assert set(KIND_METRICS) == set(INPUT_KINDS)
    assert decide_space((1, 8, 8), True, False).metrics == {"ssim"}
    assert decide_space((4, 3), False, True).metrics == TEXT_METRICS
    assert decide_space((2, 16), False, False).metrics == decide_space((8,), False, False).metrics == frozenset()
    assert "embeddings" in decide_space((4, 3), False, True).continuous_view
    declared = ("mse", "psnr", "ssim", "token_accuracy")
    assert decide_space((8,), False, False).leaves_out(declared) == {"ssim", "token_accuracy"}
    assert decide_space((1, 8, 8), True, False).leaves_out(declared) == {"token_accuracy"}
    assert decide_space((4, 3), False, True).leaves_out(declared) == {"ssim"}


def tiny_context(x: torch.Tensor, tokens: TokenSpace | None = None) -> AuditContext:
    data = Dataset(x=x, token_ids=None if tokens is None else torch.zeros(len(x), x.shape[1], dtype=torch.long))
    encoder = prepare_encoder(
        wrap_module(nn.Sequential(nn.Flatten(), nn.Linear(x[0].numel(), 3)), torch.device("cpu")), x
    )
    return AuditContext(encoder=encoder, aux=data, target=data, tokens=tokens)


def test_the_context_decides_the_space_once_from_the_attackers_data():
    x = torch.rand(6, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    ctx = tiny_context(x)
    assert ctx.space == InputSpace("image", (1, 4, 4), unit_range=True)
    assert tiny_context(x * 2).space.unit_range is False
    # A copy for another noise level keeps the space it was given (it is not decided again).
    assert ctx.at_sigma(0.5).space is ctx.space
    assert dataclasses.replace(ctx, aux=dataclasses.replace(ctx.aux, x=x * 2)).space is ctx.space
    table = torch.rand(5, 3, generator=torch.Generator().manual_seed(1))  # every value in [0, 1]
    tokens = tiny_context(
        table[torch.randint(0, 5, (6, 4), generator=torch.Generator().manual_seed(2))], TokenSpace(table, list("abcde"))
    )
    assert tokens.space == InputSpace("tokens", (4, 3), unit_range=False)


def test_real_audits_record_the_kind_beside_the_old_flags(real_audit, cancer_ctx):
    data = real_audit["data"]
    assert (data["input_kind"], data["is_image"], data["in_unit_range"]) == ("image", True, True)
    assert cancer_ctx.space == InputSpace("tabular", (29,), unit_range=True)  # the bundled rows are scaled to [0, 1]


def two_examples(shape: tuple[int, ...]) -> list[dict]:
    values = torch.rand(2, *shape, generator=torch.Generator().manual_seed(0)).tolist()
    return [
        {"label": label, "mse": 0.1, "original": v, "reconstruction": v} for label, v in zip(("best", "worst"), values)
    ]


@pytest.mark.parametrize(
    "kind, shape, drawn",
    [
        ("image", (1, 6, 6), "_image_grid"),
        ("image", (3, 6, 6), "_image_grid"),
        ("image", (4, 6, 6), "_feature_profiles"),  # four channels: imshow cannot show them
        ("sequence", (3, 16), "_feature_profiles"),  # was drawn as a 3 x 16 picture from its shape
        ("tokens", (8, 32), "_feature_profiles"),
        ("tabular", (29,), "_feature_profiles"),
    ],
)
def test_reconstructions_are_drawn_as_images_for_the_image_kind_only(kind, shape, drawn, monkeypatch):
    calls = []
    for name in ("_image_grid", "_feature_profiles"):
        original = getattr(charts, name)
        monkeypatch.setattr(charts, name, lambda examples, _o=original, _n=name: calls.append(_n) or _o(examples))
    png = charts.reconstructions_chart(two_examples(shape), kind)
    assert calls == [drawn] and png.startswith(b"\x89PNG")


def test_an_attack_is_skipped_on_a_kind_it_does_not_declare_naming_the_kinds_it_runs_on():
    from splitaudit.attacks.kmeans import KMeansAttack

    class ImagesOnly(KMeansAttack):
        input_kinds = frozenset({"image", "sequence"})

    rows = tiny_context(torch.randn(8, 5, generator=torch.Generator().manual_seed(0)))
    entry = ImagesOnly().run(rows)
    assert entry["status"] == "skipped"
    assert entry["reason"] == "not built for tabular inputs; it runs on image, sequence inputs"
