"""Memory at real image sizes: saved-activation accounting, the prior's score networks, the
optimisation attack's chunked inversion and the raw-input baselines' dimension reduction, on
real architectures (tests/support/architectures.py) at 3x64x64 with tiny widths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitaudit.attacks.base import MIN_SEEDS
from splitaudit.attacks.kmeans import cluster_scores
from splitaudit.attacks.optimization import fit_prior, invert
from splitaudit.attacks.parts.features import COMPONENTS, reduced
from splitaudit.core import memory
from splitaudit.estimators.prior import (
    QUICK_SCORE_SETTINGS,
    MultiScaleResidual,
    ScoreSettings,
    estimate_prior,
    make_score_net,
    within_work_cap,
)
from splitaudit.inputs.models import Encoder
from splitaudit.stages.cost import StepTimer
from tests.support.architectures import build


def smooth_images(n: int, size: int, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth random colour fields in [0, 1] whose mean colour depends on the class."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    colours = torch.rand(classes, 3, 1, 1, generator=gen)
    field = F.interpolate(torch.randn(n, 3, size // 8, size // 8, generator=gen), size=(size, size), mode="bilinear")
    return (colours[y] + 0.1 * field).clamp(0, 1), y


def encoder_of(module: torch.nn.Module, x: torch.Tensor) -> Encoder:
    for p in module.parameters():
        p.requires_grad_(False)
    out = module(x[:1])
    return Encoder(
        path="mem",
        format="torch",
        input_shape=tuple(x.shape[1:]),
        output_shape=tuple(out.shape[1:]),
        device=torch.device("cpu"),
        torch_fn=module,
        blackbox_fn=module,
        fixed_batch=None,
        parity_max_abs_err=None,
        stochastic=False,
        warnings=[],
        providers=[],
    )


def test_saved_bytes_counts_what_autograd_keeps():
    x = torch.randn(8, 1000, requires_grad=True)
    assert memory.saved_bytes(lambda: x.exp()) == 8 * 1000 * 4  # exp saves its output only
    assert memory.batch_within(per_sample=100, cap=64, budget=1000) == 10
    assert memory.batch_within(per_sample=10**12, cap=64) == 1


def test_score_network_for_224px_images_has_no_resolution_sized_layer():
    """A dense or wide full-resolution layer at 3x224x224 would hold millions of parameters;
    the multi-scale net stays under 40k and its activations per sample under 64 MiB."""
    x = torch.rand(3, 3, 224, 224)
    net = make_score_net(x, torch.arange(3), noise=0.25, seed=0)
    assert isinstance(net.residual, MultiScaleResidual)
    assert sum(p.numel() for p in net.parameters()) < 40_000
    assert torch.equal(net.residual(x), torch.zeros_like(x))  # starts at the Gaussian estimate
    point = x[:1].clone().requires_grad_(True)
    bytes_ = memory.saved_bytes(lambda: torch.autograd.grad(net(point).sum(), point, create_graph=True))
    assert bytes_ < 64 * 2**20


@pytest.mark.parametrize("method", ["ssm", "dsm"])
def test_score_matching_on_64px_images_runs_in_bounded_batches(method, monkeypatch):
    """With a 4 MiB activation budget the batches shrink to fit; the estimate is finite and what
    the bound uses lies between the Gaussian floor and Stam's limit (16 at tau 0.25) whether or
    not two epochs sufficed; the same call twice gives the same value."""
    x, _ = smooth_images(40, 64)
    settings = ScoreSettings(max_epochs=2, patience=2, batch_size=32)
    first = estimate_prior(x, method, smoothing=0.25, settings=settings)
    monkeypatch.setattr(memory, "ACTIVATION_BUDGET", 4 * 2**20)
    small = estimate_prior(x, method, smoothing=0.25, settings=settings)
    assert small.details["batch_size"] < first.details["batch_size"] <= 32
    assert np.isfinite(small.j_over_d) and (small.valid or small.notes)
    assert small.gaussian_floor <= small.j_over_d_used <= small.stam_limit
    assert estimate_prior(x, method, smoothing=0.25, settings=settings).j_over_d == pytest.approx(small.j_over_d)


def test_work_cap_bounds_score_training_and_leaves_small_inputs_alone():
    """samples x epochs x d stays within max_work (epochs cut first, down to 3, then samples);
    the digits-sized case (1x8x8, 1797 samples) and the unit tests' sizes are not cut."""
    for settings in (ScoreSettings(), QUICK_SCORE_SETTINGS):
        assert within_work_cap(1797, 64, settings) == settings
        assert within_work_cap(3000, 4, settings) == settings
        for n, d in ((100, 3 * 224 * 224), (5000, 3 * 224 * 224), (400, 3 * 64 * 64), (10, 10**7)):
            capped = within_work_cap(n, d, settings)
            n_train = min(n, capped.max_samples) - max(1, round(capped.heldout_fraction * min(n, capped.max_samples)))
            assert 1 <= capped.max_epochs <= settings.max_epochs and capped.patience <= capped.max_epochs
            assert n_train * capped.max_epochs * d <= settings.max_work or capped.max_samples == 2
    quick = within_work_cap(100, 3 * 224 * 224, QUICK_SCORE_SETTINGS)
    assert quick.max_epochs == 3 and quick.max_samples < 100  # 1e7 / 150528 = 66 sample-steps


