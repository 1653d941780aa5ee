"""Hostile models and odd data: a model whose answers change
between calls, one that edits its weights, outputs or derivatives beyond float32, data too small or
too large for float32, a class of two samples, complex data through the API, and onnxruntime's own
log lines. Each ends in exit 2 with one line on stderr, or in a correct report.

Every model is a tiny torch module scripted here (or an ONNX graph made with onnx.helper), audited
on the breast-cancer sample data (29 features in [0, 1]).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from conftest import sample
from onnx import TensorProto, helper, numpy_helper
from test_hostile_inputs import assert_refused, cancer_npz, run_cli, save_script

import splitaudit
from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.engine.pipeline import AuditEngine
from splitaudit.inputs.data import Dataset, split_dataset

CANCER, MODEL_TS = sample("breast_cancer.npz"), sample("breast_cancer_mlp.pt")
FEATURES, WIDTH = 29, 8
DRIFT_AFTER = 5  # calls a drifting model answers honestly before it scales its output down
# --prior gaussian and sigma 0.05: the honest model's van Trees bound is about 0.012, the prior's
# alone (the mean guess) about 0.020; the threshold sits between them.
GATED = ["--attacks", "none", "--quick", "--prior", "gaussian", "--noise-sigma", "0.05", "--fail-under-mse", "0.018"]


class Honest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(FEATURES, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Noisy(Honest):
    """A stochastic encoder: Gaussian noise drawn inside forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.lin(x))
        return z + 0.05 * torch.randn_like(z)


class Drifting(Honest):
    """Behaves for DRIFT_AFTER calls, then answers 1e-4 times smaller: the attacks' embeddings and the
    dFIL then describe a model that leaks nothing. The counter is a TorchScript attribute (no tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.limit = 0, DRIFT_AFTER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        z = torch.tanh(self.lin(x))
        return z * 1e-4 if self.calls > self.limit else z


class NoisyDrifting(Drifting):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        z = torch.tanh(self.lin(x))
        z = z + 0.05 * torch.randn_like(z)
        return z * 1e-4 if self.calls > self.limit else z


class CountingBuffer(Honest):
    """The same drift with the counter a registered buffer, incremented in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.limit = DRIFT_AFTER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        z = torch.tanh(self.lin(x))
        return z * 1e-4 if bool(self.calls > self.limit) else z


class EditsWeights(Honest):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.weight.add_(1.0)
        return torch.tanh(self.lin(x))


class EditsWeightsWhenDifferentiated(Honest):
    """Edits its weights only with autograd on: the loading checks (no_grad) see nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.lin.weight.add_(1.0)
        return torch.tanh(self.lin(x))


class Huge(Honest):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 1e30


class Steep(Honest):
    """Bounded outputs whose derivatives reach 1e19: ||J||_F^2 overflows float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(1e20 * self.lin(x))


def scripted(module: nn.Module, tmp_path) -> str:
    return str(save_script(module.eval(), tmp_path / f"{type(module).__name__}.pt"))


def gated_run(model: str, tmp_path, capsys) -> tuple[int, str, dict | None]:
    """(exit code, stderr, report or None) of a gated audit of model."""
    out = tmp_path / "out"
    code, _, err = run_cli(["run", model, "--aux", CANCER, *GATED, "--out", out, "--format", "json"], capsys)
    report = out / "report.json"
    return code, err, json.loads(report.read_text()) if report.exists() else None


# --- answers that change between calls -----------------------------------------------------------


@pytest.mark.parametrize("module, stochastic", [(Honest(), False), (Noisy(), True)])
def test_honest_and_stochastic_models_keep_their_answers_and_fail_the_gate(module, stochastic, tmp_path, capsys):
    """The fingerprint's re-checks pass a model that keeps its answers (a stochastic one within its
    own spread), and the gate fails on its bound."""
    code, err, report = gated_run(scripted(module, tmp_path), tmp_path, capsys)
    assert code == 1, err
    assert report["model"]["stochastic"] is stochastic
    assert report["bounds"]["van_trees_mse"] < 0.018


@pytest.mark.parametrize("module", [Drifting(), NoisyDrifting()], ids=["deterministic", "stochastic"])
def test_a_model_whose_answers_drift_is_refused_instead_of_passing_the_gate(module, tmp_path, capsys):
    """Without the fingerprint, the drifting model's bound is the prior's alone (about 0.020) and
    the gate passes (exit 0) where the honest model fails it."""
    assert_refused(
        ["run", scripted(module, tmp_path), "--aux", CANCER, *GATED, "--out", tmp_path / "out"],
        capsys,
        tmp_path,
        "the model's output changed between calls: after the dFIL and bounds stage",
    )


