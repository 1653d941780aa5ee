"""Hostile model archives: torch.export programs
(.pt2) and TorchScript archives that would run code, import modules or create files while torch
loads or runs them. Each is a real small model saved by torch, then rewritten with zipfile; each
is refused with exit 2 and one line on stderr (before torch reads the archive, or for operators
before the model runs), and the file its payload would create does not exist.

That legitimate programs and TorchScript models still load and audit: test_exported.py and
test_loading.py (and test_the_untouched_archives_load below, for the archives rewritten here).
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Tuple

import pytest
import torch
import torch.nn as nn
from conftest import sample
from test_exported import Touches, export
from test_hostile_inputs import assert_refused

from splitaudit.core.errors import InputError
from splitaudit.inputs import torch_archives
from splitaudit.inputs.exported_archive import PT2, check_expression
from splitaudit.inputs.models import open_model
from splitaudit.inputs.torch_archives import Archive
from splitaudit.inputs.torchscript_archive import TORCHSCRIPT

CPU = torch.device("cpu")
DIGITS = sample("digits.npz")  # 1x8x8 images


class DigitsEncoder(nn.Module):
    """A bottom for the digits data with a weight, a bias and a tensor constant (so the program has
    weights and constants configs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x.flatten(1))) + torch.tensor(0.5)


class SetsState(nn.Module):
    """A scripted module whose __setstate__ (run by torch.jit.load) writes a file."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 16)
        self.marker = marker

    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, str]:
        return self.linear.weight, self.marker

    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, str]) -> None:
        torch.save(state[0], state[1])
        self.training = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x.flatten(1)))


class CreatesFiles(nn.Module):
    """A scripted module whose forward creates a file (torch.from_file with shared=True)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        created = torch.from_file(self.marker, shared=True, size=4)
        return torch.tanh(x.flatten(1)) + created.sum() * 0


@pytest.fixture
def program(tmp_path) -> Path:
    return export(DigitsEncoder().eval(), torch.rand(2, 1, 8, 8), tmp_path / "program.pt2", dynamic=True)


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "script.pt"
    with warnings.catch_warnings():  # the trace takes torch.tensor(0.5) for a constant, as it is
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.jit.trace(DigitsEncoder().eval(), torch.rand(2, 1, 8, 8)).save(str(path))
    return path


@pytest.fixture
def marker(tmp_path) -> Path:
    """The file a payload would create; it must never exist."""
    return tmp_path / "code-ran"


def rewrite(source: Path, target: Path, change) -> Path:
    """A copy of the zip archive `source` whose members pass through change(name, data), which
    returns the (name, data) pairs to write instead."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for name in old.namelist():
            for new_name, data in change(name, old.read(name)):
                new.writestr(new_name, data)
    return target


def edit_program(source: Path, target: Path, edit) -> Path:
    """A copy of the program whose models/model.json went through edit(document)."""

    def change(name, data):
        if not name.endswith("models/model.json"):
            return [(name, data)]
        document = json.loads(data)
        edit(document)
        return [(name, json.dumps(document).encode())]

    return rewrite(source, target, change)


def pickled(obj) -> bytes:
    """obj in torch.save's zip format, as torch.export.save writes its pickled members."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def refused(args, capfd, root: Path, fragment: str) -> str:
    """The CLI exits 2 with one line on stderr holding `fragment` (stdout and stderr captured at the
    file-descriptor level: torch's log handlers write there), and writes nothing under root."""
    capfd.readouterr()  # what building the archive printed
    return assert_refused(args, capfd, root, fragment)


def test_the_untouched_archives_load(program, script):
    """The archives the tests below rewrite are accepted as saved: each refusal is the rewrite's."""
    for path in (program, script):
        assert open_model(path, CPU).torch_module(torch.rand(3, 1, 8, 8)).shape == (3, 16)


class ReaderWithoutSizes:
    """torch 2.11's PyTorchFileReader: it reads records as newer ones do but states no record sizes."""

    def __init__(self, buffer) -> None:
        self._reader = REAL_READER(buffer)

    def __getattr__(self, name: str):
        if name == "get_record_size":
            raise AttributeError(name)
        return getattr(self._reader, name)


REAL_READER = torch._C.PyTorchFileReader


