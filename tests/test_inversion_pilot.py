"""The optimisation attack's pilot (attacks/optimization.py `plan_inversion`): on the attacker's own
held-out aux samples it chooses where the inversion starts (the aux mean or a decoder's output), the
Adam step and how many steps to run; it never reads the targets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import sample
from test_hostile_inputs import assert_refused
from test_scale import encoder_of

from splitaudit.attacks import optimization
from splitaudit.attacks.decoder import train_decoder
from splitaudit.attacks.optimization import OptimizationAttack, OptimizationOptions, map_weight, plan_inversion
from splitaudit.context.audit_context import AuditContext
from splitaudit.inputs.data import Dataset
from splitaudit.stages import leakage

SIDE, SEEN_ROWS = 8, 4


def stripes(n: int, seed: int) -> torch.Tensor:
    """n 1x8x8 images, each one bright row (value 0.9) at a random height on a dark ground (0.1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.full((n, 1, SIDE, SIDE), 0.1)
    x[torch.arange(n), 0, torch.randint(0, SIDE, (n,), generator=gen)] = 0.9
    return x


class TopRowDetectors(torch.nn.Module):
    """ReLU(mean of row r - 0.5) for the top SEEN_ROWS rows: a row fires only when it holds the stripe.
    At the aux mean (every row 0.2) no unit fires, so the inversion's gradient there is zero: starting
    from the mean, gradient descent cannot move, and the bottom half is the bottom's null space."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x[:, 0, :SEEN_ROWS].mean(dim=2) - 0.5)


def stripes_context(target: torch.Tensor | None = None) -> AuditContext:
    aux = stripes(200, seed=0)
    target = stripes(64, seed=1) if target is None else target
    options = {"optimization": {"quick_steps": 20, "quick_samples": 32}}
    encoder = encoder_of(TopRowDetectors(), aux)
    return AuditContext(encoder=encoder, aux=Dataset(aux), target=Dataset(target), quick=True, attack_options=options)


def test_the_warm_start_succeeds_where_the_mean_start_cannot_move_and_never_reads_the_targets():
    """From the aux mean the inversion stays at the mean guess (no unit fires there); init=auto sees
    that on its pilot samples, trains the decoder, and the attack beats the mean guess (a decoder
    places every stripe in the seen rows and spreads the rest over the unseen ones: about 0.55 of the
    mean guess). The plan is the same when the targets are noise (never read), and twice the same."""
    ctx = stripes_context()
    attack = OptimizationAttack()
    outcome = attack.run_seed(ctx, 0)
    details = outcome.details
    assert details["pilot_aux_mse"]["mean 0.1"] == pytest.approx(details["pilot_mean_guess"], rel=1e-6)
    assert details["init"] == "decoder"
    assert outcome.metrics["mse"] < 0.75 * outcome.baseline["mse"]

    plan_keys = ("init", "lr", "steps_chosen", "pilot_aux_mse", "pilot_mean_guess")
    noise = torch.rand(64, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(2))
    for again in (attack.run_seed(ctx, 0), attack.run_seed(stripes_context(noise), 0)):
        assert {key: again.details[key] for key in plan_keys} == {key: details[key] for key in plan_keys}

    mean_only = dataclasses.replace(
        ctx, attack_options={"optimization": {**ctx.options("optimization"), "init": "mean"}}
    )
    plain = attack.run_seed(mean_only, 0)
    assert plain.metrics["mse"] == pytest.approx(plain.baseline["mse"], rel=1e-4)  # the plain attack fails


def test_auto_trains_no_decoder_where_the_mean_start_inverts_and_the_pilot_runs_to_the_cap(monkeypatch):
    """An injective linear bottom at noise 0: from any start the inversion keeps converging to the
    input, so the pilot must keep every step (the cap) and, with the mean start far below the mean
    guess, init=auto never trains a decoder (the digits demo's case: it would cost more than the
    inversion). Forced to init=decoder, the refinement from the decoder's output still runs to the cap."""
    torch.manual_seed(0)
    x = torch.randn(120, 6) * torch.tensor([0.5, 1, 2, 1, 0.3, 1.5])
    encoder = encoder_of(torch.nn.Linear(6, 8), x)
    ctx = AuditContext(encoder=encoder, aux=Dataset(x[:80]), target=Dataset(x[80:]), quick=True)
    trained = []
    monkeypatch.setattr(optimization, "train_decoder", lambda *a: trained.append(a) or train_decoder(*a))
    weight = map_weight(ctx)
    for init in ("auto", "decoder"):
        opts = OptimizationOptions(steps=60, lr=0.1, init=init)
        plan = plan_inversion(ctx, 0, ctx.generator(0), opts, weight, None)
        assert plan.stop == 60
        assert min(plan.scores.values()) < 0.01 * plan.mean_guess
        assert plan.init == ("mean" if init == "auto" else "decoder")
        assert len(trained) == (0 if init == "auto" else 1)


def test_the_cost_estimate_of_auto_lies_between_its_two_cases_and_counts_the_decoder_in_the_ceiling():
    """With every encoder pass and every timed step taking 1 s: the targets' inversion is 20 steps x 2
    variants x 32 samples = 1280 passes, each start's pilot 20 x 2 x 4 steps x 8 samples = 1280, the
    decoder 15 epochs x 3 batches (180 training samples of 64) = 45, the two PCA fits 2 x 6 spectra.
    auto's expected time is the geometric mean of the run without the decoder and with it."""
    ctx = stripes_context()
    one_second = lambda step: 1.0
    ranges = {
        init: OptimizationAttack().estimated_range(
            dataclasses.replace(ctx, attack_options={"optimization": {**ctx.options("optimization"), "init": init}}),
            1.0,
            one_second,
        )
        for init in ("auto", "mean", "decoder")
    }
    assert ranges["mean"] == (1280 + 1280 + 12, 1280 + 1280 + 12)
    assert ranges["decoder"] == (1280 + 1280 + 45 + 12, 1280 + 1280 + 45 + 12)
    without, ceiling = 1280 + 1280 + 12, 1280 + 1280 + 1280 + 45 + 12
    assert ranges["auto"] == (pytest.approx(math.sqrt(without * ceiling), rel=1e-12), ceiling)
    assert OptimizationAttack().estimated_seconds(ctx, 1.0, one_second) == ranges["auto"][1]


def test_a_decoder_start_on_token_inputs_is_refused_before_any_measurement(tmp_path, capsys, monkeypatch):
    """Token inputs are inverted as logits over the vocabulary, which a decoder's output does not give:
    init=decoder there is one line on stderr and exit code 2, before anything is measured."""
    monkeypatch.setattr(leakage, "measure", lambda *a, **k: pytest.fail("measured before refusing"))
    args = ["run", sample("text_bottom.onnx"), "--aux", sample("text.npz"), "--vocab", sample("text_vocab.json")]
    args += ["--attacks", "optimization", "--attack-option", "optimization.init=decoder", "--quick"]
    assert_refused(args, capsys, tmp_path, "optimization.init=decoder does not apply to token inputs")


class ExactInverse(torch.nn.Module):
    """The least-squares inverse of an injective linear bottom: at noise 0 it returns each input."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        super().__init__()
        self.input_shape = (layer.out_features,)
        self.pinv, self.bias = torch.linalg.pinv(layer.weight.detach()), layer.bias.detach()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.bias) @ self.pinv.T


def test_the_pilot_keeps_zero_steps_when_the_learned_start_is_already_the_input(monkeypatch):
    """Started at the exact input, any step moves away from it (Adam's step has the full length even
    for a rounding-sized gradient, and the MAP variant's prior pulls off it): the pilot must keep 0
    steps, and the attack then returns the start itself."""
    torch.manual_seed(0)
    x = torch.randn(120, 6)
    layer = torch.nn.Linear(6, 8)
    ctx = AuditContext(encoder=encoder_of(layer, x), aux=Dataset(x[:80]), target=Dataset(x[80:]), quick=True)
    monkeypatch.setattr(optimization, "warm_start_decoder", lambda *a: ExactInverse(layer))
    opts = OptimizationOptions(steps=40, lr=0.1, init="decoder")
    plan = plan_inversion(ctx, 0, ctx.generator(0), opts, map_weight(ctx), None)
    assert plan.init == "decoder" and plan.stop == 0
    assert max(plan.scores.values()) < 1e-10
    options = {"optimization": {"quick_steps": 40, "init": "decoder"}}
    outcome = OptimizationAttack().run_seed(dataclasses.replace(ctx, attack_options=options), 0)
    assert outcome.details["steps_chosen"] == 0 and outcome.metrics["mse"] < 1e-10


def test_a_held_out_split_reuses_the_aux_embeddings_and_keeps_its_own_cache(monkeypatch):
    """with_aux (the warm start's training split) holds the aux samples after the pilot's, their
    embeddings sliced from the context's, never recomputed, and the copy's cache is its own: the
    context keeps every aux sample's embedding (the attack's later steps need them all)."""
    ctx = stripes_context()
    whole = ctx.clean_embeddings("aux")
    monkeypatch.setattr(ctx.encoder, "embed", lambda *a, **k: pytest.fail("aux embedded again"))
    for _ in range(2):
        rest = ctx.with_aux(slice(8, None))
        assert torch.equal(rest.aux.x, ctx.aux.x[8:])
        assert torch.equal(rest.clean_embeddings("aux"), whole[8:])
        assert ctx.clean_embeddings("aux") is whole and len(whole) == len(ctx.aux)
