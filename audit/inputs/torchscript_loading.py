"""Open a TorchScript bottom model: load it, set its mode, list its non-smooth operators, and run
it with the graph executor's optimisation off (Unoptimized) so that torch.func sees plain operators.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.precision import audit_precision
from splitaudit.inputs.raw_model import Outputs, RawModel, check_single_input, first_line, select_output
from splitaudit.inputs.stochastic import apply_model_mode
from splitaudit.inputs.torch_archives import read_archive
from splitaudit.inputs.torchscript_archive import check_operators, check_torchscript_archive, graph_nodes

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
    """The TorchScript model at `path`, its audited output chosen by `output_name` (select_output).
    Its archive passes torchscript_archive's allow-list before torch reads it, and its operators
    after torch compiled it, before anything runs it."""
    label = display_path(path)
    data = read_archive(path)
    check_torchscript_archive(data, label)
    try:
        with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; users still ship it
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(io.BytesIO(data), map_location=device)
    except Exception as exc:  # torch raises RuntimeError/ValueError/pickle errors alike
        raise InputError(
            f"{label} is not a loadable TorchScript model ({first_line(exc)}); "
            "save it with torch.jit.trace(...).save() or torch.jit.script(...).save()"
        ) from exc
    check_operators(module, label)
    training = apply_model_mode(module, mode)  # TorchScript keeps each module's .training as saved
    required = [a.name for a in module.forward.schema.arguments[1:] if not a.has_default_value()]
    check_single_input(required[:1] if mask_input and len(required) == 2 else required, path)
    for p in module.parameters():
        p.requires_grad_(False)
    ops = {kind.split("::")[-1] for kind in tensor_op_kinds(module.inlined_graph)}
    returns = returned_outputs(module.forward.schema.returns[0].type)
    selected, notes = select_output(Unoptimized(module), returns, output_name, path)
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
    return {
        node.kind()
        for node in graph_nodes(graph)
        if any(isinstance(out.type(), torch.TensorType) for out in node.outputs())
    }


def returned_outputs(returns) -> Outputs:
    """What a TorchScript forward's declared return type says it returns."""
    if isinstance(returns, torch.TupleType):
        return Outputs("sequence", count=len(returns.elements()))
    if isinstance(returns, torch.ListType):
        return Outputs("sequence")
    return Outputs("dict") if isinstance(returns, torch.DictType) else Outputs("tensor")


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