def test_member_sizes_are_the_ones_torch_reads_and_need_no_size_method_of_its_reader(program, script, monkeypatch):
    """The memory check's sizes come from the zip's central directory, as torch's reader allocates by:
    equal to what the reader states where it does, and available where it does not (torch <= 2.11)."""
    for path in (program, script):
        data = path.read_bytes()
        layout = PT2 if path.suffix == ".pt2" else TORCHSCRIPT
        archive = Archive(data, path.name, layout)
        reader = REAL_READER(io.BytesIO(data))
        assert archive.sizes == {name: reader.get_record_size(name) for name in reader.get_all_records()}
    monkeypatch.setattr(torch_archives, "PyTorchFileReader", ReaderWithoutSizes)
    for path in (program, script):
        assert open_model(path, CPU).torch_module(torch.rand(3, 1, 8, 8)).shape == (3, 16)


# --- a pickle member spelled in other letter case -----------------------------------------------------


@pytest.mark.parametrize("command", ["run", "calibrate", "top-model"])
def test_sample_inputs_in_upper_case_are_refused_by_every_command(program, marker, tmp_path, capfd, command):
    """torch's reader finds data/sample_inputs/model.pt as MODEL.PT (it ignores letter case) and, the
    safe load failing, unpickles it with weights_only=False: the marker would be created and the
    audit exit 0. run, calibrate and --top-model open models through the same loader."""
    hostile = rewrite(
        program,
        tmp_path / "hostile.pt2",
        lambda name, data: (
            [(name.replace("model.pt", "MODEL.PT"), pickled(Touches(marker)))]
            if name.endswith("sample_inputs/model.pt")
            else [(name, data)]
        ),
    )
    args = {
        "run": ["run", hostile, "--aux", DIGITS, "--attacks", "none", "--quick"],
        "calibrate": ["calibrate", hostile, "--aux", DIGITS, "--target-mse", "0.01"],
        "top-model": [
            "run",
            sample("digits_cnn.onnx"),
            "--aux",
            DIGITS,
            "--top-model",
            hostile,
            "--attacks",
            "none",
            "--quick",
        ],
    }[command]
    line = refused(args, capfd, tmp_path, "data/sample_inputs/MODEL.PT, spelled in other letter case")
    assert "hostile.pt2" in line and not marker.exists()


def opaque_constant(marker: Path, twin: bool):
    """A constants config declaring an opaque_obj_ constant, whose member torch would pickle.loads.
    As a twin spelled _config.JSON placed before the real config, it is the one torch's
    case-blind lookup returns, while a check reading names as written sees only the clean one."""

    def change(name, data):
        if not name.endswith("model_constants_config.json"):
            return [(name, data)]
        config = json.loads(data)
        config["config"]["evil"] = {
            "path_name": "opaque_obj_0",
            "is_param": False,
            "use_pickle": True,
            "tensor_meta": None,
        }
        folder = name.rsplit("/", 1)[0]
        hostile = [(f"{folder}/opaque_obj_0", pickle.dumps(Touches(marker)))]
        if twin:
            return [(name[: -len("json")] + "JSON", json.dumps(config).encode()), *hostile, (name, data)]
        return [(name, json.dumps(config).encode()), *hostile]

    return change


@pytest.mark.parametrize(
    ("twin", "fragment"), [(True, "which torch's reader cannot tell apart"), (False, "Python object constant")]
)
def test_opaque_object_constants_are_refused(program, marker, tmp_path, capfd, twin, fragment):
    hostile = rewrite(program, tmp_path / "hostile.pt2", opaque_constant(marker, twin))
    refused(["run", hostile, "--aux", DIGITS, "--attacks", "none", "--quick"], capfd, tmp_path, fragment)
    assert not marker.exists()


# --- what else torch.export.load would run -------------------------------------------------------------


def test_aotinductor_payloads_are_refused(program, tmp_path, capfd):
    """torch.export.load loads the shared libraries of data/aotinductor/ (their constructors run)."""
    hostile = rewrite(
        program,
        tmp_path / "hostile.pt2",
        lambda name, data: (
            [(name, data)]
            + (
                [(name.replace("archive_format", "data/aotinductor/model/model.so"), b"\x7fELF")]
                if name.endswith("/archive_format")
                else []
            )
        ),
    )
    refused(["run", hostile, "--aux", DIGITS, "--attacks", "none", "--quick"], capfd, tmp_path, "AOTInductor payload")


def sympified_size(marker):
    """torch reads every expr_str with sympy.sympify, which evals it, as it loads the program."""

    def edit(document):
        sizes = document["graph_module"]["graph"]["tensor_values"]["x"]["sizes"]
        sizes[0] = {
            "as_expr": {"expr_str": f"__import__('pathlib').Path('{marker}').touch() or 2", "hint": {"as_int": 2}}
        }

    return edit


