"""Hostile and careless inputs: each class ends in exit 2 with one line on stderr before
any report exists, writes nothing outside --out, and never leaves a report that claims success.

Every fixture is tiny and made here; the sample models and data stand in for a real audit.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import sample

from splitaudit.cli import main
from splitaudit.core.errors import InputError
from splitaudit.engine import pipeline
from splitaudit.reports import writer
from splitaudit.reports.files import write_atomic
from splitaudit.reports.writer import load_result, output_lock
from splitaudit.verdicts.gate import evaluate_gate

MLP, MLP_TS, CANCER = sample("breast_cancer_mlp.onnx"), sample("breast_cancer_mlp.pt"), sample("breast_cancer.npz")
FIXTURES = Path(__file__).parent / "fixtures"


def run_cli(args, capsys):
    """(exit code, stdout, stderr) of the CLI run in-process."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def assert_refused(args, capsys, root: Path, fragment: str, code: int = 2) -> str:
    """The run exits `code` with one stderr line holding `fragment`, no traceback, no new file
    outside --out, and no report.json anywhere under root."""
    before = files_under(root)
    exit_code, _, err = run_cli(args, capsys)
    lines = err.strip().splitlines()
    assert exit_code == code, err
    assert len(lines) == 1 and lines[0].startswith("splitaudit: error:"), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err
    assert files_under(root) - before == set()  # nothing written at all (failed before the reports)
    assert not list(root.rglob("report.json"))
    return lines[0]


def save_script(module: nn.Module, path: Path, example: torch.Tensor | None = None) -> Path:
    traced = torch.jit.trace(module, example) if example is not None else torch.jit.script(module)
    traced.save(str(path))
    return path


def cancer_npz(path: Path, **arrays) -> Path:
    data = dict(np.load(CANCER))
    data.update(arrays)
    np.savez(path, **{k: v for k, v in data.items() if v is not None})
    return path


# --- 1. render never writes outside --out ---------------------------------------------------------


@pytest.mark.parametrize("evil", ["../../../../{root}/EVIL", "{root}/ABS", "a/../../b\\c", "\x00nul"])
def test_render_confines_figures_named_from_attack_names(tmp_path, capsys, evil):
    result = json.loads((FIXTURES / "image_audit.json").read_text())
    name = evil.format(root=tmp_path)
    result["attacks"] = {name: result["attacks"]["decoder"], "sdar": result["attacks"]["sdar"]}
    thresholds = ("fail_under_mse", "fail_under_attack_mse", "max_advantage")
    result["gate"] = evaluate_gate(result, **{k: result["gate"][k] for k in thresholds})  # consistent, or refused
    report = tmp_path / "in" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps(result))
    before = files_under(tmp_path)
    code, out, _ = run_cli(["render", report, "--format", "html,md", "--out", tmp_path / "out"], capsys)
    assert code == 0 and "wrote" in out
    new = files_under(tmp_path) - before
    assert new and all((tmp_path / "out") in p.parents for p in new)
    images = sorted(p.name for p in (tmp_path / "out" / "report_images").iterdir())
    assert images and all(n[:3].rstrip("-").isdigit() and "/" not in n and ".." not in n for n in images), images


def test_write_atomic_refuses_paths_outside_the_folder(tmp_path):
    (tmp_path / "out").mkdir()
    for relative in ("../escape.png", str(tmp_path / "abs.png")):
        with pytest.raises(InputError, match="outside the output folder"):
            write_atomic(tmp_path / "out", relative, b"x")
    os.symlink(tmp_path, tmp_path / "out" / "link")  # a symlink inside --out pointing out of it
    with pytest.raises(InputError, match="outside the output folder"):
        write_atomic(tmp_path / "out", "link/x.png", b"x")
    assert files_under(tmp_path) == {tmp_path / "out" / "link"}


