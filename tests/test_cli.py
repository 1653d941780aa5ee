"""The CLI contract: flags, config files, and bad input as one line with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import sample

from splitaudit.cli import main

MODEL, DATA = sample("digits_cnn.onnx"), sample("digits.npz")


def run_cli(args, capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def assert_one_line_error(code, err, fragment):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("splitaudit: error:") and fragment in lines[0]
    assert "Traceback" not in err


@pytest.fixture
def nan_data(tmp_path):
    x = np.random.rand(20, 1, 8, 8).astype(np.float32)
    x[3, 0, 2, 2] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    return str(tmp_path / "nan.npz")


@pytest.fixture
def truncated_model(tmp_path):
    data = open(MODEL, "rb").read()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 3])
    return str(tmp_path / "cut.onnx")


@pytest.fixture
def text_model(tmp_path):
    (tmp_path / "notes.onnx").write_text("not a model")
    return str(tmp_path / "notes.onnx")


@pytest.fixture
def empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    return str(tmp_path / "empty")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["run", "missing.onnx", "--aux", DATA], "model file not found"),
        (["run", "{text_model}", "--aux", DATA], "not a valid ONNX model"),
        (["run", "{truncated_model}", "--aux", DATA], "truncated or corrupt"),
        (["run", MODEL, "--aux", sample("breast_cancer.npz")], "model expects (1, 8, 8)"),
        (["run", MODEL, "--aux", "{nan_data}"], "NaN or infinite"),
        (["run", MODEL, "--aux", "{empty_folder}"], "data folder is empty"),
        (
            ["run", MODEL, "--aux", DATA, "--noise-sigma", "-1"],
            "--noise-sigma must be 0 or a number >= 1e-12 and <= 1e+12, got -1.0",
        ),
        (["run", MODEL, "--aux", DATA, "--attacks", "fine-tune,telepathy"], "unknown attack 'telepathy'"),
        (["run", MODEL, "--aux", DATA, "--no-such-flag"], "No such option"),
        (
            ["run", MODEL, "--aux", DATA, "--attack-option", "sdar.iteration=9"],
            "attack 'sdar' has no option 'iteration'; it takes ablation, batch_size, early_stopping, eval_every, "
            "holdout_fraction, iterations, label_flip, labels, patience, precision, preset",
        ),
        (
            ["run", MODEL, "--aux", DATA, "--attack-option", "kmeans.k=3"],
            "attack 'kmeans' has no option 'k'; it takes no options",
        ),
        (
            ["run", MODEL, "--aux", DATA, "--attack-option", "sdarr.iterations=9"],
            "attack option for unknown attack 'sdarr'",
        ),
        (["run", MODEL, "--aux", DATA, "--input-shape", "a,b"], "comma-separated"),
        (["run", MODEL], "no auxiliary data"),
        (["calibrate", MODEL, "--aux", DATA, "--target-mse", "0"], "--target-mse must be a number > 0 and <= 1e+12"),
        (["render", "missing/report.json"], "report not found"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, fragment, capsys, request):
    fixtures = {
        name: request.getfixturevalue(name)
        for name in ("nan_data", "truncated_model", "text_model", "empty_folder")
        if any("{" + name + "}" in a for a in args)
    }
    code, _, err = run_cli([a.format(**fixtures) for a in args], capsys)
    assert_one_line_error(code, err, fragment)


def test_a_misspelt_attack_or_option_claims_no_folder_and_keeps_the_last_reports(tmp_path, capsys):
    """Attack names and options are refused where the options come in, before --out is claimed: no
    empty folder is left, and the earlier run's reports in --out are not removed."""
    fresh, earlier = tmp_path / "fresh", tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "report.json").write_text("{}")
    for out in (fresh, earlier):
        for wrong in (["--attack-option", "sdar.iteration=9"], ["--attacks", "telepathy"]):
            code, _, err = run_cli(["run", MODEL, "--aux", DATA, *wrong, "--out", str(out)], capsys)
            assert code == 2, err
    assert not fresh.exists() and (earlier / "report.json").read_text() == "{}"


def test_config_file_is_read_and_flags_win(tmp_path, capsys):
    config = tmp_path / "audit.toml"
    config.write_text(f'model = "{MODEL}"\naux = "{DATA}"\nnoise_sigma = -2.0\n')
    code, _, err = run_cli(["run", "--config", str(config)], capsys)
    assert_one_line_error(code, err, "--noise-sigma must be 0 or a number >= 1e-12 and <= 1e+12, got -2.0")
    # The flag overrides the file's bad value; the next problem surfaces instead.
    code, _, err = run_cli(["run", "--config", str(config), "--noise-sigma", "0.1", "--attacks", "nope"], capsys)
    assert_one_line_error(code, err, "unknown attack 'nope'")


def test_config_file_with_unknown_keys_is_rejected(tmp_path, capsys):
    config = tmp_path / "audit.toml"
    config.write_text('modle = "x.onnx"\n')
    code, _, err = run_cli(["run", "--config", str(config)], capsys)
    assert_one_line_error(code, err, "unknown keys: modle")


def test_help_documents_the_contract_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for flag in (
        "--aux",
        "--target",
        "--attacks",
        "--noise-sigma",
        "--prior",
        "--smoothing",
        "--top-model",
        "--input-shape",
        "--normalize",
        "--label-column",
        "--attr-column",
        "--out",
        "--format",
        "--fail-under-mse",
        "--config",
        "--seed",
        "--device",
        "--quick",
        "--debug",
    ):
        assert flag in out, flag


def test_console_script_prints_no_traceback(tmp_path):
    """The installed entry point, in a fresh process, as a CI job would call it."""
    proc = subprocess.run(
        [sys.executable, "-m", "splitaudit", "run", str(tmp_path / "nope.onnx"), "--aux", DATA],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"splitaudit: error: model file not found: {tmp_path / 'nope.onnx'}"


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(SystemExit):
        main(["run", "missing.onnx", "--aux", DATA, "--debug"])
    assert "Traceback" in capsys.readouterr().err


def test_a_log_gets_a_line_per_finished_step_instead_of_a_bar(capsys, monkeypatch):
    """stderr that is not a terminal (a CI log) cannot show a bar's redraws: each coarse step and each
    finished stage is a line instead, and a stage that raised is not called done."""
    from splitaudit.cli import LogLines, cli_progress

    monkeypatch.setattr(LogLines, "QUIET_SECONDS", 0.0)
    with cli_progress(total=3, desc="sweep", unit="sigma") as bar:
        for _ in range(3):
            bar.update()
    with pytest.raises(ValueError), cli_progress(total=10, desc="decoder", unit="epoch") as bar:
        bar.update()
        raise ValueError("stopped")
    lines = [line.split(" after ")[0] for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "splitaudit: sweep: 1 of 3 sigmas done",
        "splitaudit: sweep: 2 of 3 sigmas done",
        "splitaudit: sweep: done",
    ]