@pytest.mark.parametrize("method", ["ssm", "dsm"])
def test_capped_score_matching_states_the_cut_and_keeps_its_checks(method):
    """With a cap of 6 sample-steps at 3x64x64, training is cut, the prior's details and notes say
    so, and what the bound uses still lies between the Gaussian floor and Stam's limit."""
    x, _ = smooth_images(40, 64)
    settings = ScoreSettings(max_work=6 * x[0].numel())
    estimate = estimate_prior(x, method, smoothing=0.25, settings=settings)
    assert estimate.details["work_capped"] and estimate.details["max_epochs"] == 3
    assert estimate.details["n_train"] * estimate.details["epochs"] <= 6
    assert any("work cap" in note for note in estimate.notes)
    assert estimate.gaussian_floor <= estimate.j_over_d_used <= estimate.stam_limit
    uncapped = estimate_prior(x, method, smoothing=0.25, settings=ScoreSettings(max_epochs=2, patience=2))
    assert not uncapped.details["work_capped"]


def test_inversion_in_memory_sized_chunks_equals_one_batch(monkeypatch):
    """Adam is per coordinate and the loss a sum over samples: chunking (forced here by a tiny
    budget) must give the same reconstructions, on a ResNet-style stem at 3x64x64."""
    x, _ = smooth_images(6, 64)
    encoder = encoder_of(build("resnet", width=4, blocks=1), x)
    z = encoder.embed(x)
    weights = torch.full((len(z),), 0.01)
    whole = invert(encoder, z, x, fit_prior(x, "gaussian", unit_range=True), weights, steps=5, lr=0.1, unit_range=True)
    monkeypatch.setattr(memory, "ACTIVATION_BUDGET", 1)  # one sample per chunk
    chunked = invert(
        encoder, z, x, fit_prior(x, "gaussian", unit_range=True), weights, steps=5, lr=0.1, unit_range=True
    )
    assert torch.allclose(whole, chunked, atol=1e-5)
    start = x.mean(0, keepdim=True).expand_as(x)
    assert float((encoder.embed(chunked) - z).pow(2).sum()) < float((encoder.embed(start) - z).pow(2).sum())


def test_raw_inputs_over_4096_dimensions_are_reduced_and_still_cluster():
    """k-means' baseline on 3x64x64 raw inputs (12,288 dims) runs on 256 principal components at
    most (n - 1 here) and still finds the colour classes (accuracy > 0.9 against chance 0.25)."""
    x, y = smooth_images(80, 64)
    (points,), info = reduced(x)
    assert points.shape == (80, min(COMPONENTS, 79)) and info["dimensions"] == 12288
    assert "PCA" in info["reduction"] and 0 < info["explained_variance"] <= 1 + 1e-5  # float32 sums
    assert cluster_scores(points, y.numpy(), 4, seed=0)["accuracy"] > 0.9
    (small,), none = reduced(torch.rand(10, 64))
    assert small.shape == (10, 64) and none["reduction"] == "none"