# --- 2. no false PASS ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--fail-under-mse", "nan"),
        ("--fail-under-mse", "inf"),
        ("--max-advantage", "nan"),
        ("--fail-under-attack-mse", "inf"),
        ("--noise-sigma", "nan"),
        ("--noise-sigma", "inf"),
        ("--smoothing", "nan"),
        ("--normalize", "0,nan"),
    ],
)
def test_non_finite_thresholds_and_options_are_refused(tmp_path, capsys, flag, value):
    assert_refused(
        ["run", MLP, "--aux", CANCER, flag, value, "--out", tmp_path / "out"],
        capsys,
        tmp_path,
        f", got {value.split(',')[-1]}",  # the rule, then the value that breaks it
    )
    assert not (tmp_path / "out").exists()  # refused before --out was even created


def test_non_finite_threshold_in_a_config_file_is_refused(tmp_path, capsys):
    (tmp_path / "audit.toml").write_text(f'model = "{MLP}"\naux = "{CANCER}"\nfail_under_mse = nan\n')
    assert_refused(
        ["run", "--config", tmp_path / "audit.toml"],
        capsys,
        tmp_path,
        "--fail-under-mse must be a number >= 0 and <= 1e+12, got nan",
    )


def test_the_gate_itself_refuses_a_nan_threshold():
    from splitaudit.verdicts.gate import evaluate_gate

    with pytest.raises(ValueError, match="must be finite"):
        evaluate_gate(load_result(FIXTURES / "image_audit.json"), fail_under_mse=math.nan)


class NanTop(nn.Module):
    def forward(self, z):
        return z[:, :2] * float("nan")


class WrongWidthTop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, z):
        return self.fc(z)


@pytest.mark.parametrize(
    "top, fragment",
    [
        (NanTop(), "--top-model returns NaN or infinite values"),
        (WrongWidthTop(), "--top-model cannot run on the embeddings"),
    ],
)
def test_top_model_is_checked_like_the_bottom_model(tmp_path, capsys, top, fragment):
    path = save_script(top, tmp_path / "top.pt")
    assert_refused(
        ["run", MLP_TS, "--aux", CANCER, "--top-model", path, "--out", tmp_path / "out"], capsys, tmp_path, fragment
    )