def test_answers_changed_before_the_end_of_the_audit_are_refused(tmp_path):
    """The last re-check, when the audit is done (before its gate): a model changed after the dFIL."""
    options = AuditOptions(model=scripted(Honest(), tmp_path), aux=CANCER, quick=True, prior="gaussian").validate()
    with pytest.raises(InputError, match="output changed between calls: at the end of the audit"):
        with AuditEngine.prepared(options, attacks=False) as engine:
            _ = engine.measurement
            with torch.no_grad():  # a change no forward pass made: the stages before the end do not look
                next(engine.ctx.encoder.torch_fn.parameters()).mul_(1e-4)


# --- weights edited in forward, outputs and derivatives beyond float32, a class of two ---------------


@pytest.mark.parametrize(
    "module, fragment",
    [
        (EditsWeights(), "changes its own weights or buffers (scripted.lin.weight)"),
        (CountingBuffer(), "changes its own weights or buffers (scripted.calls)"),
        (EditsWeightsWhenDifferentiated(), "changes its own weights or buffers (in place, while differentiated)"),
        (Huge(), "returns values up to 7.19e+29 in magnitude; beyond 1e+15"),
        (Steep(), "squared Jacobian norm ||J||_F^2 overflows float32"),
    ],
    ids=["edits-weights", "counting-buffer", "edits-when-differentiated", "outputs-1e30", "derivatives-1e19"],
)
def test_models_beyond_what_can_be_audited_are_refused_with_their_cause(module, fragment, tmp_path, capsys):
    assert_refused(
        ["run", scripted(module, tmp_path), "--aux", CANCER, "--attacks", "none", "--quick", "--out", tmp_path / "o"],
        capsys,
        tmp_path,
        fragment,
    )


def test_a_class_of_two_samples_split_between_aux_and_target_is_audited(tmp_path, capsys):
    """One sample of the class lands in each part; the utility probe's stratified split of the aux
    part then met a class of one (sklearn: 'too few members', exit 3)."""
    data = np.load(CANCER)
    n = len(data["x"])
    aux, target = split_dataset(Dataset(x=torch.arange(n, dtype=torch.float32)[:, None]), 0.5, 0)
    labels = data["y"].copy()
    labels[[int(aux.x[0, 0]), int(target.x[0, 0])]] = 2  # the split run's own seed and fraction (defaults)
    path = cancer_npz(tmp_path / "two.npz", y=labels)
    out = tmp_path / "out"
    code, _, err = run_cli(["run", MODEL_TS, "--aux", path, "--attacks", "none", "--quick", "--out", out], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["classes"] == 3 and report["utility"]["status"] == "ok"


# --- complex data through the Python API ---------------------------------------------------------


def test_the_api_refuses_complex_data_as_the_cli_does():
    x = np.load(CANCER)["x"]
    for data in (x + 1j * x, torch.from_numpy(x + 1j * x)):
        with pytest.raises(InputError, match="'x' must hold real numbers .* got complex"):
            splitaudit.audit(Honest(), data, attacks="none", quick=True)


# --- data too small or too large for float32 ------------------------------------------------------


@pytest.mark.parametrize(
    "scale, fragment",
    [(1e-30, "span only 1e-30 (0 to 1e-30); below 1e-15"), (1e20, "reach 1e+20 in magnitude; beyond 1e+15")],
)
def test_data_beyond_float32s_range_is_refused_instead_of_bounded_from_under_or_overflow(
    scale, fragment, tmp_path, capsys
):
    """Data scaled by 1e-30 gave the score-matching prior an infinite J/d and a van Trees bound of 0."""
    path = cancer_npz(tmp_path / "scaled.npz", x=(np.load(CANCER)["x"] * scale).astype(np.float32))
    assert_refused(["run", MODEL_TS, "--aux", path, "--attacks", "none", "--quick"], capsys, tmp_path, fragment)


# --- onnxruntime's C++ log lines ------------------------------------------------------------------


def test_an_onnxruntime_failure_prints_one_line(tmp_path):
    """A Reshape that fails when run (64 x 29 values into rows of 7): onnxruntime's logger printed two
    coloured error lines to stderr before splitaudit's. A fresh process: the logger is process-wide."""
    shape = numpy_helper.from_array(np.array([-1, 7], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["z"], name="bad_reshape")],
        "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", 7])],
        [shape],
    )
    model = tmp_path / "reshape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    args = [sys.executable, "-m", "splitaudit", "run", str(model), "--aux", CANCER, "--attacks", "none", "--quick"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitaudit: error: the model cannot run"), done.stderr
