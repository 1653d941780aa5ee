"""Open a TorchScript bottom model: load it, set its mode, list its non-smooth operators, and run
it with the graph executor's optimisation off (Unoptimized) so that torch.func sees plain operators.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.precision import audit_precision
from splitaudit.inputs.raw_model import RawModel, check_single_input, first_line
from splitaudit.inputs.stochastic import apply_model_mode

TORCHSCRIPT_SUFFIXES = {".pt", ".pth", ".ts", ".jit", ".torchscript"}

# Graph operators whose derivative jumps (see onnx_loading.NON_SMOOTH_ONNX).
NON_SMOOTH_TORCHSCRIPT = {
    "relu",
    "relu_",
    "relu6",
    "leaky_relu",
    "leaky_relu_",
    "prelu",
    "hardtanh",
    "hardtanh_",
    "clamp",
    "clamp_",
    "abs",
    "max",
    "min",
    "sign",
    "floor",
    "ceil",
    "round",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "hardsigmoid",
    "hardswish",
    "argmax",
    "argmin",
    "topk",
    "threshold",
}


def open_torchscript(
    path: Path, device: torch.device, mode: str = "saved", mask_input: bool = False, output_name: str | None = None
) -> RawModel:
    """The TorchScript model at `path`, its audited output chosen by `output_name` (select_output)."""
    try:
        with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; users still ship it
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:  # torch raises RuntimeError/ValueError/pickle errors alike
        raise InputError(
            f"{path} is not a loadable TorchScript model ({first_line(exc)}); "
            "save it with torch.jit.trace(...).save() or torch.jit.script(...).save()"
        ) from exc
    training = apply_model_mode(module, mode)  # TorchScript keeps each module's .training as saved
    required = [a.name for a in module.forward.schema.arguments[1:] if not a.has_default_value()]
    check_single_input(required[:1] if mask_input and len(required) == 2 else required, path)
    for p in module.parameters():
        p.requires_grad_(False)
    ops = {kind.split("::")[-1] for kind in tensor_op_kinds(module.inlined_graph)}
    selected, notes = select_output(Unoptimized(module), module.forward.schema.returns[0].type, output_name, path)
    computed, saved, dtype = audit_precision(selected)
    return RawModel(
        path=path,
        format="torchscript",
        declared_input_shape=None,
        fixed_batch=None,
        torch_module=computed,
        stored_dtype=dtype,
        saved_module=saved,
        scripted=module,
        notes=notes,
        non_smooth_ops=sorted(ops & NON_SMOOTH_TORCHSCRIPT),
        mode=mode,
        training_modules=training,
    )


def tensor_op_kinds(graph) -> set[str]:
    """Every operator of a TorchScript graph that outputs a tensor, those inside control-flow blocks
    included: a scripted module's F.relu sits in a prim::If's block (its inplace branch), where
    graph.nodes() does not look. Operators on Python numbers are left out: a scripted
    F.interpolate floors its float output size (aten::floor -> int), a kink of no tensor."""
    kinds, pending = set(), [graph]
    while pending:
        for node in pending.pop().nodes():
            if any(isinstance(out.type(), torch.TensorType) for out in node.outputs()):
                kinds.add(node.kind())
            pending.extend(node.blocks())
    return kinds


class SelectedOutput(nn.Module):
    """One output of a module that returns several: an element of a tuple or list by its index, an
    entry of a dict by its key, the first when none is named (as an ONNX model's first output)."""

    def __init__(self, inner: nn.Module, key: str | None) -> None:
        super().__init__()
        self.inner = inner
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = self.inner(x)
        if not isinstance(outputs, dict):
            return outputs[0 if self.key is None else int(self.key)]
        if self.key is None:
            return next(iter(outputs.values()))
        if self.key not in outputs:
            raise InputError(
                f"--output-name {self.key!r} is not an output of the model (outputs: {', '.join(outputs)})"
            )
        return outputs[self.key]


def select_output(module: nn.Module, returns, output_name: str | None, path: Path) -> tuple[nn.Module, list[str]]:
    """The module with its audited output chosen, and the note that says which, from its declared
    return type: a tuple or list is indexed (--output-name 1), a dict keyed (--output-name pooled),
    a tensor taken as it is (where --output-name is refused)."""
    if isinstance(returns, (torch.TupleType, torch.ListType)):
        count = len(returns.elements()) if isinstance(returns, torch.TupleType) else None
        if output_name is not None and not (output_name.isdigit() and (count is None or int(output_name) < count)):
            raise InputError(
                f"--output-name {output_name!r}: {display_path(path)} returns a {_sequence(count)}; name one by its "
                "index (0 for the first)"
            )
        note = f"the model returns a {_sequence(count)}; auditing output {output_name or 0} (choose another with --output-name INDEX)"
        return SelectedOutput(module, output_name), [] if output_name is not None else [note]
    if isinstance(returns, torch.DictType):
        note = "the model returns a dict of outputs; auditing its first entry (choose one with --output-name KEY)"
        return SelectedOutput(module, output_name), [] if output_name is not None else [note]
    if output_name is not None:
        raise InputError(f"--output-name selects one of several outputs; {display_path(path)} returns one tensor")
    return module, []


def _sequence(count: int | None) -> str:
    return f"tuple of {count} outputs" if count is not None else "list of outputs"


class Unoptimized(nn.Module):
    """Runs a TorchScript module with the graph executor's optimisation off.

    The profiling executor re-optimises a graph after its first runs (specialising it to the
    shapes and requires-grad flags it profiled); torch.func's forward-mode AD through such a
    re-optimised graph can yield zero tangents on later calls, a silent zero Jacobian. Unoptimised
    execution interprets the graph op by op, so every torch.func transform sees plain aten
    operators on every call; the operators dominate the cost, not the interpreter.
    """

    def __init__(self, scripted: nn.Module) -> None:
        super().__init__()
        self.scripted = scripted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.jit.optimized_execution(False):
            return self.scripted(x)