class BatchCentred(nn.Module):
    """Subtracts the batch mean: each output depends on every other sample of the batch."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


class TrainModeBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(29)

    def forward(self, x):
        return self.bn(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: save_script(BatchCentred(), p),
        lambda p: save_script(TrainModeBatchNorm().train(), p, torch.rand(8, 29)),  # traced in training mode
    ],
)
def test_batch_dependent_models_are_refused(tmp_path, capsys, make):
    path = make(tmp_path / "mixing.pt")
    line = assert_refused(
        ["run", path, "--aux", CANCER, "--out", tmp_path / "out"],
        capsys,
        tmp_path,
        "depends on the other samples in its batch",
    )
    assert "eval mode" in line


def test_batch_norm_in_eval_mode_is_accepted():
    from splitaudit.inputs.model_checks import check_batch_independence

    net = TrainModeBatchNorm().eval()
    x = torch.rand(16, 29)
    check_batch_independence(net, x, net(x), None)  # no error: samples are independent
    with pytest.raises(InputError, match="depends on the other samples"):
        net.train()
        check_batch_independence(net, x, net(x), None)


# --- 3. atomic, locked reports; any path bytes ------------------------------------------------------


@pytest.fixture
def fake_audit(monkeypatch):
    """The audit replaced by a saved result that passes, so that only the writing is exercised."""
    result = load_result(FIXTURES / "image_audit.json")
    monkeypatch.setattr(pipeline, "run_audit", lambda options, *_args, **_kwargs: dict(result))
    return result


def test_a_crash_while_rendering_leaves_no_report_that_passed(tmp_path, capsys, fake_audit, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"gate": {"passed": true}}')  # a stale report of an earlier run

    def broken(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_html_document", broken)
    code, _, err = run_cli(["run", MLP, "--aux", CANCER, "--out", out], capsys)
    assert code == 3 and "No space left" in err
    assert not (out / "report.json").exists()  # no report says it passed
    assert not list(out.glob(".*.tmp"))


def test_a_failed_write_keeps_the_old_file_whole(tmp_path, monkeypatch):
    (tmp_path / "report.html").write_text("old complete report")

    def full_disk(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_atomic(tmp_path, "report.html", b"new report" * 1000)
    assert (tmp_path / "report.html").read_text() == "old complete report"
    assert files_under(tmp_path) == {tmp_path / "report.html"}  # the temporary file is gone


def test_a_second_run_on_a_locked_folder_fails_fast(tmp_path, capsys, fake_audit):
    out = tmp_path / "out"
    out.mkdir()
    with output_lock(out):
        line = assert_refused(
            ["run", MLP, "--aux", CANCER, "--out", out], capsys, tmp_path, "another splitaudit run is writing to"
        )
        assert ".splitaudit.lock" in line
    code, _, _ = run_cli(["run", MLP, "--aux", CANCER, "--out", out], capsys)  # the lock is released
    assert code == 0 and sorted(p.name for p in out.iterdir()) == [
        "report.html",
        "report.json",
        "report.md",
        "report_images",
    ]


def test_non_utf8_paths_are_reported_with_escapes(tmp_path, capsys):
    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/data\xff"))  # not valid UTF-8
    folder.mkdir()
    shutil.copy(CANCER, folder / "d.npz")
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/out\xfe"))
    code, stdout, err = run_cli(
        ["run", MLP, "--aux", folder / "d.npz", "--attacks", "none", "--quick", "--out", out], capsys
    )
    assert code == 0, err
    assert "\\xfe" in stdout  # the written paths, printable
    saved = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert saved["data"]["aux_path"].endswith("data\\xff/d.npz")
    for page in ("report.html", "report.md"):
        assert "data\\xff" in (out / page).read_text(encoding="utf-8").replace("\\\\", "\\")


# --- 4. corrupt data is not a complete audit ---------------------------------------------------------


def test_complex_and_text_inputs_are_refused(tmp_path, capsys):
    x = np.load(CANCER)["x"]
    cancer_npz(tmp_path / "complex.npz", x=x + 1j * x)
    assert_refused(
        ["run", MLP, "--aux", tmp_path / "complex.npz"],
        capsys,
        tmp_path,
        "'x' must hold real numbers (bool, integer or float), got complex",
    )
    cancer_npz(tmp_path / "text.npz", x=x.astype(str))
    assert_refused(["run", MLP, "--aux", tmp_path / "text.npz"], capsys, tmp_path, "'x' must hold real numbers")


def test_duplicate_csv_columns_are_refused(tmp_path, capsys):
    rows = ["a,b,a,label"] + [f"{i},{i * 2},{i * 3},{i % 2}" for i in range(20)]
    (tmp_path / "d.csv").write_text("\n".join(rows))
    assert_refused(
        ["run", MLP, "--aux", tmp_path / "d.csv", "--label-column", "label"],
        capsys,
        tmp_path,
        "duplicate column names ('a')",
    )


@pytest.mark.parametrize("name", ["y", "attr"])
def test_non_integer_labels_or_attributes_are_refused(tmp_path, capsys, name):
    n = len(np.load(CANCER)["x"])
    cancer_npz(tmp_path / "d.npz", **{name: np.linspace(0, 1, n)})
    assert_refused(["run", MLP, "--aux", tmp_path / "d.npz"], capsys, tmp_path, f"'{name}' holds non-integer numbers")


def test_one_class_skips_label_attacks_with_the_reason(tmp_path):
    from conftest import make_context

    from splitaudit.attacks import get_attack

    n = len(np.load(CANCER)["x"])
    cancer_npz(tmp_path / "one.npz", y=np.zeros(n, dtype=int), attr=np.ones(n, dtype=int))
    ctx = make_context("breast_cancer_mlp.onnx", str(tmp_path / "one.npz"))
    for name in ("fine-tune", "kmeans"):
        entry = get_attack(name).run(ctx)
        assert entry["status"] == "skipped" and "single class" in entry["reason"], entry
    assert "single value" in get_attack("attribute").run(ctx)["reason"]
    assert get_attack("decoder").missing(ctx) is None  # reconstruction attacks still run


# --- 5. exit 2 up front ------------------------------------------------------------------------------


class IntegerOut(nn.Module):
    def forward(self, x):
        return (x * 10).long()


class ScalarOut(nn.Module):
    def forward(self, x):
        return x.sum()


@pytest.mark.parametrize(
    "module, fragment",
    [
        (IntegerOut(), "torch.int64 values; it must output floating-point embeddings"),
        (ScalarOut(), "returns shape () for 64 inputs; it must return one embedding per input"),
    ],
)
def test_integer_or_scalar_model_outputs_are_refused(tmp_path, capsys, module, fragment):
    path = save_script(module, tmp_path / "m.pt")
    assert_refused(["run", path, "--aux", CANCER], capsys, tmp_path, fragment)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda x: x[:3], "holds 3 samples; an audit needs at least 4"),
        (lambda x: x[:7], "has 7 samples: too few to split into aux and target parts of at least 4"),
        (lambda x: np.zeros_like(x), "every sample of 'x' is the same (constant data)"),
        (lambda x: np.full_like(x, 3.5), "every sample of 'x' is the same"),
    ],
)
def test_too_few_or_constant_samples_are_refused(tmp_path, capsys, make, fragment):
    x = make(np.load(CANCER)["x"])
    np.savez(tmp_path / "d.npz", x=x)
    assert_refused(["run", MLP, "--aux", tmp_path / "d.npz"], capsys, tmp_path, fragment)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--seed", str(2**64)], "--seed must be an integer >= 0 and <= 4294967280"),
        (["--seed", "-1"], "--seed must be an integer >= 0"),
        (["--noise-sigma", "1e308"], "--noise-sigma must be 0 or a number >= 1e-12 and <= 1e+12, got 1e+308"),
        (["--smoothing", "1e300"], "--smoothing must be 0 or a number >= 1e-12 and <= 1e+12, got 1e+300"),
        (["--out", ""], "--out is empty"),
    ],
)
def test_out_of_range_options_are_refused_before_loading(tmp_path, capsys, args, fragment, monkeypatch):
    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("loaded before validating"))
    assert_refused(["run", MLP, "--aux", CANCER, *args], capsys, tmp_path, fragment)


@pytest.mark.parametrize(
    "line, fragment",
    [
        ('noise_sigma = "0.1"', "--noise-sigma must be 0 or a number >= 1e-12 and <= 1e+12, got '0.1'"),
        ("seed = 1.5", "--seed must be an integer >= 0 and <= 4294967280, got 1.5"),
        ("quick = 1", "--quick must be true or false, got 1"),
        ("attacks = 3", "--attacks must be a list of strings, got 3"),
        ("attacks = [1, 2]", "--attacks must be a list of strings, got 1"),
        ("input_shape = [true]", "--input-shape must be a list of integers >= 1 and <= 2147483647, got True"),
        ("[attack]\nsdar = 3", "attack options for 'sdar' must be a table"),
    ],
)
def test_config_values_of_the_wrong_type_are_refused(tmp_path, capsys, line, fragment):
    (tmp_path / "audit.toml").write_text(f'model = "{MLP}"\naux = "{CANCER}"\n{line}\n')
    assert_refused(["run", "--config", tmp_path / "audit.toml"], capsys, tmp_path, fragment)


def test_out_that_is_a_file_or_under_a_file_is_refused_before_the_audit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("audited before checking --out"))
    (tmp_path / "file").write_text("keep me")
    assert_refused(
        ["run", MLP, "--aux", CANCER, "--out", tmp_path / "file"], capsys, tmp_path, "is a file, not a folder"
    )
    assert_refused(
        ["run", MLP, "--aux", CANCER, "--out", tmp_path / "file" / "sub"],
        capsys,
        tmp_path,
        f"is under {tmp_path / 'file'}, which is a file",
    )
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_out_is_refused_before_the_audit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("audited before checking --out"))
    (tmp_path / "ro").mkdir(mode=0o500)
    assert_refused(
        ["run", MLP, "--aux", CANCER, "--out", tmp_path / "ro" / "out"],
        capsys,
        tmp_path,
        "cannot create the output folder",
    )


# --- 6. denial of service ------------------------------------------------------------------------------


def constant_of_shape_bomb(path: Path, elements: int) -> Path:
    """x + sum(ConstantOfShape([elements])): onnx2pytorch would sum `elements` ones on every pass."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([elements], dtype=np.int64), "shape")
    nodes = [
        helper.make_node(
            "ConstantOfShape", ["shape"], ["big"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])
        ),
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
        helper.make_node("Add", ["x", "s"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bomb",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 30])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 30])],
        [shape],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_onnx_declaring_a_huge_tensor_is_refused_before_running(tmp_path, capsys):
    path = constant_of_shape_bomb(tmp_path / "bomb.onnx", 10**13)
    started = time.monotonic()
    line = assert_refused(
        ["run", path, "--aux", CANCER], capsys, tmp_path, "tensor 'big' declares shape [10000000000000]"
    )
    assert "a quarter of this machine's memory" in line
    assert time.monotonic() - started < 60  # it hung for > 300 s before; a loose bound, not a timing test


def test_model_checks_have_a_time_limit():
    from splitaudit.inputs.model_checks import within_time_limit

    assert within_time_limit(lambda a: a + 1, 1, seconds=30) == 2
    with pytest.raises(InputError, match=r"did not finish within 0.2 s \(the limit for loading checks\)"):
        within_time_limit(time.sleep, 3, seconds=0.2)
    with pytest.raises(KeyError):  # errors inside the check reach the caller unchanged
        within_time_limit({}.__getitem__, "missing", seconds=30)


def test_npz_zip_bomb_fails_on_declared_sizes(tmp_path, capsys, monkeypatch):
    np.savez_compressed(tmp_path / "bomb.npz", x=np.zeros((20_000, 1000), dtype=np.float32))  # 80 MB -> ~80 kB
    assert (tmp_path / "bomb.npz").stat().st_size < 1_000_000
    assert_refused(["run", MLP, "--aux", tmp_path / "bomb.npz"], capsys, tmp_path, "a zip bomb")
    monkeypatch.setattr("splitaudit.inputs.data.memory_limit_bytes", lambda: 1024**2)
    np.savez(tmp_path / "big.npz", x=np.random.rand(600, 300))  # 1.4 MB, over a 1 MiB limit
    assert_refused(
        ["run", MLP, "--aux", tmp_path / "big.npz"],
        capsys,
        tmp_path,
        "declares 1.37 MiB of arrays; splitaudit loads at most 1 MiB",
    )


def test_npy_header_declaring_a_huge_shape_is_refused(tmp_path, capsys):
    import zipfile

    header = {"descr": "<f4", "fortran_order": False, "shape": (10**12, 30)}
    with zipfile.ZipFile(tmp_path / "liar.npz", "w") as archive, archive.open("x.npy", "w") as member:
        np.lib.format.write_array_header_1_0(member, header)
        member.write(b"\0" * 120)
    assert_refused(["run", MLP, "--aux", tmp_path / "liar.npz"], capsys, tmp_path, "declares 1.12e+05 GiB of arrays")


@pytest.mark.parametrize("role", ["--aux", "--config", "render"])
def test_fifos_are_refused_without_blocking(tmp_path, capsys, role):
    fifo = tmp_path / ("pipe.npz" if role == "--aux" else "pipe.toml" if role == "--config" else "pipe.json")
    os.mkfifo(fifo)
    args = {"--aux": ["run", MLP, "--aux", fifo], "--config": ["run", "--config", fifo], "render": ["render", fifo]}[
        role
    ]
    assert_refused(args, capsys, tmp_path, "is not a regular file (a FIFO, socket or device?)")


# --- 7. minor ----------------------------------------------------------------------------------------


def test_sigint_exits_130_with_one_line(tmp_path, capsys, monkeypatch):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_audit", interrupted)
    assert_refused(
        ["run", MLP, "--aux", CANCER, "--out", tmp_path / "out"], capsys, tmp_path, "interrupted (SIGINT)", code=130
    )
    assert not (tmp_path / "out" / ".splitaudit.lock").exists()


def test_calibrate_json_is_strict_json(tmp_path, capsys, monkeypatch):
    assert_refused(
        ["calibrate", MLP, "--aux", CANCER, "--json", "--target-mse", "inf"],
        capsys,
        tmp_path,
        "--target-mse must be a number > 0 and <= 1e+12, got inf",
    )
    from splitaudit.stages import calibration, leakage

    unchanging = SimpleNamespace(encoder=SimpleNamespace(confirm_unchanged=lambda when: None, batch_note=None))
    monkeypatch.setattr(pipeline, "prepare_audit", lambda *a, **k: (unchanging, []))
    monkeypatch.setattr(leakage, "measure", lambda *a, **k: None)
    monkeypatch.setattr(
        calibration, "calibration_answer", lambda *a, **k: {"sigma": math.inf, "sigma_unbiased": math.nan}
    )
    code, out, _ = run_cli(["calibrate", MLP, "--aux", CANCER, "--json", "--target-mse", "1"], capsys)

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    assert code == 0 and json.loads(out, parse_constant=no_constants) == {"sigma": "inf", "sigma_unbiased": "nan"}


def test_npz_errors_never_suggest_allow_pickle(tmp_path, capsys):
    (tmp_path / "text.npz").write_text("not a zip at all")
    assert_refused(["run", MLP, "--aux", tmp_path / "text.npz"], capsys, tmp_path, "is not an .npz file (not a zip")
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}] * 10, dtype=object))
    line = assert_refused(
        ["run", MLP, "--aux", tmp_path / "objects.npz"],
        capsys,
        tmp_path,
        "object arrays, which splitaudit never unpickles",
    )
    assert "allow_pickle" not in line
    assert "allow_pickle" not in run_cli(["run", MLP, "--aux", tmp_path / "text.npz"], capsys)[2]