def _cost_context(size: int, quick: bool = False, attack_options: dict | None = None):
    from splitaudit.context.audit_context import AuditContext
    from splitaudit.inputs.data import Dataset

    x, y = smooth_images(32, size)
    return AuditContext(
        encoder=encoder_of(build("resnet"), x),
        aux=Dataset(x=x[:16], y=y[:16]),
        target=Dataset(x=x[16:], y=y[16:]),
        quick=quick,
        attack_options=attack_options or {},
    )


class FixedTimer(StepTimer):
    """The cost estimate's timer with every step taking `seconds`: each step runs once, for real."""

    def __init__(self, seconds: float) -> None:
        super().__init__(cpu_bound=True)
        self.seconds, self.calls = seconds, 0

    def __call__(self, step) -> float:
        step()
        self.calls += 1
        return self.seconds


def _cost(size: int, prior: str, quick: bool = False):
    from splitaudit.stages.cost import estimate_cost

    return estimate_cost(_cost_context(size, quick), prior, 0.25, ["optimization", "kmeans"])


@pytest.mark.parametrize("ablation", [False, True])
def test_sdar_cost_is_a_timed_iteration_times_every_iteration_of_every_seed_and_variant(ablation):
    """SDAR's estimate times its own training iteration on the model and data (one real iteration
    here, its time fixed at 0.5 s) and multiplies by iterations x seeds x variants (3 with the
    ablation: without d1 and without d2): at most all seeds' whole cap; about MIN_SEEDS seeds (seeds
    by spread) of the share of the cap early stopping is expected to leave (EXPECTED_SHARE) where it
    is on (asked for here: this context has no top model); where it is off (by default without a
    top model, and under --quick) the whole cap runs."""
    from splitaudit.attacks.sdar import EXPECTED_SHARE, sdar_settings
    from splitaudit.stages import cost

    timed = FixedTimer(0.5)
    default = _cost_context(16, attack_options={"sdar": {"ablation": ablation}})
    assert sdar_settings(default).stopping is None
    per_seed = sdar_settings(default).iterations * (3 if ablation else 1) * 0.5
    assert cost.estimate_cost(default, "gaussian", 0.25, ["sdar"], timer=timed).stages["sdar"] == pytest.approx(
        MIN_SEEDS * per_seed
    )
    timed = FixedTimer(0.5)
    ctx = _cost_context(16, attack_options={"sdar": {"ablation": ablation, "early_stopping": True}})
    estimate = cost.estimate_cost(ctx, "gaussian", 0.25, ["sdar"], timer=timed)
    settings = sdar_settings(ctx)
    per_seed = settings.iterations * (3 if ablation else 1) * 0.5
    assert estimate.ceilings["sdar"] == pytest.approx(len(ctx.seeds) * per_seed) and estimate.not_estimated == []
    assert settings.stopping is not None and len(ctx.seeds) > MIN_SEEDS
    assert estimate.stages["sdar"] == pytest.approx(MIN_SEEDS * per_seed * EXPECTED_SHARE)
    assert timed.calls == 2  # the encoder pass and one SDAR iteration
    quick = _cost_context(16, quick=True, attack_options={"sdar": {"ablation": ablation}})
    assert sdar_settings(quick).stopping is None
    quick_seconds = sdar_settings(quick).iterations * (3 if ablation else 1) * 0.5
    assert cost.estimate_cost(quick, "gaussian", 0.25, ["sdar"], timer=timed).stages["sdar"] == pytest.approx(
        quick_seconds
    )


