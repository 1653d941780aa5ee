"""The dFIL trace engine on real architectures: every export format and method against reverse
mode (called repeatedly), the mean estimator's interval, the runtime cross-check, memory with
parameters that require grad, the cost of choosing a method, and a float64 reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from splitaudit.estimators import jacobian_sq_norm, jacobian_trace, mean_trace
from splitaudit.estimators.jacobian import TraceOptions, forward_mode_works, measure_plan
from splitaudit.estimators.mean_trace import MeanOptions, TraceCheckError, estimate_mean_trace
from splitaudit.estimators.structured import find_colouring
from splitaudit.inputs.models import open_model, prepare_encoder
from tests.support.architectures import BasicBlock, build, export_onnx, export_torchscript

EXACT_RTOL = 1e-4  # float32 exact methods agree to rounding and summation order
Z = 5.0  # a random estimate lies within 5 of its standard errors of the truth (p ~ 6e-7)

EXPORTS = ["trace", "script", "dynamo", "legacy17", "legacy20"]


def small(arch: str) -> nn.Module:
    kwargs = {"resnet": {"width": 4, "blocks": 2}, "mobilenet": {"width": 4}, "vit": {"dim": 8, "depth": 1}}[arch]
    return build(arch, image_size=16, **kwargs) if arch == "vit" else build(arch, **kwargs)


def exported(model: nn.Module, x: torch.Tensor, how: str, folder: Path) -> Path:
    if how in ("trace", "script"):
        return export_torchscript(model, x, folder / "m.pt", how)
    if how == "dynamo":
        return export_onnx(model, x, folder / "m.onnx", "dynamo")
    return export_onnx(model, x, folder / "m.onnx", "legacy", int(how[len("legacy") :]))


@pytest.mark.parametrize(
    "arch,how",
    [("resnet", how) for how in EXPORTS]
    + [(arch, how) for arch in ("mobilenet", "vit") for how in ("trace", "script", "dynamo", "legacy17")]
    + [("vit", "legacy20")],
)
def test_every_method_matches_reverse_mode_on_every_call(arch, how, tmp_path):
    model = small(arch)
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    encoder = prepare_encoder(open_model(exported(model, x, how, tmp_path), torch.device("cpu")), x)
    assert encoder.differentiable, encoder.warnings  # ViT legacy exports once fell back to black-box
    truth = jacobian_sq_norm(model, x, method="reverse")
    methods = ["reverse", "auto"] + (["forward"] if forward_mode_works(encoder, x) else [])
    for _ in range(2):  # TorchScript's executor re-optimises after its first runs: call repeatedly
        for method in methods:
            torch.testing.assert_close(jacobian_sq_norm(encoder, x, method=method), truth, rtol=EXACT_RTOL, atol=0)
        est = jacobian_trace(encoder, x, "hutchinson", TraceOptions(rtol=0.0, min_probes=16, max_probes=16))
        assert bool(((est.values - truth).abs() <= Z * est.stderr).all()), (est.values, truth)


def test_a_traced_attention_model_falls_back_to_reverse_probes(tmp_path):
    """PyTorch's fused CPU attention has no forward-mode derivative: auto and Hutchinson use reverse mode."""
    model = small("vit")
    x = torch.rand(8, 3, 16, 16)
    encoder = prepare_encoder(open_model(exported(model, x, "trace", tmp_path), torch.device("cpu")), x)
    assert not forward_mode_works(encoder, x)
    result = estimate_mean_trace(encoder, x, "hutchinson", MeanOptions(generator=torch.Generator().manual_seed(0)))
    assert result.traces.method == "hutchinson-reverse" and result.check["mode"] == "reverse"
    truth = float(jacobian_sq_norm(model, x, method="reverse").double().mean())
    assert abs(result.mean - truth) <= Z * result.stderr


# --- the mean estimator --------------------------------------------------------------------------


def resnet_stem() -> nn.Module:
    return build("resnet", width=8, blocks=2)