def two_output_onnx(path: Path) -> Path:
    """Outputs 'doubled' = 2x (first) and 'squashed' = tanh(x)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    nodes = [helper.make_node("Mul", ["x", "two"], ["doubled"]), helper.make_node("Tanh", ["x"], ["squashed"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 30]) for n in ("doubled", "squashed")]
    graph = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 30])], outputs, [two]
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_multi_output_onnx_says_which_output_and_takes_output_name(tmp_path, capsys):
    from splitaudit.inputs.models import open_model, prepare_encoder

    path = two_output_onnx(tmp_path / "two.onnx")
    x = torch.rand(16, 30)
    first = prepare_encoder(open_model(path, torch.device("cpu")), x)
    assert any("2 outputs (doubled, squashed); auditing the first, 'doubled'" in w for w in first.warnings)
    torch.testing.assert_close(first.embed(x), 2 * x)
    chosen = prepare_encoder(open_model(path, torch.device("cpu"), "squashed"), x)
    assert chosen.differentiable and not chosen.warnings
    torch.testing.assert_close(chosen.embed(x), torch.tanh(x), rtol=1e-5, atol=1e-6)
    assert_refused(
        ["run", path, "--aux", CANCER, "--output-name", "logits"],
        capsys,
        tmp_path,
        "--output-name 'logits' is not an output of",
    )


class NanAboveTwo(nn.Module):
    """NaN embedding for any sample whose first feature exceeds 2 (one sample, far past the first 64)."""

    def forward(self, x):
        return torch.where(x[:, :1] > 2, torch.full_like(x, float("nan")), 2 * x)


def test_nan_embeddings_past_the_parity_batch_are_caught(tmp_path, capsys):
    x = np.random.default_rng(0).random((200, 30)).astype(np.float32)
    x[150, 0] = 5.0
    np.savez(tmp_path / "d.npz", x=x)
    path = save_script(NanAboveTwo(), tmp_path / "m.pt")
    assert_refused(
        ["run", path, "--aux", tmp_path / "d.npz"], capsys, tmp_path, "NaN or infinite embeddings for 1 of 100"
    )


def test_render_and_compare_survive_malformed_json(tmp_path, capsys):
    cases = {
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "list.json": "[1, 2]",
        "latin1.json": b'{"a": "\xe9"}',
        "number.json": "3",
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    fragments = {
        "deep.json": "is not a splitaudit report.json (nested too deeply)",
        "list.json": "is not a splitaudit report.json (no schema_version)",
        "latin1.json": "is not a splitaudit report.json (not UTF-8 text",
        "number.json": "is not a splitaudit report.json (no schema_version)",
    }
    for name, fragment in fragments.items():
        assert_refused(["render", tmp_path / name, "--out", tmp_path / "out"], capsys, tmp_path, fragment)
        assert_refused(
            ["compare", tmp_path / name, FIXTURES / "image_audit.json", "--out", tmp_path / "cmp"],
            capsys,
            tmp_path,
            fragment,
        )
