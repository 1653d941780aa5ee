"""Hostile data and report files: tiny files that declare huge sizes, strings that are markup in
Markdown or mathtext in charts, symlinks out of a data folder, and what Excel writes. Each ends
in exit 2 with one line that names the cause, or works; memory is checked before it is taken.

Every input is built here, small; the runs that could exhaust memory without their fix run in a
child process whose address space is capped, with its peak resident memory measured."""

from __future__ import annotations

import copy
import json
import os
import re
import resource
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import sample
from PIL import Image
from test_hostile_inputs import assert_refused, run_cli

from splitaudit.core.errors import InputError
from splitaudit.core.safety import GIB, MEMORY_LIMIT_VARIABLE, memory_limit_bytes
from splitaudit.inputs.data import MAX_IMAGE_PIXELS, load_dataset
from splitaudit.verdicts.gate import evaluate_gate
from tests.support.token_models import TokenBottom, save_token_data, save_token_model

FIXTURES = Path(__file__).parent / "fixtures"
DIGITS_TS, DIGITS_ONNX, CANCER = sample("digits_cnn.pt"), sample("digits_cnn.onnx"), sample("breast_cancer.npz")
CHILD_ADDRESS_SPACE = 8 * GIB  # a regression fails its test with MemoryError instead of filling the machine
PEAK_LIMIT = GIB  # the runs below stay far under it; before their fixes they took 5 to 12 GB or more
THRESHOLDS = ("fail_under_mse", "fail_under_attack_mse", "max_advantage")


