"""Hostile and odd inputs: sweeps, render of sweep.json, config files, task
time-outs and the Python API. Each case ends in exit 2 with one line on stderr before anything is
computed (or in a correct report), and nothing is left behind outside --out.

Every fixture is tiny and made here; the sample model and data stand in for a real audit.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import sample
from test_hostile_inputs import assert_refused, run_cli

from splitaudit import audit
from splitaudit.attacks import attack_class, attack_names
from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.options import option_rule
from splitaudit.engine import pipeline
from splitaudit.estimators.bounds import dfil, van_trees_stderr
from splitaudit.execution.executor import open_executor, run_attack_grid
from splitaudit.execution.tasks import SeedTask
from splitaudit.stages import leakage
from splitaudit.verdicts.recommend import recommend

MLP, CANCER = sample("breast_cancer_mlp.onnx"), sample("breast_cancer.npz")


@pytest.fixture
def private_tmp(tmp_path_factory, monkeypatch) -> Path:
    """A temp directory of this test's own (for this process and the workers it spawns)."""
    folder = tmp_path_factory.mktemp("tmp")
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def ours(folder: Path) -> list[Path]:
    """splitaudit's files in a temp directory (native libraries leave their own, e.g. `.ses`)."""
    return list(folder.glob("splitaudit-*"))


# --- 1. --task-timeout: workers' model copies never outlive the pool --------------------------------


def test_dfil_shards_are_not_bound_by_the_task_timeout_and_leave_no_model_copy(tmp_path, capsys, private_tmp):
    """--task-timeout bounds attack seeds; the dFIL shards on the same workers run to the end (no
    bound without all of them): a time-out far below a shard's run time still gives the bound."""
    out = tmp_path / "out"
    args = ["run", MLP, "--aux", CANCER, "--attacks", "none", "--task-timeout", "0.01", "--noise-sigma", "0.5"]
    code, _, err = run_cli([*args, "--quick", "--out", out, "--format", "json"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["task_timeout"] == 0.01 and report["run"]["dfil_shards"]["retried"] == 0
    assert report["run"]["dfil_shards"]["tasks"] >= 1 and math.isfinite(report["bounds"]["van_trees_mse"])
    assert ours(private_tmp) == []


def test_stopped_and_killed_workers_leave_no_model_copy(cancer_ctx, private_tmp):
    """A worker stopped for its time-out removes its copy itself; one killed outright leaves it
    to the pool, which removes its whole scratch folder when it closes."""
    options = AuditOptions(model=MLP, aux=CANCER, task_timeout=0.05).validate()
    pool = open_executor("local", options, cancer_ctx)
    scratch = Path(pool.scratch.name)
    try:
        assert ours(private_tmp) == [scratch] and scratch.is_dir()
        _, results = run_attack_grid(cancer_ctx, ["decoder"], [0.0], pool)
        assert results[0].attempts == 2 and "timed out after 0.05 s (--task-timeout)" in results[0].error
        assert list(scratch.iterdir()) == []  # the stopped workers removed their copies
        pool.task_timeout = None
        pool.start(SeedTask("decoder", 0, 0.0))
        os.kill(pool.pool[0].process.pid, signal.SIGKILL)
    finally:
        pool.close()
    assert not scratch.exists() and ours(private_tmp) == []


PROGRESS_LINE = re.compile(r"splitaudit: [^:]+(: [^:]+)?: (done|[\d.]+ of \d+ \w+ done) after \d+ s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_ctrl_c_or_kill_during_a_timed_audit_leaves_no_folder_and_no_semaphore_warning(
    tmp_path, private_tmp, signum, code, word
):
    """The CLI in its own process, interrupted (Ctrl-C) or killed (SIGTERM) while its workers run:
    exit 130 or 143, one line, nothing left in the temp directory and no resource_tracker warning
    about leaked semaphores."""
    # SDAR beside the decoder keeps the workers busy well past the signal (the decoder alone can
    # finish first, its two seeds agreeing, and the signal then lands in the report's rendering)
    args = [sys.executable, "-m", "splitaudit", "run", MLP, "--aux", CANCER, "--attacks", "decoder,sdar"]
    args += ["--task-timeout", "60", "--noise-sigma", "0.5", "--out", str(tmp_path / "out")]
    cli = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(private_tmp)})
    deadline = time.monotonic() + 120
    while not any(private_tmp.glob("splitaudit-worker-*")) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the pool exists
    time.sleep(5)  # its worker rebuilt the context and runs the decoder
    cli.send_signal(signum)
    _, err = cli.communicate(timeout=120)
    assert cli.returncode == code, err
    *progress, last = [
        line for line in err.splitlines() if line.strip()
    ]  # stderr is a pipe, a log: a line per finished stage before
    assert word in last and all(PROGRESS_LINE.fullmatch(line) for line in progress), err
    assert ours(private_tmp) == []


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_that_a_library_turns_into_its_own_error_still_exits_as_the_signal(monkeypatch, capsys, signum, code):
    """A signal's exception raised inside a C extension can come out as the library's own error
    (matplotlib rendering a chart gave "ValueError: Invalid affine transformation matrix" on Ctrl-C):
    after a signal, the exit is the signal's, never an internal error."""
    from splitaudit import cli as cli_module

    def rendering(**_kwargs):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except BaseException:
            raise ValueError("Invalid affine transformation matrix") from None

    monkeypatch.setattr(cli_module.cli, "main", rendering)
    # what the process had before (default_int_handler, or SIG_IGN when started in the background)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["run"])
    assert exit_info.value.code == code
    assert "internal error" not in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_that_a_library_swallows_still_exits_as_the_signal(monkeypatch, capsys, signum, code):
    """A library that catches the signal's exception and carries on (sklearn's MLP on Ctrl-C warns
    and returns) lets the command finish: the exit is still the signal's, never 0 or a gate's 1."""
    from splitaudit import cli as cli_module

    def swallowing(**_kwargs):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except BaseException:
            pass
        return 1  # the command went on to its end (a gate failed)

    monkeypatch.setattr(cli_module.cli, "main", swallowing)
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(["run"])
    assert exit_info.value.code == code
    assert ("interrupted" if signum == signal.SIGINT else "terminated") in capsys.readouterr().err


