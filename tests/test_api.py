"""The Python API, splitaudit.audit(...): in-memory modules and arrays, paths, and calling it twice."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import sample

import splitaudit
from splitaudit.core.errors import InputError
from splitaudit.core.result import first_error

DIGITS = np.load(sample("digits.npz"))


def small_encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.Tanh())


def test_in_memory_module_and_arrays_twice_give_the_same_valid_result(tmp_path):
    """Arrays, tensors and a (x, y) tuple all work; the caller's module is left as it was; a second
    call with the same seed repeats the first (no state leaks between calls)."""
    net = small_encoder()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = DIGITS["x"][:300], DIGITS["y"][:300]
    first = splitaudit.audit(net, (x, y), attacks="kmeans", noise_sigma=0.2, prior="gaussian", quick=True)
    second = splitaudit.audit(
        net, (torch.as_tensor(x), torch.as_tensor(y)), attacks=["kmeans"], noise_sigma=0.2, prior="gaussian", quick=True
    )
    for result in (first, second):
        assert first_error(json.loads(result.to_json())) is None
        assert result["model"]["path"] == "<in-memory Sequential>" and result["model"]["gradient_mode"] == "autograd"
        assert (
            result["data"]["aux_path"] == "<in-memory aux>"
            and result["data"]["n_aux"] + result["data"]["n_target"] == 300
        )
    assert first["dfil"]["mean"] == pytest.approx(second["dfil"]["mean"], rel=1e-6)
    assert first["attacks"]["kmeans"]["metrics"] == pytest.approx(second["attacks"]["kmeans"]["metrics"], rel=1e-6)
    # dFIL of a linear+tanh encoder at sigma 0.2 is ||J||_F^2 / (d sigma^2) > 0 and finite
    assert 0 < first["dfil"]["mean"] < float("inf")
    assert net.training and all(p.requires_grad for p in net.parameters())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_in_memory_module_and_arrays_on_worker_processes_give_the_in_process_result():
    """workers=2: the in-memory module and arrays travel to two spawned workers in the recipe and
    the attacks' numbers are exactly those of one process."""
    x, y = DIGITS["x"][:300], DIGITS["y"][:300]
    common = dict(attacks="kmeans,decoder", noise_sigma=0.2, prior="gaussian", quick=True, device="cpu")
    alone = splitaudit.audit(small_encoder(), (x, y), **common)
    pooled = splitaudit.audit(small_encoder(), (x, y), workers=2, **common)
    assert pooled["run"]["workers"] == 2 and len({t["worker"] for t in pooled["run"]["tasks"]}) == 2
    for name in ("kmeans", "decoder"):
        assert pooled["attacks"][name]["metrics"] == alone["attacks"][name]["metrics"]


def test_a_model_that_cannot_travel_to_worker_processes_is_bad_input():
    """workers=2 ships the model to spawned processes: a module holding a lambda does not pickle,
    which is an InputError that says to use one worker, not an internal error."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.scale = small_encoder(), lambda z: 2 * z

        def forward(self, x):
            return self.scale(self.inner(x))

    x, y = DIGITS["x"][:300], DIGITS["y"][:300]
    with pytest.raises(InputError, match="workers 1"):
        splitaudit.audit(Scaled(), (x, y), attacks="kmeans", prior="gaussian", workers=2)


def test_paths_and_rendering(tmp_path):
    result = splitaudit.audit(
        sample("breast_cancer_mlp.onnx"),
        sample("breast_cancer.npz"),
        attacks="none",
        noise_sigma=0.1,
        prior="gaussian",
        quick=True,
        fail_under_mse=1.0,
    )
    assert not result.passed and result["model"]["format"] == "onnx"
    paths = result.write(tmp_path, ["json", "html"])
    assert [p.name for p in paths] == ["report.html", "report.json"]  # report.json last
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(result.to_json())
    html = result.to_html()
    assert html.startswith("<!doctype html>") and "FAILED: the provable bound is too low" in html
    summary = result._repr_html_()
    assert "FAILED: the provable bound is too low" in summary and "<img" not in summary
    assert "FAILED" in repr(result)


def test_separate_target_data_and_dict_input():
    x, y = DIGITS["x"], DIGITS["y"]
    aux = {"x": x[:200], "y": y[:200]}
    result = splitaudit.audit(
        small_encoder(), aux, target=x[200:300], attacks="none", prior="gaussian", noise_sigma=0.5, quick=True
    )
    assert result["data"]["n_aux"] == 200 and result["data"]["n_target"] == 100
    assert result["data"]["target_path"] == "<in-memory target>"


@pytest.mark.parametrize(
    "model, aux, message",
    [
        (42, "x.npz", "model must be a torch.nn.Module or a path"),
        (nn.Identity(), {"x": np.zeros((4, 3)), "labels": [0, 1, 0, 1]}, "takes keys x, y, attr"),
        (nn.Identity(), (np.zeros((4, 3)), [0, 1], None, None), "is \\(x,\\), \\(x, y\\) or \\(x, y, attr\\)"),
        (nn.Identity(), (np.zeros((4, 3)), [0, 1]), "'y' must hold one value per sample \\(4\\)"),
        (nn.Identity(), np.array(["a", "b"]), "x must be a numeric array of samples"),
    ],
)
def test_bad_inputs_raise_input_error(model, aux, message):
    with pytest.raises(InputError, match=message):
        splitaudit.audit(model, aux, quick=True)


def test_import_splitaudit_stays_light():
    """`import splitaudit` (and so `splitaudit --help`) does not import torch; splitaudit.audit does, lazily."""
    code = "import sys, splitaudit; assert callable(splitaudit.audit); print('torch' in sys.modules)"
    light = "import sys, splitaudit; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