def run_measured(args, timeout: float = 120, env: dict | None = None) -> tuple[int, str, int]:
    """(exit code, stderr, peak resident memory in bytes) of `python -m splitaudit ARGS` in its own
    process, capped at CHILD_ADDRESS_SPACE and killed after `timeout` seconds."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))

    with open(os.devnull, "wb") as devnull, open("stderr.txt", "w+b") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "splitaudit", *map(str, args)],
            stdout=devnull,
            stderr=err,
            env={**os.environ, **(env or {})},
            preexec_fn=cap,
        )
        timer = threading.Timer(timeout, child.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)
        finally:
            timer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return child.returncode, err.read().decode("utf-8", "replace"), usage.ru_maxrss * 1024


def assert_one_line(code: int, err: str, fragment: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("splitaudit: error:"), err
    assert fragment in lines[0], lines[0]
    return lines[0]


def png_bytes(size: int = 16, mode: str = "RGB", seed: int = 0) -> bytes:
    """A PNG of random pixels."""
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    path = Path("tmp.png")
    Image.fromarray(pixels).convert(mode).save(path)
    data = path.read_bytes()
    path.unlink()
    return data


def png_declaring(width: int, height: int) -> bytes:
    """A PNG of a few hundred bytes whose header declares width x height pixels (a decompression bomb)."""
    data = bytearray(png_bytes(8, "L"))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


def image_folder(root: Path, first: bytes, count: int, rest: bytes | None = None) -> Path:
    """root/a/*.png and root/b/*.png: `first` as the first image, `rest` (16x16) for the others."""
    rest = rest or png_bytes(seed=1)
    for index in range(count):
        folder = root / "ab"[index % 2]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index:05d}.png").write_bytes(first if index == 0 else rest)
    return root


# --- memory from tiny files --------------------------------------------------------------------------


def test_a_tiny_tokenizer_json_declaring_an_id_of_10_to_the_12_is_refused_before_allocating(tmp_path):
    model = save_token_model(TokenBottom().eval(), "torchscript", tmp_path)
    data, _ = save_token_data(tmp_path)
    vocab = {f"w{i}": i for i in range(40)}
    spec = {"model": {"type": "WordLevel", "vocab": vocab}, "added_tokens": [{"id": 10**12, "content": "[X]"}]}
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps(spec))
    assert tokenizer.stat().st_size < 1024
    code, err, peak = run_measured(
        ["run", model, "--aux", data, "--vocab", tokenizer, "--attacks", "none", "--device", "cpu"]
    )
    line = assert_one_line(code, err, "the id 1000000000000")
    assert "embedding table has 40 rows" in line
    assert peak < PEAK_LIMIT, peak


def test_vocabulary_ids_that_are_not_integers_or_are_negative_are_refused(tmp_path, capsys):
    model = save_token_model(TokenBottom().eval(), "torchscript", tmp_path)
    data, _ = save_token_data(tmp_path)
    for bad in ("7", -1, 2.5, None):
        spec = {"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": bad, "content": "[X]"}]}
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
        args = ["run", model, "--aux", data, "--vocab", tmp_path / "tokenizer.json", "--out", tmp_path / "out"]
        assert_refused(args, capsys, tmp_path, "ids must be integers from 0 to 39")


def test_an_image_folder_too_large_at_its_first_images_size_exits_2_before_decoding(tmp_path):
    """The first image is 2000 x 2000 and the model declares no input size (TorchScript), so every
    image would be loaded at 3 x 2000 x 2000 floats: one more image than the memory limit holds is
    refused on the header and the file count alone, in seconds and far below 1 GB."""
    per_image = 3 * 2000 * 2000 * 4
    Image.new("RGB", (2000, 2000), (10, 200, 30)).save(tmp_path / "big.png")
    folder = image_folder(tmp_path / "imgs", (tmp_path / "big.png").read_bytes(), memory_limit_bytes() // per_image + 1)
    args = ["run", DIGITS_TS, "--aux", folder, "--attacks", "none", "--device", "cpu", "--out", tmp_path / "out"]
    code, err, peak = run_measured(args, timeout=60)
    line = assert_one_line(code, err, "as float32 at 3x2000x2000, the first image's size")
    assert "a quarter of this machine's memory" in line and MEMORY_LIMIT_VARIABLE in line
    assert peak < PEAK_LIMIT, peak
    assert not (tmp_path / "out" / "report.json").exists()


def test_the_memory_limit_can_be_set_and_a_bad_setting_is_one_line(tmp_path, capsys, monkeypatch):
    folder = image_folder(tmp_path / "imgs", png_bytes(), 100)
    args = ["run", DIGITS_ONNX, "--aux", folder, "--out", tmp_path / "out"]
    monkeypatch.setenv(MEMORY_LIMIT_VARIABLE, "0.00002")  # 21 KB: the model's 6 KB pass, 100 x 1 x 8 x 8 floats do not
    line = assert_refused(args, capsys, tmp_path, "take 0.0244 MiB as float32 at 1x8x8, the model's input size")
    assert line.endswith(f"loads at most 0.0205 MiB (set by {MEMORY_LIMIT_VARIABLE}): use fewer images")
    monkeypatch.setenv(MEMORY_LIMIT_VARIABLE, "lots")
    assert_refused(args, capsys, tmp_path, f"{MEMORY_LIMIT_VARIABLE}='lots' is not a number of GiB above 0")
    monkeypatch.setenv(MEMORY_LIMIT_VARIABLE, "0.5")
    assert memory_limit_bytes() == GIB // 2


@pytest.mark.parametrize("pixels", [MAX_IMAGE_PIXELS + 1, 3 * MAX_IMAGE_PIXELS])
def test_a_decompression_bomb_is_refused_on_its_header(tmp_path, capsys, pixels):
    """A PNG of a few hundred bytes declaring 89 million pixels or more (PIL only warns up to twice its
    threshold, and would decode it) is refused before it is decoded, also when it is not the first image."""
    side = int(pixels**0.5) + 1
    folder = image_folder(tmp_path / "imgs", png_bytes(8, "L"), 8, rest=png_declaring(side, side))
    line = assert_refused(
        ["run", DIGITS_ONNX, "--aux", folder, "--out", tmp_path / "out"], capsys, tmp_path, "a/00002.png"
    )
    assert "pixels" in line


# --- symlinks out of an image folder, a CSV with a byte-order mark ---------------------------------------


def test_an_image_symlinked_from_outside_the_folder_is_refused_and_one_inside_is_read(tmp_path, capsys):
    folder = image_folder(tmp_path / "imgs", png_bytes(), 8)
    (tmp_path / "private.png").write_bytes(png_bytes(16, "L"))
    (folder / "b" / "inside.png").symlink_to(folder / "a" / "00000.png")
    assert len(load_dataset(folder, (1, 8, 8))) == 9  # a symlink to an image of the folder is fine
    (folder / "a" / "zz.png").symlink_to(tmp_path / "private.png")
    line = assert_refused(["run", DIGITS_ONNX, "--aux", folder, "--out", tmp_path / "out"], capsys, tmp_path, "zz.png")
    assert "leads out of the data folder" in line and "private.png" in line
    (folder / "a" / "zz.png").unlink()
    (folder / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.png").write_bytes(png_bytes())
    with pytest.raises(InputError, match="leads out of the data folder"):  # a class folder that is a symlink
        load_dataset(folder, (1, 8, 8))


def test_a_csv_with_a_byte_order_mark_loads_and_one_not_in_utf8_is_one_line(tmp_path, capsys):
    x = np.load(CANCER)["x"][:40]
    rows = ["label," + ",".join(f"f{i}" for i in range(x.shape[1]))]
    rows += [f"{i % 2}," + ",".join(f"{v:.6g}" for v in row) for i, row in enumerate(x)]
    (tmp_path / "excel.csv").write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows).encode())
    data = load_dataset(tmp_path / "excel.csv", label_column="label")
    assert data.x.shape == x.shape and data.class_names == ["0", "1"]
    (tmp_path / "latin1.csv").write_bytes("label,caf\xe9\n0,1\n".encode("latin-1"))
    assert_refused(
        ["run", sample("breast_cancer_mlp.onnx"), "--aux", tmp_path / "latin1.csv", "--out", tmp_path / "out"],
        capsys,
        tmp_path,
        "is not UTF-8 text",
    )


# --- crafted report.json files ------------------------------------------------------------------------


def crafted(tmp_path: Path, fixture: str, edit) -> Path:
    """A schema-valid copy of a fixture with `edit` applied and its gate recomputed (so that only the edit
    is hostile, not a contradiction the consistency check would refuse)."""
    result = json.loads((FIXTURES / fixture).read_text())
    edit(result)
    result["gate"] = evaluate_gate(result, **{k: result["gate"][k] for k in THRESHOLDS})
    path = tmp_path / "in" / "crafted.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result))
    return path


def _label_examples(label: str):
    def edit(result):
        for attack in result["attacks"].values():
            for example in attack.get("examples") or []:
                example["label"] = label

    return edit


def test_mathtext_in_labels_and_names_renders_as_text(tmp_path, capsys):
    def edit(result):
        _label_examples(r"$\foo{$")(result)
        result["attacks"][r"$\sqrt{$"] = result["attacks"].pop("decoder")

    report = crafted(tmp_path, "image_audit.json", edit)
    code, out, err = run_cli(["render", report, "--format", "html,md,sarif", "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    assert r"$\\foo{$" in (tmp_path / "out" / "report.md").read_text()  # shown, backslash escaped for Markdown


def test_a_long_label_does_not_size_the_canvas(tmp_path):
    report = crafted(tmp_path, "image_audit.json", _label_examples("W" * 200_000 + "\n" * 5_000))
    code, err, peak = run_measured(["render", report, "--format", "html,md", "--out", tmp_path / "out"], timeout=60)
    assert code == 0, err
    assert peak < PEAK_LIMIT, peak  # 5.3 GB and 70 s before labels were cut


def test_a_report_with_thousands_of_examples_is_refused_before_its_canvas_exists(tmp_path, capsys):
    def edit(result):
        examples = result["attacks"]["decoder"]["examples"]
        result["attacks"]["decoder"]["examples"] = [copy.deepcopy(examples[0]) for _ in range(2_000)]

    report = crafted(tmp_path, "image_audit.json", edit)
    assert_refused(["render", report, "--out", tmp_path / "out"], capsys, tmp_path, "million a chart may take")


def test_an_unknown_attack_in_violated_by_is_refused_with_its_name(tmp_path, capsys):
    def edit(result):
        result["bounds"]["violated_by"] = ["ghost"]

    report = crafted(tmp_path, "image_audit.json", edit)
    args = ["render", report, "--format", "html,md,sarif", "--out", tmp_path / "out"]
    assert_refused(args, capsys, tmp_path, "bounds.violated_by names 'ghost', which is no attack of it")


def test_a_token_attack_beating_the_token_ceilings_is_a_sarif_finding(tmp_path, capsys):
    """The token statement adds the token attacks that beat its ceilings to bounds.violated_by; they
    measure token accuracy, not an MSE (SARIF raised KeyError: 'mse')."""

    def edit(result):
        result["attacks"]["token-inversion"] = {
            **copy.deepcopy(result["attacks"]["attribute"]),
            "metrics": {"token_accuracy": 0.97, "exact_match": 0.8},
            "baseline": {"token_accuracy": 0.4, "exact_match": 0.0},
            "metrics_std": {},
            "baseline_std": {},
        }
        result["bounds"]["violated_by"] = ["token-inversion"]

    report = crafted(tmp_path, "image_audit.json", edit)
    code, _, err = run_cli(["render", report, "--format", "sarif", "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "report.sarif").read_text())["runs"][0]["results"]
    finding = next(r for r in results if r["ruleId"] == "bound-violated")
    assert "token accuracy 0.97" in finding["message"]["text"]


INJECTED = "evil\n# PASSED\n\n| fake | row |\n- [x] all good\n1. done\n===\n"


def test_markdown_from_labels_and_names_stays_in_its_line_and_cell(tmp_path, capsys):
    """A failing report whose model path, class names, example labels and an attack name carry
    newlines, a heading, pipes and list markers: report.md keeps its FAILED headline, has no
    line starting with '# PASSED', and every table keeps its columns."""

    def edit(result):
        result["model"]["path"] = f"/models/{INJECTED}model.onnx"
        result["data"]["class_names"] = [INJECTED, "b|c"]
        result["attacks"][INJECTED] = result["attacks"].pop("decoder")
        _label_examples(INJECTED)(result)

    report = crafted(tmp_path, "sigma0_audit.json", edit)
    code, _, err = run_cli(["render", report, "--format", "md", "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    lines = (tmp_path / "out" / "report.md").read_text().splitlines()
    assert lines[0].startswith("# ❌ FAILED")
    assert not [line for line in lines if re.match(r"\s*(#+ PASSED|===|- \[x\]|1\. done|\| fake)", line)]
    for table in markdown_tables(lines):
        assert len({len(re.findall(r"(?<!\\)\|", row)) for row in table}) == 1, table
    assert sum("evil \\# PASSED" in line for line in lines) >= 4  # shown, on one line each time


def markdown_tables(lines: list[str]) -> list[list[str]]:
    """Runs of consecutive lines that start with '|'."""
    tables, current = [], []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables
