"""Models stored in a floating-point precision other than float32.

The audit differentiates and trains in float32. A model stored in float64 runs in float64: its
inputs are cast up and its embeddings down to float32, which changes nothing the audit measures.
A model stored in float16 or bfloat16 is audited in float32 on its stored weights: Jacobians
accumulated in half precision (eps 1e-3 and 8e-3) would be too coarse for dFIL, and CPUs run
half-precision kernels slowly or not at all. That float32 computation differs from the model's
own by rounding; the loaders check it against the model as saved (onnxruntime's run of the graph,
or the saved module) with a tolerance of ROUNDING_EPS of the stored precision's eps
(splitaudit.inputs.model_checks.check_parity).
"""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn as nn

LOW_PRECISION = (torch.float16, torch.bfloat16)

# Parity tolerance for a low-precision model, in eps of its precision, relative to the largest
# |output| (never below float32's PARITY_RTOL). float16 ResNet, MobileNet, ViT, text-line and 1-D
# stems differ from their float32 computation by 0.3-0.95 eps of float16 (benchmarks/stored_precision.py).
ROUNDING_EPS = 16

# ONNX TensorProto element types, and the torch dtypes of the low-precision ones.
ONNX_FLOAT, ONNX_FLOAT16, ONNX_DOUBLE, ONNX_BFLOAT16 = 1, 10, 11, 16
ONNX_DTYPES = {ONNX_FLOAT16: torch.float16, ONNX_BFLOAT16: torch.bfloat16}


class AtPrecision(nn.Module):
    """Runs `inner` in `dtype`: floating-point inputs cast to it (token ids stay integers), the
    output cast to float32, the precision the audit works in."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x.to(self.dtype) if x.is_floating_point() else x)
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out


def stored_dtype(module: nn.Module) -> torch.dtype:
    """The precision a module's weights are stored in: float16 or bfloat16 when any weight is,
    float64 when the weights are float64 and none float32, else float32."""
    dtypes = {t.dtype for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()}
    low = [d for d in LOW_PRECISION if d in dtypes]
    if low:
        return low[0]
    if torch.float64 in dtypes and torch.float32 not in dtypes:
        return torch.float64
    return torch.float32


def audit_precision(module: nn.Module) -> tuple[nn.Module, nn.Module | None, torch.dtype]:
    """(the module the audit computes with, the module as saved when that differs, the stored dtype).

    float16/bfloat16: a float32 copy; the saved module is kept to check the copy against.
    float64: the module itself, run in float64 with float32 embeddings (the same function)."""
    dtype = stored_dtype(module)
    if dtype in LOW_PRECISION:
        return deepcopy(module).float(), AtPrecision(module, dtype), dtype
    if dtype == torch.float64:
        return AtPrecision(module, torch.float64), None, dtype
    return module, None, dtype


def parity_rtol(dtype: torch.dtype, float32_rtol: float) -> float:
    """The relative tolerance a float32 computation of a model stored in `dtype` is held to."""
    return max(float32_rtol, ROUNDING_EPS * torch.finfo(dtype).eps) if dtype in LOW_PRECISION else float32_rtol


def precision_note(dtype: torch.dtype, max_abs_err: float | None) -> str | None:
    """What the report says about a model not stored in float32 (None for float32)."""
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float64:
        return "the model is stored in float64: it runs in float64, and its embeddings are kept in float32"
    if dtype not in LOW_PRECISION:
        return None
    agreement = (
        f"which agrees with the model's own {name} run up to rounding (largest difference {max_abs_err:.2g})"
        if max_abs_err is not None
        else f"not checked against the model's own {name} run, which does not run on this device"
    )
    return f"the model is stored in {name}: gradients, dFIL and attacks compute in float32 on its {name} weights, {agreement}"


def onnx_stored_dtype(proto) -> torch.dtype:
    """float16 or bfloat16 when an ONNX graph stores weights or takes inputs in it, float64 when
    it takes float64 inputs, else float32."""
    inputs = {i.type.tensor_type.elem_type for i in proto.graph.input}
    types = inputs | {init.data_type for init in proto.graph.initializer}
    for node in proto.graph.node:
        types |= {a.t.data_type for a in node.attribute if a.HasField("t")}
    found = [t for t in (ONNX_FLOAT16, ONNX_BFLOAT16) if t in types]
    if found:
        return ONNX_DTYPES[found[0]]
    return torch.float64 if ONNX_DOUBLE in inputs else torch.float32


def float32_graph(proto) -> None:
    """Rewrite a float16/bfloat16 ONNX graph in place to compute in float32: weights, constants,
    Cast targets and declared types (subgraphs included). The converters then give float32 modules."""
    from onnx import numpy_helper

    def upcast(tensor) -> None:
        if tensor.data_type in (ONNX_FLOAT16, ONNX_BFLOAT16):
            values = numpy_helper.to_array(tensor).astype("float32")
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))

    def rewrite(graph) -> None:
        for tensor in graph.initializer:
            upcast(tensor)
        for info in (*graph.input, *graph.output, *graph.value_info):
            if info.type.tensor_type.elem_type in (ONNX_FLOAT16, ONNX_BFLOAT16):
                info.type.tensor_type.elem_type = ONNX_FLOAT
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    upcast(attribute.t)
                if attribute.name in ("to", "dtype") and attribute.i in (ONNX_FLOAT16, ONNX_BFLOAT16):
                    attribute.i = ONNX_FLOAT
                for body in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                    rewrite(body)

    rewrite(proto.graph)