def guards_code(marker):
    """program.module() execs guards_code; the guard runs on every call."""

    def edit(document):
        document["guards_code"] = [f"__import__('pathlib').Path('{marker}').touch() is None"]

    return edit


def file_creating_node(marker):
    """A node calling aten.from_file(shared=True) creates its file when the model runs."""

    def edit(document):
        graph = document["graph_module"]["graph"]
        graph["tensor_values"]["created"] = dict(
            graph["tensor_values"]["x"], sizes=[{"as_int": 4}], strides=[{"as_int": 1}]
        )
        arguments = [("filename", {"as_string": str(marker)}), ("shared", {"as_bool": True}), ("size", {"as_int": 4})]
        node = {
            "target": "torch.ops.aten.from_file.default",
            "inputs": [{"name": key, "arg": value, "kind": 1} for key, value in arguments],
            "outputs": [{"as_tensor": {"name": "created"}}],
            "metadata": {},
            "is_hop_single_tensor_return": None,
            "name": "created",
        }
        graph["nodes"].insert(0, node)

    return edit


def importing_spec(marker):
    """A defaultdict in the output spec: torch imports the module its factory names (here one that
    creates the marker, beside it on sys.path)."""
    module = f"creates_marker_{abs(hash(str(marker)))}"
    (marker.parent / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")

    def edit(document):
        context = {"default_factory_module": module, "default_factory_name": "list", "dict_context": []}
        spec = {"type": "collections.defaultdict", "context": context, "children_spec": []}
        document["graph_module"]["module_call_graph"][0]["signature"]["out_spec"] = json.dumps([1, spec])

    return edit


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (sympified_size, "shape expression"),
        (guards_code, "guards code"),
        (file_creating_node, "calls torch.ops.aten.from_file.default"),
        (importing_spec, "collections.defaultdict"),
    ],
)
def test_programs_that_would_run_code_are_refused(program, marker, tmp_path, capfd, monkeypatch, edit, fragment):
    monkeypatch.syspath_prepend(str(tmp_path))
    hostile = edit_program(program, tmp_path / "hostile.pt2", edit(marker))
    refused(["run", hostile, "--aux", DIGITS, "--attacks", "none", "--quick"], capfd, tmp_path, fragment)
    assert not marker.exists()


@pytest.mark.parametrize(
    "text",
    ["Min(Integer(16), Mul(Integer(16), Symbol('s77', positive=True, integer=True)))", "Float('1.5', precision=53)"],
)
def test_shape_expressions_torch_writes_are_accepted(text):
    check_expression(text, "program.pt2")


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "Integer(1).__class__",
        "Integer('1' * 999999999)",  # a string of a billion digits
        "Pow(Integer(10), Integer(999999999))",  # a number of a billion digits
        "Symbol('s0', positive='s0')",
    ],
)
def test_shape_expressions_outside_the_grammar_are_refused(text):
    with pytest.raises(InputError, match="shape expression .* outside the expressions torch writes"):
        check_expression(text, "program.pt2")


# --- TorchScript: what torch.jit.load's unpickler reaches ---------------------------------------------