@pytest.mark.parametrize("size, epochs", [(16, 300), (224, 51)])
def test_prior_cost_expects_its_early_stop_and_caps_at_its_epoch_cap(size, epochs):
    """The score network stops by itself after 115-166 of its 300 epochs (estimators/prior.py), so
    its expected time is EXPECTED_EPOCHS of them and its ceiling all 300; where the work cap
    cuts training to fewer epochs, both are those epochs (224 px: 1e8 / (3 x 224 x 224) = 664
    sample-epochs over 13 training samples, 51 epochs). The timed step is one on the training's
    batch (the 13 training samples, fewer where their activations would not fit), its time fixed
    at 1 ms a sample of it: an epoch is (16 samples + 3 held-out evaluations) x 1 ms."""
    from splitaudit.estimators.prior import EXPECTED_EPOCHS, score_training_step
    from splitaudit.stages import cost

    ctx = _cost_context(size)
    batch = score_training_step(ctx.aux.x, "ssm", 0.25, 13)[1]
    assert 1 <= batch <= 13 and (size == 224 or batch == 13)
    expected, ceiling = cost.prior_seconds(ctx, "ssm", 0.25, lambda _step: batch * 1e-3)
    assert ceiling == pytest.approx(epochs * 19 * 1e-3)
    assert expected == pytest.approx(min(epochs, EXPECTED_EPOCHS) * 19 * 1e-3)


def test_cost_estimate_is_positive_finite_and_grows_with_the_input():
    """Per-stage seconds on a ResNet-style stem: every estimated stage positive and finite, the
    attack without a cost model listed as not estimated, and 224 px costing more than 16 px
    (196x the pixels; a factor 3 leaves room for 5x timing noise seen on a busy machine). Not the
    prior alone: 16 px may train to its 300-epoch cap where the work cap cuts 224 px to a few
    epochs (measured 5.7 s against 9.5 s, too close for timing noise). The large one is timed
    first: passes in a fresh process's first seconds ran up to 50x slower here."""
    large, small = _cost(224, "dsm"), _cost(16, "dsm")
    for estimate in (small, large):
        assert set(estimate.stages) == {"dFIL", "prior (dsm)", "optimization"}
        assert all(np.isfinite(s) and s > 0 for s in estimate.stages.values())
        assert estimate.not_estimated == ["kmeans"] and "not estimated: kmeans" in estimate.summary()
    assert large.total > 3 * small.total
    assert large.stages["optimization"] > 3 * small.stages["optimization"]
    assert "--quick is faster" in large.summary()


def test_quick_cost_plans_less_work_than_the_full_one(monkeypatch):
    """--quick's estimate is below the full one's at the same size. The encoder's pass time is fixed
    here: timed twice on a busy machine, two passes differed by more than the 2x that --quick saves
    on the optimization attack (it failed 2 runs in 14), and this test is about the planned work."""
    from splitaudit.stages import cost

    monkeypatch.setattr(cost, "encoder_pass_seconds", lambda ctx, timer: 1e-3)
    full, quick = _cost(64, "gaussian"), _cost(64, "gaussian", quick=True)
    assert "--quick" not in quick.summary() and "--quick is faster" in full.summary()
    assert quick.stages["prior (gaussian)"] == 0
    assert quick.stages["optimization"] < full.stages["optimization"]
    assert quick.stages["dFIL"] <= full.stages["dFIL"]


