"""Shared fixtures: the bundled sample models and quick audit contexts built from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitaudit.core.config import AuditOptions
from splitaudit.engine.pipeline import prepare_context

SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"

torch.set_num_threads(2)


def sample(name: str) -> str:
    """Path to a file in sample_models/."""
    return str(SAMPLES / name)


def make_context(model: str, data: str, **overrides):
    """A quick AuditContext for a sample model and its data (50/50 split, seed 0)."""
    options = AuditOptions(model=sample(model), aux=sample(data), seed=0, quick=True, **overrides)
    return prepare_context(options.validate())


@pytest.fixture(autouse=True)
def _in_a_fresh_folder(tmp_path, monkeypatch):
    """Each test runs in its own empty folder: commands that write ./splitaudit-report by default
    never touch the checkout, and parallel test workers never share (or lock) an output folder."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def digits_ctx():
    return make_context("digits_cnn.onnx", "digits.npz")


@pytest.fixture(scope="session")
def cancer_ctx():
    return make_context("breast_cancer_mlp.onnx", "breast_cancer.npz")


@pytest.fixture(scope="session")
def real_audit():
    """One quick real audit through the Python API, shared by the report, schema and SARIF tests so that
    the reports are tested on what the pipeline writes. The digits CNN at sigma 0.5 with thresholds:
    the optimization attack beats the smoothed van Trees bound, so violations and failed checks are real."""
    import splitaudit

    return splitaudit.audit(
        sample("digits_cnn.pt"),
        sample("digits.npz"),
        attacks="kmeans,attribute,optimization",
        noise_sigma=0.5,
        prior="gaussian",
        quick=True,
        fail_under_mse=0.01,
        max_advantage=0.5,
    )
