"""Open a torch.export program (a .pt2 archive from torch.export.save): torch's successor to
TorchScript, which torch 2.13 deprecates. The program's module is a torch graph of aten operators,
so gradients, dFIL and attacks run through it as through any torch module.

An exported program keeps the mode it was exported in (BatchNorm and dropout are fixed in the
graph; torch refuses .train()/.eval() on it), so it runs as saved, as an ONNX graph does: --model-mode
train is refused, and copies trained by attacks keep the exported layers' behaviour (ExportedModule). A
program exported with a static batch size (torch.export's default: the example's batch) guards
that size and may bake it into reshapes: it is opened without the guard on the batch (its other
dimensions are still checked), and runs whole batches where real data shows that its outputs do
not depend on the batch size (splitaudit.inputs.model_checks.settle_static_batch), else in chunks of
its size, padded; the attacks' trained copies take any batch either way.
"""

from __future__ import annotations

import io
import logging
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.exported_archive import check_exported_archive, check_program
from splitaudit.inputs.precision import audit_precision
from splitaudit.inputs.raw_model import (
    Outputs,
    RawModel,
    SavedBatch,
    check_single_input,
    first_line,
    in_batches,
    select_output,
)
from splitaudit.inputs.torch_archives import read_archive
from splitaudit.inputs.torchscript_loading import NON_SMOOTH_TORCHSCRIPT

EXPORTED_SUFFIXES = {".pt2"}


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
    """An exported program's module, run in chunks of `static_batch` when that is set (a program
    saved with a static batch whose outputs depend on it). `sample_shape`: the per-sample shape
    checked here for a program opened without its input guards. train()/eval() set this wrapper's
    flag only: torch refuses them on the program, whose layers keep the mode they were exported in."""

    def __init__(
        self, program_module: nn.Module, static_batch: int | None, sample_shape: tuple[int, ...] | None = None
    ) -> None:
        super().__init__()
        self.program = program_module
        self.saved_batch = self.static_batch = static_batch
        self.sample_shape = sample_shape

    def train(self, mode: bool = True) -> "ExportedModule":
        self.training = mode
        return self

    def forward(self, x: torch.Tensor):
        if self.sample_shape is not None and tuple(x.shape[1:]) != self.sample_shape:
            raise ValueError(f"the program takes samples of shape {self.sample_shape}, not {tuple(x.shape[1:])}")
        if self.static_batch is None:
            return self.program(x)
        return in_batches(self.program, x, self.static_batch)

    def batch_freely(self, free: bool) -> None:
        """Run whole batches (free) or chunks of the size the program was saved with."""
        self.static_batch = None if free else self.saved_batch


def open_exported(path: Path, device: torch.device, mode: str = "saved", output_name: str | None = None) -> RawModel:
    if mode == "train":
        raise InputError(
            "--model-mode train applies to TorchScript and torch modules; a torch.export program runs in the "
            "mode it was exported in"
        )
    label, logged = display_path(path), []
    try:
        with warnings.catch_warnings(), torch_logs_kept(logged):
            warnings.simplefilter("ignore")
            data = read_archive(path)
            check_exported_archive(data, label)  # before torch reads it: see exported_archive
            program = torch.export.load(io.BytesIO(data))
            check_program(program, label)  # before anything runs it
            shape = _user_input_shape(program, path)
            batch = shape[0] if isinstance(shape[0], int) else None
            module = program.module() if batch is None else _without_input_guards(program)
    except InputError:
        raise
    except Exception as exc:  # torch and zipfile raise anything from RuntimeError to KeyError on a bad archive
        cause = next((record.exc_info[1] for record in logged if record.exc_info), exc)
        raise InputError(
            f"{label} is not a loadable torch.export program ({first_line(cause)}); "
            "save it with torch.export.save(torch.export.export(model, (x,)), path)"
        ) from exc
    sample = tuple(shape[1:]) if all(isinstance(d, int) for d in shape[1:]) else None
    for p in module.parameters():
        p.requires_grad_(False)
    outputs = _outputs(program.call_spec.out_spec)
    exported = ExportedModule(module.to(device), batch, sample if batch is not None else None)
    selected, notes = select_output(exported, outputs, output_name, path)
    computed, saved, dtype = audit_precision(selected)
    raw = RawModel(
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
    if batch is not None:
        copies = [m for model in (computed, saved) if model is not None for m in model.modules()]
        wrappers = [m for m in copies if isinstance(m, ExportedModule)]
        raw.saved_batch = SavedBatch(
            batch, computed, computed, lambda _model, free: [m.batch_freely(free) for m in wrappers]
        )
    return raw


def _user_input_shape(program, path: Path) -> tuple:
    """The shape of the program's one user input (ints, symbols where dynamic); InputError when it has several."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    check_single_input(inputs, path)
    return tuple(placeholders[inputs[0]].meta["val"].shape)


def _without_input_guards(program) -> nn.Module:
    """The program's module without the guards on its inputs' shapes (ExportedModule checks the
    per-sample shape instead): a program traced with a static batch guards that size, and whether
    it computes the same on other batch sizes is checked on real data."""
    module = program.module(check_guards=False)
    module.validate_inputs = False
    return module


class KeptRecords(logging.Handler):
    """A log handler that keeps the records in a list instead of printing them."""

    def __init__(self, records: list) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def torch_logs_kept(records: list):
    """Torch's log records, appended to `records` instead of printed, while it loads a program (an
    error is one line on stderr): torch.export.load logs the error it met as a warning, traceback
    included, then raises a generic one, so the kept record is what the message can name."""
    names = ["torch", *(name for name in logging.root.manager.loggerDict if name.startswith("torch."))]
    saved = [(logger, logger.handlers) for logger in map(logging.getLogger, names)]
    for logger, handlers in saved:
        logger.handlers = [KeptRecords(records)] if handlers else []
    try:
        yield
    finally:
        for logger, handlers in saved:
            logger.handlers = handlers


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