@pytest.mark.parametrize("seed", range(2))
def test_randomised_mean_reaches_its_rtol_and_its_interval_holds_the_exact_mean(seed):
    model = resnet_stem()
    x = torch.rand(32, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    options = MeanOptions(rtol=0.02, generator=torch.Generator().manual_seed(seed))
    result = estimate_mean_trace(model, x, "auto", options)
    assert result.traces.method == "hutchinson" and not result.traces.exact
    assert result.stderr <= 0.02 * result.mean
    exact = jacobian_sq_norm(model, x[result.index], method="reverse").double()
    # the interval is for the mean over the data; the exact mean over the same samples lies within
    # Z standard errors (probe noise only is smaller than the reported error)
    assert abs(result.mean - float(exact.mean())) <= Z * result.stderr
    assert result.total_products < 0.1 * len(x) * 3 * 32 * 32  # >10x fewer products than exact
    assert result.check["passed"] and result.check["mode"] == "reverse"


def test_auto_stays_exact_when_that_is_cheap():
    a = torch.randn(6, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(20, 10, dtype=torch.float64)
    result = estimate_mean_trace(lambda v: v @ a.T, x)
    assert result.traces.exact and result.traces.method == "reverse"
    assert result.mean == pytest.approx(float(a.pow(2).sum()), rel=1e-12) and result.stderr < 1e-9


def test_the_leakiest_samples_are_refined_to_their_own_rtol():
    model = resnet_stem()
    x = torch.rand(32, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    x[:4] *= 3  # brighter inputs, larger Jacobians through ReLU
    result = estimate_mean_trace(
        model, x, "hutchinson", MeanOptions(rtol=0.02, generator=torch.Generator().manual_seed(1))
    )
    top = torch.argsort(result.traces.values, descending=True)[:5]
    counts_ok = result.traces.stderr[top] <= 0.02 * result.traces.values[top]
    assert bool(counts_ok.all())


# --- the runtime cross-check ---------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.0, 0.5, 2.0])
def test_a_wrong_exact_trace_stops_with_a_trace_check_error(factor, monkeypatch):
    model = resnet_stem()
    x = torch.rand(6, 3, 16, 16)
    real = mean_trace.jacobian_trace

    def wrong(*args, **kwargs):
        est = real(*args, **kwargs)
        est.values = est.values * factor
        return est

    monkeypatch.setattr(mean_trace, "jacobian_trace", wrong)
    with pytest.raises(TraceCheckError, match="self-check failed"):
        estimate_mean_trace(model, x, "forward")


@pytest.mark.parametrize("factor", [0.0, 2.0])
def test_a_wrong_randomised_trace_is_caught(factor, monkeypatch):
    real = mean_trace.probe_sums

    def wrong(f, x, side, *args):
        sums = real(f, x, side, *args)
        if side == "inputs":  # the method's products; the check uses reverse mode
            sums[1:] *= torch.tensor([[factor], [factor**2]], dtype=sums.dtype)
        return sums

    monkeypatch.setattr(mean_trace, "probe_sums", wrong)
    with pytest.raises(TraceCheckError):
        estimate_mean_trace(resnet_stem(), torch.rand(16, 3, 16, 16), "hutchinson")


@pytest.mark.parametrize("seed", range(6))
def test_the_cross_check_raises_no_false_alarm(seed):
    """Right answers across seeds and models pass (CHECK_Z = 5 standard errors)."""
    model = [resnet_stem(), small("mobilenet"), small("vit")][seed % 3]
    x = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    for method in ("reverse", "hutchinson"):
        result = estimate_mean_trace(model, x, method, MeanOptions(generator=torch.Generator().manual_seed(seed)))
        assert result.check["passed"]


def test_the_cli_exits_3_without_a_report_when_the_check_fails(tmp_path, monkeypatch, capsys):
    from conftest import sample

    from splitaudit.cli import main

    def wrong(*args, **kwargs):
        raise TraceCheckError("Jacobian trace self-check failed: test")

    monkeypatch.setattr(mean_trace, "cross_check", wrong)
    out = tmp_path / "report"
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "run",
                sample("digits_cnn.pt"),
                "--aux",
                sample("digits.npz"),
                "--attacks",
                "none",
                "--prior",
                "gaussian",
                "--quick",
                "--out",
                str(out),
            ]
        )
    assert exit_.value.code == 3
    assert "self-check failed" in capsys.readouterr().err
    assert not (out / "report.json").exists()


@pytest.mark.parametrize("flag,value", [("--dfil-rtol", "0"), ("--dfil-rtol", "1.5"), ("--dfil-samples", "1")])
def test_dfil_flags_are_validated(flag, value, capsys):
    from conftest import sample

    from splitaudit.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", sample("digits_cnn.pt"), "--aux", sample("digits.npz"), flag, value])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


# --- memory and the cost of choosing --------------------------------------------------------------

PEAK_RSS = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from tests.support.architectures import build
from splitaudit.estimators import jacobian_sq_norm
torch.set_num_threads(1)
model = build("resnet", width=16)
for p in model.parameters():
    p.requires_grad_({grad})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
values = jacobian_sq_norm(model, torch.rand(4, 3, 32, 32), method={method!r}, memory_bytes=32 * 2**20)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["reverse", "forward"])
def test_parameters_that_require_grad_cost_no_extra_memory(method):
    """Before the fix, reverse mode kept every chunk's graph: 680 MiB more than frozen here."""
    root = str(Path(__file__).resolve().parents[1])
    peak = {
        grad: float(
            subprocess.run(
                [sys.executable, "-c", PEAK_RSS.format(root=root, grad=grad, method=method)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for grad in (True, False)
    }
    assert peak[True] <= 1.5 * peak[False] + 64, peak  # MiB


class Counting(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.samples = inner, 0

    def forward(self, x):
        self.samples += len(x)
        return self.inner(x)


def test_choosing_a_method_for_an_attention_model_costs_a_few_forward_passes():
    f = Counting(build("vit", image_size=32, dim=16, depth=2))
    x = torch.rand(2, 3, 32, 32)
    plan = measure_plan(f, x)
    before = f.samples
    assert find_colouring(f, x, plan) is None
    assert f.samples - before <= 1 + 8  # the finite check and one batch of single-input NaN probes


# --- agreement with the definition (the dFIL paper's calc_tr computes the same sum) -----------------


class CifarResNetSplit(nn.Module):
    """A CIFAR-style ResNet (3x3 stem) cut after its 7th layer: conv, bn, relu and four basic blocks."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.blocks = nn.Sequential(
            BasicBlock(width, width),
            BasicBlock(width, width),
            BasicBlock(width, 2 * width, 2),
            BasicBlock(2 * width, 2 * width),
        )

    def forward(self, x):
        return self.blocks(F.relu(self.bn(self.conv(x))))


def reference_sq_norm(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """||J(x_i)||_F^2 in float64 from the definition: one JVP per input basis vector e_k (vmapped
    over chunks of 512 basis vectors), on a float64 copy of the model."""
    reference = CifarResNetSplit(4).eval()
    reference.load_state_dict(model.state_dict())
    reference = reference.double()
    values = []
    for xi in x.double():
        basis = torch.eye(xi.numel(), dtype=torch.float64).view(-1, 1, *xi.shape)
        with torch.no_grad():
            products = [
                torch.func.vmap(lambda e: torch.func.jvp(reference, (xi[None],), (e,))[1])(chunk)
                for chunk in basis.split(512)
            ]
        values.append(sum(p.pow(2).sum() for p in products))
    return torch.stack(values)


def test_cifar_resnet_split_at_layer_7_matches_the_float64_definition():
    torch.manual_seed(0)
    model = CifarResNetSplit(4).eval()
    with torch.no_grad():
        for bn in [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]:
            bn.running_var.uniform_(0.5, 1.5)
            bn.running_mean.uniform_(-0.1, 0.1)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    reference = reference_sq_norm(model, x)
    for method in ("forward", "reverse", "auto"):
        got = jacobian_sq_norm(model, x, method=method).double()
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("method", ["hutchinson", "reverse"])
def test_shards_give_the_same_estimate_wherever_they_run(method):
    """The products come in shards with their own seeds, drawn in order: shards that travel
    (pickled, as to a worker process) and finish in any order give exactly the estimate computed
    here, and every sample is reported to the progress callback once."""
    import pickle

    model, x = resnet_stem(), torch.rand(150, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    options = lambda runner=None: MeanOptions(rtol=0.1, generator=torch.Generator().manual_seed(3), runner=runner)
    seen = []

    def travelling(jobs, on_samples):
        results = {}
        for i in reversed(range(len(jobs))):  # out of order, each a pickled copy
            results[i] = pickle.loads(pickle.dumps(jobs[i])).run(model)
            on_samples(len(jobs[i].x))
        seen.append(len(jobs))
        return [results[i] for i in range(len(jobs))]

    here = estimate_mean_trace(model, x, method, options())
    counted = []
    there = estimate_mean_trace(model, x, method, options(travelling), on_samples=counted.append)
    assert torch.equal(here.traces.values, there.traces.values) and torch.equal(here.index, there.index)
    assert (here.mean, here.stderr) == (there.mean, there.stderr) and there.check["passed"]
    assert sum(seen) > 1 and sum(counted) >= len(there.index)