def test_ctrl_c_inside_a_string_exec_still_exits_130_under_python_m(tmp_path):
    """CPython marks a KeyboardInterrupt that leaves a string exec as unhandled even when it is
    caught, and a `python -m` process then kills itself with SIGINT at exit (-2, not 130). torch's
    modules define hundreds of dataclasses (string execs) as they load, and Ctrl-C landed in one in
    about 1 run of 20 of the test above; here it lands in one every time."""
    (tmp_path / "interrupted_cli.py").write_text(
        "import os, signal, time\n"
        "from splitaudit import cli\n"
        "cli.cli.main = lambda **_kwargs: exec('os.kill(os.getpid(), signal.SIGINT); time.sleep(5)')\n"
        "cli.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "interrupted_cli", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == [
        "splitaudit: error: interrupted (SIGINT); reports of this run are incomplete or absent"
    ]


def test_ctrl_c_inside_the_attribute_probes_mlp_is_raised_not_swallowed(monkeypatch):
    """sklearn's MLP catches KeyboardInterrupt between epochs, warns and returns a half-trained probe;
    the attribute attack and the utility probe raise the interrupt instead of going on."""
    from sklearn.neural_network import MLPClassifier

    from splitaudit.attacks.attribute import probe_attack

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(MLPClassifier, "_update_no_improvement_count", interrupted)
    gen = torch.Generator().manual_seed(0)
    aux, target = torch.randn(40, 6, generator=gen), torch.randn(10, 6, generator=gen)
    attr = np.arange(40) % 2
    with pytest.raises(KeyboardInterrupt):
        probe_attack(aux, attr, target, np.arange(10) % 2, seed=0, epochs=5)


