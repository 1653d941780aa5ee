"""Open a torch.export program (a .pt2 archive from torch.export.save): torch's successor to
TorchScript, which torch 2.13 deprecates. The program's module is a torch graph of aten operators,
so gradients, dFIL and attacks run through it as through any torch module.

An exported program keeps the mode it was exported in (BatchNorm and dropout are fixed in the
graph; torch refuses .train()/.eval() on it), so it runs as saved, as an ONNX graph does: --model-mode
train is refused, and copies trained by attacks keep the exported layers' behaviour (ExportedModule). A
program exported with a static batch size (torch.export's default: the example's batch) guards
that size and may bake it into reshapes, so ExportedModule runs any batch in chunks of it, padded:
the attacks' trained copies then take any batch too.
"""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.precision import audit_precision
from splitaudit.inputs.raw_model import Outputs, RawModel, check_single_input, first_line, in_batches, select_output
from splitaudit.inputs.torchscript_loading import NON_SMOOTH_TORCHSCRIPT

EXPORTED_SUFFIXES = {".pt2"}
UNPICKLED_OBJECTS = ("custom_obj_", "opaque_obj_")  # constants torch.export.load unpickles as objects


def is_exported_archive(path: Path) -> bool:
    """A .pt2 file, or a zip archive in torch.export's layout (NAME/models/*.json) under another name."""
    if path.suffix.lower() in EXPORTED_SUFFIXES:
        return True
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/models/" in name and name.endswith(".json") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


class ExportedModule(nn.Module):
    """An exported program's module, run in chunks of its static batch size when it has one.
    train()/eval() set this wrapper's flag only: torch refuses them on the program, whose layers
    keep the mode they were exported in."""

    def __init__(self, program_module: nn.Module, static_batch: int | None) -> None:
        super().__init__()
        self.program = program_module
        self.static_batch = static_batch

    def train(self, mode: bool = True) -> "ExportedModule":
        self.training = mode
        return self

    def forward(self, x: torch.Tensor):
        if self.static_batch is None:
            return self.program(x)
        return in_batches(self.program, x, self.static_batch)


def check_pickles(path: Path) -> None:
    """Refuse an archive whose loading would unpickle anything but tensors. torch.export.load reads
    sample inputs and legacy weight files with torch.load, retrying with weights_only=False when the
    safe load fails, and weights marked use_pickle with weights_only=False: a crafted archive would
    run code. Every such member must load with weights_only=True (then torch's own load meets only
    the same tensors), and constants that torch unpickles as Python objects are refused."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pickled = [name for name in names if name.endswith(".pt")]
        for config in [name for name in names if name.endswith("_config.json") and "/data/" in name]:
            folder = config.rsplit("/", 1)[0]
            for entry in json.loads(archive.read(config)).get("config", {}).values():
                if entry.get("path_name", "").startswith(UNPICKLED_OBJECTS):
                    raise InputError(
                        f"{display_path(path)} holds a Python object constant ({entry['path_name']}), which loading "
                        "would unpickle; splitaudit never unpickles (export a model whose constants are tensors)"
                    )
                if entry.get("use_pickle"):
                    pickled.append(f"{folder}/{entry.get('path_name', '')}")
        for name in pickled:
            try:
                torch.load(io.BytesIO(archive.read(name)), weights_only=True)
            except Exception as exc:
                raise InputError(
                    f"{display_path(path)}: {name} is not plain tensors ({first_line(exc)}); loading it would "
                    "unpickle arbitrary objects, which splitaudit never does"
                ) from exc


def open_exported(path: Path, device: torch.device, mode: str = "saved", output_name: str | None = None) -> RawModel:
    if mode == "train":
        raise InputError(
            "--model-mode train applies to TorchScript and torch modules; a torch.export program runs in the "
            "mode it was exported in"
        )
    try:
        check_pickles(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.load(str(path))
            module = program.module()
    except InputError:
        raise
    except Exception as exc:  # torch and zipfile raise anything from RuntimeError to KeyError on a bad archive
        raise InputError(
            f"{display_path(path)} is not a loadable torch.export program ({first_line(exc)}); "
            "save it with torch.export.save(torch.export.export(model, (x,)), path)"
        ) from exc
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    check_single_input(inputs, path)
    shape = tuple(placeholders[inputs[0]].meta["val"].shape)
    batch = shape[0] if isinstance(shape[0], int) else None
    sample = tuple(shape[1:]) if all(isinstance(d, int) for d in shape[1:]) else None
    for p in module.parameters():
        p.requires_grad_(False)
    outputs = _outputs(program.call_spec.out_spec)
    selected, notes = select_output(ExportedModule(module.to(device), batch), outputs, output_name, path)
    if batch is not None:
        notes.append(
            f"the program was exported with a static batch of {batch}; it runs in chunks of {batch}, slower than "
            "a program exported with a dynamic batch (torch.export.export(..., dynamic_shapes=...))"
        )
    computed, saved, dtype = audit_precision(selected)
    return RawModel(
        path=path,
        format="exported",
        declared_input_shape=sample,
        fixed_batch=None,  # ExportedModule chunks the batches itself
        torch_module=computed,
        non_smooth_ops=sorted(_tensor_ops(program.graph) & NON_SMOOTH_TORCHSCRIPT),
        notes=notes,
        stored_dtype=dtype,
        saved_module=saved,
    )


def _outputs(spec) -> Outputs:
    """What the program returns, from its output pytree spec."""
    if spec.is_leaf():
        return Outputs("tensor")
    if spec.type is dict:
        return Outputs("dict", keys=tuple(str(k) for k in spec.context))
    return Outputs("sequence", count=spec.num_children)


def _tensor_ops(graph) -> set[str]:
    """The aten operators of the graph that compute tensors, by name (aten.relu.default -> relu)."""
    return {
        str(node.target).split(".")[1]
        for node in graph.nodes
        if node.op == "call_function"
        and str(node.target).startswith("aten.")
        and isinstance(node.meta.get("val"), torch.Tensor)
    }
