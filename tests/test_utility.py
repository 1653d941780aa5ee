"""The task accuracy under noise (stages/utility.py): measured by the top model or by a probe, and
skipped with its reason, never an internal error, when the data cannot support it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import sample

from splitaudit.cli import main


def test_one_class_aux_labels_skip_the_probe_with_their_reason_and_the_audit_completes(tmp_path, capsys):
    """A probe cannot be fitted to labels of a single class (scikit-learn raises): the texts of one
    source file, say. The label attacks are already skipped for it; the utility is skipped the same way."""
    digits = np.load(sample("digits.npz"))
    data = tmp_path / "one_class.npz"
    np.savez(data, x=digits["x"][:120], y=np.zeros(120, dtype=np.int64))
    out = tmp_path / "report"
    args = ["run", sample("digits_cnn.onnx"), "--aux", str(data), "--attacks", "fine-tune", "--quick"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--prior", "gaussian", "--noise-sigma", "0.5", "--out", str(out)])
    assert exit_info.value.code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["utility"]["status"] == "skipped" and "single class" in report["utility"]["reason"]
    assert report["attacks"]["fine-tune"]["status"] == "skipped"