# --- 2. render refuses a report or sweep whose verdict contradicts its own numbers ------------------

FIXTURES = Path(__file__).parent / "fixtures"


def edited(tmp_path: Path, fixture: str, edit) -> Path:
    """A copy of a fixture with one edit applied."""
    document = json.loads((FIXTURES / fixture).read_text())
    edit(document)
    path = tmp_path / fixture
    path.write_text(json.dumps(document))
    return path


def _set(path: tuple, value):
    def edit(document):
        *parents, last = path
        for key in parents:
            document = document[key]
        document[last] = value

    return edit


def _drop_points(document):
    document["points"], document["noise_sigmas"] = [], []


def _lower_recommended_bound(document):
    """The recommended point's bound below the target, recommendation kept: the next point is the answer."""
    document["points"][1]["bounds"]["van_trees_mse"] = document["recommendation"]["van_trees_mse"] = 0.001


def _fail_a_met_bound_check(document):
    """A consistent-looking failure (passed = all checks) that the numbers contradict: only
    recomputing the check from the recommended point's bound catches it."""
    document["gate"]["passed"] = document["gate"]["checks"][1]["passed"] = False


SWEEP_EDITS = {
    "passed-with-a-failed-check": (_set(("gate", "checks", 1, "passed"), False), "gate.passed is true"),
    "sigma-not-its-points": (_set(("recommendation", "noise_sigma"), 7), "noise_sigma 7 is not its point's sigma 0.5"),
    "negative-index": (_set(("recommendation", "point_index"), -1), "point_index -1 is not the index of a point"),
    "index-out-of-range": (_set(("recommendation", "point_index"), 99), "point_index 99 is not the index"),
    "no-points": (_drop_points, "it has no points"),
    "recommendation-not-recomputable": (_lower_recommended_bound, "not what its points give (point 2"),
    "check-flipped": (_fail_a_met_bound_check, "gate check 'fail-under-mse' says the opposite"),
    "sigmas-not-the-points": (_set(("noise_sigmas",), [0.0, 0.5, 3.0]), "are not its points' sigmas"),
}


@pytest.mark.parametrize("case", SWEEP_EDITS)
def test_render_refuses_a_sweep_that_contradicts_itself(tmp_path, capsys, case):
    edit, fragment = SWEEP_EDITS[case]
    source = edited(tmp_path, "tabular_sweep.json", edit)
    line = assert_refused(["render", source, "--out", tmp_path / "out"], capsys, tmp_path, fragment)
    assert "contradicts itself" in line


