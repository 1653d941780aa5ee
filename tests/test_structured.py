"""The structured Jacobian trace: exact against plain reverse/forward mode, and it declines
models without local structure (global normalisation, dense layers, hidden couplings)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.func import jacrev

from splitaudit.estimators import jacobian_sq_norm, jacobian_trace, structured
from splitaudit.estimators.jacobian import measure_plan
from splitaudit.estimators.mean_trace import estimate_mean_trace
from splitaudit.estimators.structured import BLOCK, complete_colouring, find_colouring, greedy_colouring

RTOL = 1e-4  # float32 exact methods agree to rounding; 1e-4 leaves room for summation order


def frozen(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for p in module.parameters():
        nn.init.normal_(p, std=0.3)
        p.requires_grad_(False)
    return module.eval()


def local_conv() -> nn.Module:
    """3x32x32 -> 8x16x16, receptive fields of 8x8 input pixels: local, no global coupling."""
    return frozen(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GELU(),
            nn.AvgPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.Tanh(),
        )
    )


@pytest.fixture
def unbudgeted(monkeypatch):
    """The search for structure without its budget: on models this small the plain methods cost about
    as little as the search, which may then stop (the budget's own tests are at the end)."""
    monkeypatch.setattr(structured, "PROBING_SHARE", math.inf)


def colouring(f, x):
    """The colouring searched without a budget (on models this small the budgeted search may stop:
    the plain method costs about as little)."""
    return complete_colouring(f, x, measure_plan(f, x))


class Counting(nn.Module):
    """Counts the samples the wrapped model is evaluated on."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.samples = 0

    def forward(self, x):
        self.samples += len(x)
        return self.inner(x)


def test_exact_on_a_batch_of_a_local_conv_encoder(unbudgeted):
    f = local_conv()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    got = jacobian_trace(f, x, "auto")
    # outputs see 8x8 pixels, so outputs 4 positions apart are disjoint: 4 x 4 x 8 channels = 128
    # colours (inputs would need 8 x 8 x 3 = 192), against min(d, m) = 2048 plain products
    assert got.method == "structured" and got.exact and got.products == 128
    torch.testing.assert_close(got.values, jacobian_sq_norm(f, x, "reverse"), rtol=RTOL, atol=0)
    torch.testing.assert_close(got.values, jacobian_sq_norm(f, x, "forward"), rtol=RTOL, atol=0)


def test_colouring_is_optimal_and_classes_are_disjoint_on_a_single_conv():
    # each output sees a 3x3 patch of pixels: outputs 3 apart are disjoint, and the 3x3 positions
    # x 4 channels that pairwise overlap need 36 colours; pixels 3 apart reach disjoint outputs
    # and the 3x3 pixels x 3 channels that share an output need 27: inputs are coloured, with 27.
    f = frozen(nn.Conv2d(3, 4, 3, padding=1))
    x = torch.rand(2, 3, 8, 8)
    found = colouring(f, x)
    assert found is not None and found.side == "inputs" and found.count == 27
    support = jacrev(lambda xi: f(xi[None])[0])(x[0]).reshape(4 * 64, -1) != 0
    for c in range(found.count):
        members = support[:, found.colour == c].int()
        assert members.sum(dim=1).max() <= 1, f"colour {c} has overlapping supports"
    torch.testing.assert_close(
        jacobian_sq_norm(f, x, "structured"), jacobian_sq_norm(f, x, "reverse"), rtol=RTOL, atol=0
    )


def test_inputs_are_coloured_when_they_need_fewer_products(unbudgeted):
    # 1x16x16 -> 16x16x16: each pixel reaches 3x3 positions in all 16 channels, so outputs need
    # 9 x 16 = 144 colours (more than min(d, m) / MIN_GAIN = 64) but inputs only 3 x 3 = 9.
    f = frozen(nn.Conv2d(1, 16, 3, padding=1))
    x = torch.rand(3, 1, 16, 16)
    got = jacobian_trace(f, x, "auto")
    assert got.method == "structured" and got.products == 9
    assert colouring(f, x).side == "inputs"
    torch.testing.assert_close(got.values, jacobian_sq_norm(f, x, "forward"), rtol=RTOL, atol=0)
    torch.testing.assert_close(got.values, jacobian_sq_norm(f, x, "reverse"), rtol=RTOL, atol=0)


def test_colouring_is_computed_once_per_model_and_shape(unbudgeted):
    """Unbudgeted: whether the budgeted search stops on a model this small depends on the CPU time of a
    few products, so with its budget the first and second lookups could differ by timing alone."""
    f = Counting(local_conv())
    x = torch.rand(2, 3, 32, 32)
    first = colouring(f, x)
    plan = measure_plan(f, x)
    evaluated = f.samples
    assert find_colouring(f, torch.rand(5, 3, 32, 32), plan) is first
    assert f.samples == evaluated
    assert colouring(f, torch.rand(2, 3, 16, 16)) is not first  # a new shape is detected anew


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.LayerNorm(4 * 16 * 16, elementwise_affine=False)),
        nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64)),
    ],
    ids=["layernorm-over-all-features", "linear"],
)
def test_global_coupling_is_detected_as_unstructured_after_one_pass(model):
    f = Counting(frozen(model))
    x = torch.rand(2, 3, 16, 16)
    plan = measure_plan(f, x)
    before = f.samples
    assert find_colouring(f, x, plan) is None
    one_pass = plan.directions_per_chunk(1, structured.DEFAULT_MEMORY_BYTES)
    assert f.samples - before <= 1 + x[0].numel() // BLOCK + one_pass  # stopped at round two's first pass
    assert jacobian_trace(f, x, "auto").method in ("forward", "reverse")
    with pytest.raises(ValueError, match="no"):
        jacobian_sq_norm(f, x, "structured")


class HiddenCoupling(nn.Module):
    """A local conv plus a global term that NaN probes cannot see (nan_to_num masks the NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = frozen(nn.Conv2d(3, 4, 3, padding=1))

    def forward(self, x):
        return self.conv(x) + 0.1 * torch.nan_to_num(x).pow(2).sum(dim=(1, 2, 3))[:, None, None, None]


def test_a_dependency_the_nan_probes_miss_is_caught_by_the_sign_test(monkeypatch):
    x = torch.rand(2, 3, 8, 8)
    assert colouring(HiddenCoupling().eval(), x) is None
    monkeypatch.setattr(structured, "sign_test", lambda *args: True)
    assert colouring(HiddenCoupling().eval(), x) is not None  # the probes alone are fooled


def test_the_sample_digits_cnn_with_layernorm_is_unstructured(digits_ctx):
    encoder = digits_ctx.encoder
    assert colouring(encoder, digits_ctx.target.x[:2]) is None


def test_greedy_colouring_separates_rows_that_share_a_column_and_respects_the_limit():
    supports = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    colour = greedy_colouring(supports, limit=4)
    for a in range(5):
        for b in range(a):
            if (supports[a] & supports[b]).any():
                assert colour[a] != colour[b]
    assert colour.tolist() == [0, 1, 0, 1, 0]
    assert greedy_colouring(supports, limit=1) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 convs round to ~1e-3
    f = local_conv()
    x = torch.rand(2, 3, 32, 32)
    cpu = jacobian_sq_norm(f, x, "structured")
    gpu = jacobian_sq_norm(f.cuda(), x.cuda(), "structured")
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=RTOL, atol=0)


def test_a_search_past_its_budget_stops_and_the_plain_exact_method_runs(monkeypatch):
    """With no budget left the search stops at its first check: auto falls back to the plain exact
    method (the same traces), says why, and the structured method asked for by name still runs."""
    monkeypatch.setattr(structured, "PROBING_SHARE", 0.0)
    f = local_conv()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    search = structured.search_structure(f, x, measure_plan(f, x))
    assert search.stopped and search.colouring is None and search.budget == 0.0 < search.seconds
    assert "stopped at its budget, 0% of the CPU time" in search.reason
    exact = jacobian_trace(f, x, "auto")
    assert exact.method == "reverse"
    torch.testing.assert_close(exact.values, jacobian_sq_norm(f, x, "structured"), rtol=RTOL, atol=0)
    mean = estimate_mean_trace(f, x)  # on two samples random probes cost less than 2048 products each
    assert mean.choice.startswith("random probes (Hutchinson): the cheapest exact method would take 4096 products")
    assert (
        "it is reverse mode (exact): 2048 products per sample (one per output); no structured method: " in mean.choice
    )
    assert "the search for local structure was stopped at its budget" in mean.choice


def test_the_search_runs_within_a_share_of_the_plain_method_and_the_choice_says_so():
    f = local_conv()
    x = torch.rand(64, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    mean = estimate_mean_trace(f, x)
    search = structured.search_structure(f, x, measure_plan(f, x))
    assert mean.traces.method == "structured" and not search.stopped
    assert 0 < search.seconds <= search.budget
    # the budget is PROBING_SHARE of 2048 products on each of 64 samples; 128 are measured per sample
    assert mean.choice.startswith("the structured method (exact): 128 products per sample against 2048 for reverse")
    assert "each output depends on a local patch of inputs" in mean.choice
