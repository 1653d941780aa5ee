"""Warnings of the libraries splitaudit calls are handled where they arise, never printed: an
undefined ROC AUC is reported as undefined with its reason, and the demo's stderr holds no
library warning line."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from splitaudit.attacks.attribute import majority_guess, probe_attack, undefined_auc

WARNING_LINE = re.compile(r"\b\w*Warning\b")  # how Python's warnings module prints: "file:line: SomeWarning: text"


def attribute_data(target_values: list[int]) -> tuple:
    """Aux samples whose attribute (0/1) shifts their features; target samples holding only target_values."""
    gen = torch.Generator().manual_seed(0)
    aux_attr = np.arange(60) % 2
    target_attr = np.resize(np.asarray(target_values), 30)
    aux = torch.randn(60, 6, generator=gen) + torch.from_numpy(aux_attr)[:, None]
    target = torch.randn(30, 6, generator=gen) + torch.from_numpy(target_attr)[:, None]
    return aux, aux_attr, target, target_attr


def test_a_target_with_one_attribute_value_has_an_undefined_auc_and_no_warning():
    aux, aux_attr, target, target_attr = attribute_data([1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any library warning fails the test
        scores = probe_attack(aux, aux_attr, target, target_attr, seed=0, epochs=20)["scores"]
        majority = majority_guess(aux_attr, target_attr)["scores"]
    assert math.isnan(scores["auc"]) and math.isnan(majority["auc"])
    assert 0.0 <= scores["accuracy"] <= 1.0 and majority["accuracy"] == 0.0  # a tie: the majority value is 0
    assert "all hold one attribute value (1)" in undefined_auc(target_attr, np.unique(aux_attr))


def test_an_attribute_value_absent_from_the_target_makes_the_one_vs_rest_auc_undefined():
    classes = np.array([0, 1, 2])
    assert "value 2, which the probe learned, is absent" in undefined_auc(np.array([0, 1, 0, 1]), classes)
    assert "value 3, which the probe never saw" in undefined_auc(np.array([0, 1, 2, 3]), classes)
    assert undefined_auc(np.array([0, 1, 2, 0]), classes) is None
    assert undefined_auc(np.array([0, 1, 1]), np.array([0, 1])) is None


@pytest.mark.slow
def test_the_demo_prints_no_library_warning(tmp_path):
    command = [sys.executable, "-m", "splitaudit", "demo", "--quick", "--out", str(tmp_path / "demo")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if WARNING_LINE.search(line)], done.stderr