def test_the_unedited_sweep_fixture_renders(tmp_path, capsys):
    code, out, err = run_cli(["render", FIXTURES / "tabular_sweep.json", "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "sweep.html").is_file()


REPORT_EDITS = {
    "passed-with-a-failed-check": ("sigma0_audit.json", _set(("gate", "passed"), True), "gate.passed is true"),
    "bound-check-claims-a-pass": (
        "sigma0_audit.json",
        lambda d: (_set(("gate", "passed"), True)(d), _set(("gate", "checks", 1, "passed"), True)(d)),
        "gate check 'fail-under-mse' says the opposite of its numbers, which give: failed",
    ),
    "threshold-check-dropped": (
        "tabular_audit.json",
        lambda d: d["gate"]["checks"].pop(1),
        "gate check 'fail-under-mse' is missing",
    ),
    "completeness-claimed-with-a-failed-attack": (
        "failed_attack_audit.json",
        lambda d: (_set(("gate", "passed"), True)(d), _set(("gate", "checks", 0, "passed"), True)(d)),
        "gate check 'audit-complete' says the opposite",
    ),
}


@pytest.mark.parametrize("case", REPORT_EDITS)
def test_render_and_compare_refuse_a_report_that_contradicts_itself(tmp_path, capsys, case):
    fixture, edit, fragment = REPORT_EDITS[case]
    source = edited(tmp_path, fixture, edit)
    assert_refused(["render", source, "--out", tmp_path / "out"], capsys, tmp_path, fragment)
    assert_refused(["compare", FIXTURES / fixture, source, "--out", tmp_path / "cmp"], capsys, tmp_path, fragment)


# --- 3. --auto-sigma that finds no sigma never "completes" an audit of nothing ----------------------


def test_auto_sigma_without_a_reachable_target_or_a_grid_is_bad_input(tmp_path, capsys):
    line = assert_refused(
        ["sweep", MLP, "--aux", CANCER, "--auto-sigma", "--target-mse", "1e6", "--attacks", "none", "--quick"],
        capsys,
        tmp_path,
        "--auto-sigma found no sigma for the target MSE 1e+06",
    )
    assert "prior alone" in line and "nothing to audit" in line


def test_the_no_recommendation_hint_names_auto_sigma_only_when_it_was_not_used():
    sweep = json.loads((FIXTURES / "tabular_sweep.json").read_text())
    without = recommend(sweep["points"], 1e6)["reason"]
    assert without.endswith("audit larger sigmas (or use --auto-sigma)")
    used = recommend(sweep["points"], 1e6, auto_sigma_reason="the prior alone beats 1e6")["reason"]
    assert "or use --auto-sigma" not in used and used.endswith("(--auto-sigma: the prior alone beats 1e6)")


# --- 4. every numeric option has a finite range, checked up front in one place ----------------------

EDGE_CASES = {
    "sweep-huge-sigma": (
        ["sweep", "--noise-sigma", "0,1e308"],
        "--noise-sigma must be a list of numbers, each 0 or >= 1e-12 and <= 1e+12, got 1e+308",
    ),
    "run-subnormal-sigma": (
        ["run", "--noise-sigma", "1e-320"],
        "--noise-sigma must be 0 or a number >= 1e-12 and <= 1e+12, got 1e-320",
    ),
    "sweep-subnormal-sigma": (["sweep", "--noise-sigma", "0,1e-320"], "each 0 or >= 1e-12 and <= 1e+12, got 1e-320"),
    "sweep-duplicate": (["sweep", "--noise-sigma", "0.5,1,0.5"], "--noise-sigma lists 0.5 twice"),
    "sweep-zero-and-minus-zero": (["sweep", "--noise-sigma", "0,-0"], "--noise-sigma lists 0 twice"),
    "sweep-near-duplicate": (["sweep", "--noise-sigma", "0.1,0.1000000000001"], "agree to 12 digits"),
    "sweep-too-many": (
        ["sweep", "--noise-sigma", ",".join(str(i / 100) for i in range(65))],
        "lists 65 sigmas; a sweep audits at most 64",
    ),
    "sweep-nan-target": (
        ["sweep", "--noise-sigma", "1", "--target-mse", "nan"],
        "--target-mse must be a number > 0 and <= 1e+12, got nan",
    ),
    "run-timeout-overflow": (
        ["run", "--task-timeout", "1e308"],
        "--task-timeout must be a number > 0 and <= 2.592e+06",
    ),
    "run-huge-threshold": (["run", "--fail-under-mse", "1e300"], "--fail-under-mse must be a number >= 0 and <= 1e+12"),
    "run-huge-dfil-samples": (
        ["run", "--dfil-samples", str(2**63)],
        "--dfil-samples must be an integer >= 2 and <= 2147483647",
    ),
    "calibrate-huge-target": (["calibrate", "--target-mse", "1e300"], "--target-mse must be a number > 0 and <= 1e+12"),
}


@pytest.mark.parametrize("case", EDGE_CASES)
def test_numbers_at_the_edges_are_refused_before_loading(tmp_path, capsys, monkeypatch, case):
    (command, *flags), fragment = EDGE_CASES[case]
    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("loaded before validating"))
    assert_refused([command, MLP, "--aux", CANCER, *flags], capsys, tmp_path, fragment)


def test_minus_zero_is_zero_and_the_checks_see_every_list_item():
    options = AuditOptions(model=MLP, aux=CANCER, noise_sigma=-0.0, noise_sigmas=[-0.0, 0.5]).validate()
    assert math.copysign(1, options.noise_sigma) == 1 and [math.copysign(1, s) for s in options.noise_sigmas] == [1, 1]
    with pytest.raises(InputError, match="--input-shape must be a list of integers >= 1 and <= 2147483647, got 0"):
        AuditOptions(model=MLP, aux=CANCER, input_shape=[3, 0, 8]).validate()


def test_the_estimators_stay_finite_or_infinite_at_float_edges():
    """dFIL = ||J||^2 / (d sigma^2): a sigma whose square overflows leaks nothing (0), one whose
    square underflows is no noise (inf where J != 0, 0 where f is flat), never an exception."""
    trace = torch.tensor([4.0, 0.0], dtype=torch.float64)
    assert dfil(trace, 2, 1e308).tolist() == [0.0, 0.0]
    assert dfil(trace, 2, 1e-320).tolist() == [math.inf, 0.0]
    assert dfil(trace, 2, 0.5).tolist() == [8.0, 0.0]  # 4 / (2 * 0.25)
    assert van_trees_stderr(0.0, 0.0, 1e-200, 1e-210) == pytest.approx(1e190, rel=1e-12)


# --- 5. a config file nested 100,000 deep ------------------------------------------------------------


@pytest.mark.parametrize("value", ["[" * 100_000 + "]" * 100_000, "[" * 30 + "]" * 30, "{a = " * 500 + "1" + "}" * 500])
def test_deeply_nested_config_is_refused(tmp_path, capsys, value):
    config = tmp_path / "deep.toml"
    config.write_text(f"x = {value}\n")
    assert_refused(["run", MLP, "--aux", CANCER, "--config", config], capsys, tmp_path, "nests too deeply")


def test_a_huge_config_file_is_refused_unread(tmp_path, capsys):
    config = tmp_path / "huge.toml"
    config.write_text("# " + "x" * 2 * 1024**2 + "\n")
    assert_refused(["run", MLP, "--aux", CANCER, "--config", config], capsys, tmp_path, "a config file is at most")


# --- 6. attack options that could only fail the attack are refused before anything runs -------------


@pytest.mark.parametrize(
    "option, fragment",
    [
        ("decoder.lr=1e308", "decoder.lr must be a number > 0 and <= 1, got 1e+308"),
        ("decoder.batch_size=99999999999999999999", "decoder.batch_size must be an integer >= 1 and <= 2147483647"),
        ("optimization.lr=2.0", "optimization.lr must be a number > 0 and <= 1"),
    ],
)
def test_attack_options_out_of_any_useful_range_are_refused_before_loading(
    tmp_path, capsys, monkeypatch, option, fragment
):
    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("loaded before validating"))
    args = ["run", MLP, "--aux", CANCER, "--attacks", "decoder", "--attack-option", option]
    assert_refused(args, capsys, tmp_path, fragment)


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_tv_prior_on_tabular_data_is_refused_before_any_measurement(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setattr(leakage, "measure", lambda *a, **k: pytest.fail("measured before refusing"))
    args = [command, MLP, "--aux", CANCER, "--attacks", "optimization", "--attack-option", "optimization.prior=tv"]
    args += ["--noise-sigma", "0.5", "--quick"]
    assert_refused(args, capsys, tmp_path, "optimization.prior=tv needs images or sequences")


def test_every_number_an_attack_option_takes_is_bounded_above():
    """Every number an attack option takes is bounded above: without a limit 1e308 would reach the attack."""
    numeric = ("a number", "an integer", "a list of numbers", "a list of integers")
    for name in attack_names():
        options = attack_class(name).Options
        hints = typing.get_type_hints(options)
        for spec in fields(options):
            rule = option_rule(spec, hints[spec.name])
            assert not rule.startswith(numeric) or "<" in rule, f"{name}.{spec.name}: {rule}"


# --- 8. the Python API raises InputError for bad input ---------------------------------------------


class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(29, 4)

    def forward(self, x):
        return self.linear(x)


CANCER_X = np.load(CANCER)["x"].astype(np.float32)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"aux": torch.empty(40, 29, device="meta")}, "aux x is a tensor on the meta device"),
        ({"aux": (torch.tensor(CANCER_X), torch.zeros(len(CANCER_X), device="meta"))}, "aux y is a tensor on the meta"),
        ({"aux": torch.zeros(40, 29).to_sparse()}, "aux x is a torch.sparse_coo tensor"),
        ({"aux": [[1.0, 2.0], [3.0]]}, "aux is not an array of samples"),
        ({"aux": CANCER_X, "attacks": 5}, 'attacks must be "all", "none", a comma string or a list of names, got 5'),
        ({"aux": CANCER_X, "device": "tpu"}, "--device must be one of 'auto', 'cpu', 'cuda', got 'tpu'"),
        (
            {"aux": CANCER_X, "noise_sigma": 1e-320},
            "--noise-sigma must be 0 or a number >= 1e-12 and <= 1e+12, got 1e-320",
        ),
    ],
)
def test_the_api_raises_input_error_for_bad_input(kwargs, fragment, monkeypatch):
    monkeypatch.setattr(leakage, "measure", lambda *a, **k: pytest.fail("measured bad input"))
    with pytest.raises(InputError) as raised:
        audit(TinyEncoder(), **{"attacks": "none", **kwargs})
    assert fragment in str(raised.value)