def test_cli_prints_the_cost_estimate_on_stderr_only_for_long_audits(tmp_path, monkeypatch, capsys):
    """Above COST_NOTICE_SECONDS the estimate is one line on stderr (stages under a second are not
    named; a busy machine may add the stages' progress lines); below it (the digits sample takes seconds) nothing is printed. The digits are below the
    size worth estimating, so that floor is lowered here; at its default no timing runs at all."""
    from conftest import sample

    from splitaudit import cli
    from splitaudit.stages import cost

    monkeypatch.setattr(cost, "MIN_VALUES_TO_ESTIMATE", 0)

    args = [
        "run",
        sample("digits_mlp.pt"),
        "--aux",
        sample("digits.npz"),
        "--attacks",
        "optimization,kmeans",
        "--prior",
        "gaussian",
        "--quick",
        "--out",
        str(tmp_path / "a"),
    ]
    for threshold, expected in ((1e9, False), (0.0, True)):
        monkeypatch.setattr(cli, "COST_NOTICE_SECONDS", threshold)
        with pytest.raises(SystemExit):
            cli.main(args)
        err = capsys.readouterr().err
        assert ("this audit may take about" in err) == expected
        estimate = [line for line in err.splitlines() if "this audit may take" in line]
        others = [line for line in err.splitlines() if line not in estimate]
        assert not expected or (len(estimate) == 1 and "not estimated: kmeans" in estimate[0])
        assert all(" done after " in line for line in others), others  # progress lines of a loaded machine
    monkeypatch.setattr(cost, "MIN_VALUES_TO_ESTIMATE", 2**20)
    monkeypatch.setattr(cost, "estimate_cost", lambda *a, **k: pytest.fail("the digits are not worth estimating"))
    with pytest.raises(SystemExit):
        cli.main(args)


def test_embedding_reports_progress_batch_by_batch(monkeypatch):
    """Embedding a data part moves its progress bar by each batch's samples up to the part's size
    (batches forced small), and the cached second call opens no bar."""
    import io

    from tqdm import tqdm

    from splitaudit.context.audit_context import AuditContext
    from splitaudit.inputs.data import Dataset

    bars, steps = [], []

    def progress(**kwargs):
        bars.append(tqdm(file=io.StringIO(), **kwargs))
        bars[-1].update = lambda n=1, bar=bars[-1]: (steps.append(n), tqdm.update(bar, n))
        return bars[-1]

    x, y = smooth_images(20, 32)
    monkeypatch.setattr(memory, "FORWARD_VALUES", 6 * x[0].numel())
    ctx = AuditContext(
        encoder=encoder_of(build("resnet"), x), aux=Dataset(x=x[:14]), target=Dataset(x=x[14:]), progress=progress
    )
    first = ctx.clean_embeddings("aux")
    assert steps == [6, 6, 2] and bars[0].n == 14 and bars[0].desc == "embedding aux"
    assert torch.equal(ctx.clean_embeddings("aux"), first) and len(bars) == 1


def test_decoder_cost_is_a_timed_step_times_the_steps_of_every_capped_epoch_and_seed():
    """The decoder's ceiling is a real training step on a batch of the model's embeddings (its time
    fixed at 0.5 s here) times the steps of its epoch cap for every seed; its expected time the
    share of the cap early stopping is expected to leave (EXPECTED_SHARE) for the MIN_SEEDS seeds
    that always run; the summary shows both. The quick cap of 15 epochs is expected to run whole."""
    from splitaudit.attacks.decoder import EXPECTED_SHARE
    from splitaudit.stages import cost

    timed = FixedTimer(0.5)
    ctx = _cost_context(16)  # 16 aux samples: 2 held out, 14 trained on in one batch of 64
    estimate = cost.estimate_cost(ctx, "gaussian", 0.25, ["decoder"], timer=timed)
    assert estimate.stages["decoder"] == pytest.approx(MIN_SEEDS * 200 * 1 * 0.5 * EXPECTED_SHARE)
    assert estimate.ceilings["decoder"] == pytest.approx(len(ctx.seeds) * 200 * 1 * 0.5)
    assert estimate.ceiling - estimate.total == pytest.approx((len(ctx.seeds) - MIN_SEEDS * EXPECTED_SHARE) * 200 * 0.5)
    assert f"(at most {cost.duration(estimate.ceiling)})" in estimate.summary()
    quick = cost.estimate_cost(_cost_context(16, quick=True), "gaussian", 0.25, ["decoder"], timer=timed)
    assert quick.stages["decoder"] == quick.ceilings["decoder"] == pytest.approx(1 * 15 * 1 * 0.5)
    assert "at most" not in quick.summary()
