"""Black-box dFIL by finite differences: the error they carry, against autograd on the same module.

Kinks (Clip, HardSigmoid, ReLU) within the difference step of x bias central differences low: the
quotient averages the slopes on both sides of a kink, and ||mean slope||^2 <= mean ||slope||^2.
A low dFIL overstates the bound, so the estimate must carry that error in its interval."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import splitaudit
from splitaudit.core.result import first_error
from splitaudit.estimators.jacobian import (
    FD_STEP_RATIO,
    TraceEstimate,
    TraceOptions,
    finite_difference_step,
)
from splitaudit.estimators.mean_trace import Z_95, MeanOptions, MeanTrace, estimate_mean_trace
from splitaudit.estimators.methods import jacobian_sq_norm, jacobian_trace
from tests.support.architectures import export_onnx


class KinkedBlock(nn.Module):
    """A MobileNetV3-style block (1x1 expand, depthwise 3x3, 1x1 project) whose kinks are denser than
    the default step (finite_difference_step: eps^(1/3) times the data's scale): the expand layer
    has a high gain and staggered biases, so each channel's HardSigmoid is linear on a window of
    width 6 / gain = 0.002 of the channel mean (as in a high-gain layer of a trained net), then ReLU
    after the depthwise conv and Clip(0, 6) at the end."""

    def __init__(self, gain: float = 3000.0, channels: int = 3, expand: int = 32, out: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.expand = nn.Conv2d(channels, expand, 1)
        self.depthwise = nn.Conv2d(expand, expand, 3, 1, 1, groups=expand)
        self.project = nn.Conv2d(expand, out, 1)
        with torch.no_grad():
            self.expand.weight.fill_(gain / channels)
            self.expand.bias.copy_(-gain * torch.linspace(0, 1, expand))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.depthwise(F.hardsigmoid(self.expand(x))))
        return torch.clamp(6 * self.project(hidden), 0, 6)


class SmoothBlock(nn.Module):
    """The same shapes with smooth activations (tanh, GELU)."""

    def __init__(self, channels: int = 3, expand: int = 16, out: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.expand = nn.Conv2d(channels, expand, 1)
        self.depthwise = nn.Conv2d(expand, expand, 3, 1, 1, groups=expand)
        self.project = nn.Conv2d(expand, out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.project(F.gelu(self.depthwise(torch.tanh(self.expand(x))))))


class Quantised(nn.Module):
    """Embeddings rounded to 1/256 (a quantised output): zero derivative almost everywhere, jumps
    between; the difference quotient over a jump grows like 1 / h as the step shrinks."""

    def __init__(self, d: int, m: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(d, m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(256 * torch.tanh(self.linear(x.flatten(1)))) / 256


class Noisy(nn.Module):
    """Noise drawn inside forward: a difference of two passes holds noise / h, not J v."""

    def __init__(self, d: int, m: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(d, m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.linear(x.flatten(1))
        return z + 1e-3 * torch.randn_like(z)


def images(n: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.rand(n, *shape, generator=torch.Generator().manual_seed(seed))


def black_box(module: nn.Module):
    """The module as a forward-only function: no gradients flow through it."""

    @torch.no_grad()
    def f(x: torch.Tensor) -> torch.Tensor:
        return module(x).detach()

    return f


def fd_mean(module: nn.Module, x: torch.Tensor, seed: int = 3):
    return estimate_mean_trace(black_box(module), x, "finite-difference", MeanOptions(generator=gen(seed)))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(3, 4, 12), (3, 8, 24)])  # input basis (d = 144), Rademacher probes (d = 576)
def test_kinks_bias_the_default_step_low_and_the_chosen_step_carries_its_error(shape):
    net = KinkedBlock().eval()
    x = images(12, shape)
    autograd = float(jacobian_sq_norm(net, x, method="forward").double().mean())  # exact, these samples
    default = jacobian_trace(black_box(net), x, "finite-difference", TraceOptions(fd_step=finite_difference_step(x)))
    assert float(default.values.double().mean()) < 0.9 * autograd  # the default eps^(1/3) step: >= 10% low
    chosen = fd_mean(net, x)
    # the same samples as autograd: only probe noise and the finite-difference error separate them
    probe_se = float(chosen.traces.stderr.double().pow(2).sum().sqrt()) / len(x)
    assert abs(chosen.mean - autograd) <= chosen.fd_error + 3 * probe_se
    assert chosen.fd_error > 0 and not chosen.approximate
    assert chosen.traces.fd_step < finite_difference_step(x) / FD_STEP_RATIO  # the pilot chose a smaller step
    low, high = chosen.interval()
    assert low <= autograd <= high
    assert high == pytest.approx(chosen.mean + Z_95 * chosen.stderr + chosen.fd_error, rel=1e-12)
    check = chosen.check
    assert check["performed"] and check["passed"] and check["mode"] == "finite-difference"
    assert check["fd_step"] == pytest.approx(2 * chosen.traces.fd_step)


def test_on_a_smooth_model_the_two_steps_agree_and_the_interval_stays_tight():
    net = SmoothBlock().eval()
    x = images(12, (3, 4, 12))
    autograd = float(jacobian_sq_norm(net, x, method="forward").double().mean())
    first, second = fd_mean(net, x), fd_mean(net, x)
    assert first.mean == second.mean and first.fd_error == second.fd_error  # same seed, same numbers
    assert first.fd_relative_error < 1e-3 and not first.approximate
    assert first.mean == pytest.approx(autograd, rel=1e-3)
    assert first.fd_choice.converges


@pytest.mark.parametrize("module,shape", [(Quantised(576), (3, 8, 24)), (Noisy(144), (3, 4, 12))])
def test_where_no_step_settles_the_estimate_is_approximate(module, shape):
    mean = fd_mean(module, images(8, shape))
    assert not mean.fd_choice.converges and mean.approximate
    assert math.isfinite(mean.interval()[1])


def test_a_quantised_model_whose_trace_vanishes_at_small_steps_is_approximate_not_zero():
    """Basis directions at small steps rarely cross a quantisation jump: the trace there is 0 (the
    derivative almost everywhere) and the two finest steps agree, but the coarser ones grew as the
    step shrank: the pilot did not settle, so the zero is no guarantee of anything."""
    mean = fd_mean(Quantised(144), images(8, (3, 4, 12)))
    assert mean.mean == 0 and mean.approximate and not mean.fd_choice.converges


def test_a_zero_fine_trace_beside_a_nonzero_coarse_one_is_an_unbounded_error():
    zero = torch.zeros(2)
    traces = TraceEstimate(zero, zero, "finite-difference", True, 2, fd_step=1e-3, fd_error=torch.tensor([0.0, 1.0]))
    mean = MeanTrace(traces, torch.arange(2), mean=0.0, stderr=0.0, rtol=0.02, total_products=4)
    assert mean.fd_relative_error == math.inf and mean.approximate


# --- end to end: an ONNX model that runs black-box ---------------------------------------------


@pytest.fixture
def no_conversion(monkeypatch):
    """ONNX conversion fails, so the audit runs black-box through onnxruntime."""
    import splitaudit.inputs.onnx_loading as onnx_loading

    monkeypatch.setattr(
        onnx_loading,
        "convert_onnx",
        lambda proto, device: iter([onnx_loading.Conversion("test", None, "conversion disabled")]),
    )


AUDIT = dict(attacks="none", noise_sigma=0.5, prior="gaussian", smoothing=0.0, quick=True, seed=0)


def test_black_box_report_carries_the_error_and_contains_the_autograd_value(tmp_path, no_conversion):
    net = KinkedBlock().eval()
    x = images(48, (3, 4, 12)).numpy()
    path = export_onnx(net, torch.as_tensor(x[:2]), tmp_path / "kinked.onnx", exporter="legacy", opset=17)
    white = splitaudit.audit(net, x, **AUDIT)
    black = splitaudit.audit(str(path), x, fail_under_mse=1e-12, **AUDIT)
    assert white["model"]["gradient_mode"] == "autograd" and black["model"]["gradient_mode"] == "finite-difference"
    dfil = black["dfil"]
    fd = dfil["finite_difference"]
    assert dfil["target_index"] == white["dfil"]["target_index"]
    assert dfil["mean_ci"][0] <= white["dfil"]["mean"] <= dfil["mean_ci"][1]
    assert fd["bounded"] and not dfil["approximate"] and fd["dfil_error"] > 0
    assert dfil["mean_upper"] == pytest.approx(dfil["mean"] + Z_95 * dfil["stderr"] + fd["dfil_error"], rel=1e-9)
    assert fd["coarse_step"] == pytest.approx(FD_STEP_RATIO * fd["step"])
    assert black["bounds"]["dfil_used"] == dfil["mean_upper"]
    assert dfil["self_check"]["mode"] == "finite-difference" and dfil["self_check"]["passed"]
    assert any("finite differences" in note and "truncation error" in note for note in dfil["notes"])
    assert black.passed  # bounded error: the gate may pass on the bound
    assert first_error(json.loads(black.to_json())) is None
    assert not white["dfil"]["approximate"] and "finite_difference" not in white["dfil"]


def test_black_box_with_an_unbounded_error_fails_the_bound_gate_naming_it(tmp_path, no_conversion, capsys):
    """A quantised output run black-box: `splitaudit run` exits 1 and the gate names the cause."""
    from splitaudit.cli import main

    x = images(32, (3, 8, 24)).numpy()
    path = export_onnx(Quantised(576).eval(), torch.as_tensor(x[:2]), tmp_path / "quantised.onnx", exporter="legacy")
    np.savez(tmp_path / "data.npz", x=x)
    args = ["run", str(path), "--aux", str(tmp_path / "data.npz"), "--attacks", "none", "--noise-sigma", "0.5"]
    args += ["--prior", "gaussian", "--smoothing", "0", "--quick", "--fail-under-mse", "1e-12"]
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--out", str(tmp_path / "report")])
    assert exit_info.value.code == 1
    assert "approximate" in capsys.readouterr().out
    result = json.loads((tmp_path / "report" / "report.json").read_text())
    assert first_error(result) is None
    assert result["model"]["gradient_mode"] == "finite-difference"
    assert result["dfil"]["approximate"] and not result["dfil"]["finite_difference"]["bounded"]
    assert any("approximate" in note for note in result["bounds"]["notes"])
    (check,) = [c for c in result["gate"]["checks"] if c["name"] == "fail-under-mse"]
    assert not check["passed"] and check["cause"] == "bound-approximate" and "approximate" in check["message"]
    calibrate = ["calibrate", str(path), "--aux", str(tmp_path / "data.npz"), "--target-mse", "0.01", "--quick"]
    with pytest.raises(SystemExit) as exit_info:
        main(calibrate + ["--prior", "gaussian", "--smoothing", "0"])
    assert exit_info.value.code == 0
    assert "The dFIL is approximate" in capsys.readouterr().out