# --- 9. compare: two report.json files, and it says when they are not like for like -----------------


def test_compare_refuses_a_sweep_beside_a_report(tmp_path, capsys):
    for pair in (("tabular_audit.json", "tabular_sweep.json"), ("tabular_sweep.json", "tabular_sweep.json")):
        args = ["compare", *(FIXTURES / name for name in pair), "--out", tmp_path / "cmp"]
        assert_refused(args, capsys, tmp_path, "is a sweep.json; compare takes two report.json files")


def test_compare_warns_when_model_or_data_differ(tmp_path, capsys):
    args = ["compare", FIXTURES / "tabular_audit.json", FIXTURES / "image_audit.json", "--out", tmp_path / "cmp"]
    code, _, err = run_cli([*args, "--format", "html,md,json"], capsys)
    warnings = err.strip().splitlines()
    assert code == 0 and all(line.startswith("splitaudit: warning: not like for like:") for line in warnings)
    assert any("input shape: [29] before, [1, 8, 8] after" in line for line in warnings)
    assert any("classes: 2 before, 10 after" in line for line in warnings)
    assert "Not like for like: the audits differ in input shape" in (tmp_path / "cmp" / "comparison.html").read_text()
    assert "not like for like" in (tmp_path / "cmp" / "comparison.md").read_text()
    listed = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["warnings"]
    assert [w for w in listed if w.startswith("the audits differ")] == [
        w.split("not like for like: ")[1] for w in warnings
    ]
    assert "no provenance" in listed[-1]  # the files also say whether the same files were audited


def test_compare_of_the_same_audit_warns_nothing(tmp_path, capsys):
    same = FIXTURES / "tabular_audit.json"
    code, _, err = run_cli(["compare", same, same, "--out", tmp_path / "cmp"], capsys)
    assert code == 0 and err == ""


# --- 10. --ray-address without --executor ray; a bad device in a config file -------------------------


def test_ray_address_without_the_ray_executor_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("loaded before validating"))
    args = ["run", MLP, "--aux", CANCER, "--ray-address", "127.0.0.1:6379"]
    assert_refused(args, capsys, tmp_path, "--ray-address names a Ray cluster for --executor ray")


def test_a_bad_device_in_a_config_file_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("loaded before validating"))
    config = tmp_path / "audit.toml"
    config.write_text('device = "tpu"\n')
    args = ["run", MLP, "--aux", CANCER, "--config", config]
    assert_refused(args, capsys, tmp_path, "--device must be one of 'auto', 'cpu', 'cuda', got 'tpu'")