def reducing_pickle(module: str, name: str, argument: str) -> bytes:
    """A protocol-2 pickle that calls module.name(argument) (GLOBAL, then REDUCE)."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + pickle.dumps(argument, protocol=2)[2:-1] + b"\x85R."


def hostile_data_pickle(script: Path, target: Path, module: str, name: str, marker: Path) -> Path:
    argument = f"touch {marker}" if name == "system" else f"__import__('pathlib').Path('{marker}').touch()"
    payload = reducing_pickle(module, name, argument)
    return rewrite(script, target, lambda n, d: [(n, payload if n.endswith("/data.pkl") else d)])


@pytest.mark.parametrize(("module", "name"), [("os", "system"), ("builtins", "eval")])
def test_torchscript_pickles_refer_only_to_names_torch_writes(script, marker, tmp_path, capfd, module, name):
    hostile = hostile_data_pickle(script, tmp_path / "hostile.pt", module, name, marker)
    fragment = f"data.pkl refers to {module}.{name}, which torch.jit.load would import or resolve"
    refused(["run", hostile, "--aux", DIGITS, "--attacks", "none", "--quick"], capfd, tmp_path, fragment)
    assert not marker.exists()


@pytest.mark.parametrize(("module", "name"), [("os", "system"), ("builtins", "eval")])
def test_torch_resolves_other_globals_as_torchscript_classes_and_runs_no_python(script, marker, tmp_path, module, name):
    """What torch.jit.load itself does with such a pickle (the evidence for the allow-list's reach):
    its C++ unpickler imports no Python; a name outside its fixed set (tensors, storages, containers,
    torch.jit._pickle) is looked up as a TorchScript class of the archive's code/, and fails."""
    hostile = hostile_data_pickle(script, tmp_path / "hostile.pt", module, name, marker)
    with pytest.raises(RuntimeError, match=rf"{module}\.{name}"):
        torch.jit.load(str(hostile))
    assert not marker.exists()


def test_torchscript_setstate_is_refused_before_loading(marker, tmp_path, capfd):
    """torch.jit.load runs a class's __setstate__ (TorchScript, which may call aten::save) as it
    unpickles the object: without the check the marker is written during loading."""
    path = tmp_path / "setstate.pt"
    torch.jit.script(SetsState(str(marker))).save(str(path))
    refused(["run", path, "--aux", DIGITS, "--attacks", "none", "--quick"], capfd, tmp_path, "defines __setstate__")
    assert not marker.exists()


def test_torchscript_file_operators_are_refused_before_the_model_runs(marker, tmp_path, capfd):
    path = tmp_path / "creates.pt"
    torch.jit.script(CreatesFiles(str(marker))).save(str(path))
    refused(["run", path, "--aux", DIGITS, "--attacks", "none", "--quick"], capfd, tmp_path, "calls aten::from_file")
    assert not marker.exists()


# --- the archive as torch's reader sees it --------------------------------------------------------------


def twin_in_other_case(name, data):
    return [(name, data)] + (
        [(name.replace("model.pt", "MODEL.pt"), data)] if name.endswith("sample_inputs/model.pt") else []
    )


def script_twin(name, data):
    return [(name, data)] + ([(name.replace("data.pkl", "DATA.PKL"), data)] if name.endswith("/data.pkl") else [])


def unknown_member(name, data):
    return [(name, data)] + (
        [(name.replace("archive_format", "notes.txt"), b"hi")] if name.endswith("/archive_format") else []
    )


def version_at_the_top(name, data):
    """torch.export.load's fallback reads an older layout with Python's zipfile, from the top level."""
    return [(name, data)] + ([("version", b"1")] if name.endswith("/archive_format") else [])


def beyond_its_record(name, data):
    if not name.endswith("model_weights_config.json"):
        return [(name, data)]
    config = json.loads(data)
    next(iter(config["config"].values()))["tensor_meta"]["sizes"] = [{"as_int": 10**9}, {"as_int": 64}]
    return [(name, json.dumps(config).encode())]


@pytest.mark.parametrize(
    ("fixture", "change", "fragment"),
    [
        ("program", twin_in_other_case, "which torch's reader cannot tell apart"),
        ("script", script_twin, "which torch's reader cannot tell apart"),
        ("program", unknown_member, "notes.txt, which is not part of a torch.export program"),
        ("program", version_at_the_top, "is not a torch.export program"),
        ("program", beyond_its_record, "needs 256000000000 bytes but the record holds 4096"),
    ],
)
def test_archives_are_read_as_torch_reads_them(request, tmp_path, fixture, change, fragment):
    source = request.getfixturevalue(fixture)
    with pytest.raises(InputError, match=fragment):
        open_model(rewrite(source, tmp_path / f"changed{source.suffix}", change), CPU)


# --- a refused .pt2: one line on stderr ------------------------------------------------------------------


def test_a_program_torch_cannot_load_is_one_line_on_stderr(program, tmp_path):
    """A program that passes the allow-list but that torch cannot deserialize (a node reads a value
    nothing defines): torch.export.load logs the whole traceback as a warning before it raises."""

    def edit(document):
        document["graph_module"]["graph"]["nodes"][0]["inputs"][0]["arg"] = {"as_tensor": {"name": "nowhere"}}

    edit_program(program, tmp_path / "broken.pt2", edit)
    args = ["run", "broken.pt2", "--aux", DIGITS, "--attacks", "none", "--quick"]  # in tmp_path, the cwd
    done = subprocess.run([sys.executable, "-m", "splitaudit", *args], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("splitaudit: error: broken.pt2 is not a loadable torch.export program")
    assert "nowhere" in lines[0]  # torch's own reason, which it logged before raising a generic error
