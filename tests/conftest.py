"""Shared fixtures: the bundled sample models and quick audit contexts built from them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitaudit.config import AuditOptions
from splitaudit.pipeline import prepare_context

SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"

torch.set_num_threads(2)


def sample(name: str) -> str:
    """Path to a file in sample_models/."""
    return str(SAMPLES / name)


def make_context(model: str, data: str, **overrides):
    """A quick AuditContext for a sample model and its data (50/50 split, seed 0)."""
    options = AuditOptions(model=sample(model), aux=sample(data), seed=0, quick=True, **overrides)
    return prepare_context(options.validate())


@pytest.fixture(scope="session")
def digits_ctx():
    return make_context("digits_cnn.onnx", "digits.npz")


@pytest.fixture(scope="session")
def cancer_ctx():
    return make_context("breast_cancer_mlp.onnx", "breast_cancer.npz")
