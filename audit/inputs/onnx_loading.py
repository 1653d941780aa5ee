"""Open an ONNX bottom model: check the graph (validity, declared sizes, random operators, the
audited output), declare its dynamic dimensions, start an onnxruntime session, and convert the
cleaned graph (splitaudit.inputs.onnx_graph) to torch modules, one converter at a time (onnx2pytorch,
else onnx2torch). Which converted module is used is decided against onnxruntime on real data
(splitaudit.inputs.model_checks.check_parity). A batch saved as a fixed size is made a symbol, and a
session of the graph as saved kept to decide on real data whether the model runs whole batches
(splitaudit.inputs.model_checks.settle_static_batch).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import describe_bytes, display_path, memory_limit_bytes, memory_limit_source
from splitaudit.inputs.onnx_graph import (
    declare_dynamic_dims,
    slimmed,
    standard_scalers,
    straight_through,
    symbolic_batch,
    value_op_types,
)
from splitaudit.inputs.optional_imports import import_torchvision_or_stub
from splitaudit.inputs.precision import LOW_PRECISION, audit_precision, float32_graph, onnx_stored_dtype
from splitaudit.inputs.raw_model import Conversion, RawModel, SavedBatch, check_single_input, first_line
from splitaudit.inputs.stochastic import refuse_onnx_randomness

ONNX2TORCH_OPSET = 13  # onnx2torch gets older graphs upgraded to this opset (its converters start there)
ONNX_FLOAT_TYPES = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}
ONNX_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16, 16: 2}
ORT_FATAL = 4  # onnxruntime log severity: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal


# Operators whose derivative jumps: dFIL is then only defined almost everywhere (Maeng et al., NeurIPS 2023).
NON_SMOOTH_ONNX = {
    "Relu",
    "LeakyRelu",
    "PRelu",
    "ThresholdedRelu",
    "Clip",
    "Abs",
    "Max",
    "Min",
    "Sign",
    "Floor",
    "Ceil",
    "Round",
    "MaxPool",
    "GlobalMaxPool",
    "MaxRoiPool",
    "HardSigmoid",
    "HardSwish",
    "ArgMax",
    "ArgMin",
    "TopK",
    "QuantizeLinear",
    "DynamicQuantizeLinear",
}
# Integer kernels of quantized graphs in operator form (quantize_static's QOperator, quantize_dynamic):
# no converter runs them and there is no float function to take straight-through (QDQ graphs have one).
INTEGER_KERNELS = ("QLinear", "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear")
QUANTIZED_OPERATORS_NOTE = (
    "the model is quantized with integer kernels ({ops}): it runs black-box, and finite differences of a "
    "rounded function measure its rounding steps, not leakage, so dFIL and the bounds are unreliable; audit "
    "the float model, or quantize it in QDQ form (onnxruntime's QuantFormat.QDQ), which splitaudit "
    "differentiates straight-through"
)


def open_onnx(path: Path, device: torch.device, output_name: str | None = None, mask_input: bool = False) -> RawModel:
    import onnx

    try:
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise InputError(f"{path} is not a valid ONNX model (truncated or corrupt?): {first_line(exc)}") from exc
    names = [i.name for i in _graph_inputs(proto)]
    check_single_input(names[:1] if mask_input and len(names) == 2 else names, path)
    check_onnx_declared_sizes(proto, path)
    refuse_onnx_randomness(proto, path)
    output_name, notes = select_onnx_output(proto, path, output_name)
    redeclared = declare_dynamic_dims(proto)
    batch, shape = onnx_input_shape(_graph_inputs(proto)[0])
    stored = onnx_stored_dtype(proto)
    session, providers = _ort_session(path, device, proto if redeclared else None, stored)
    audited, quantized_session = proto, None
    if any(node.op_type == "DequantizeLinear" for node in proto.graph.node):
        audited = onnx.ModelProto()
        audited.CopyFrom(proto)
        if straight_through(audited):  # the float function is audited; the quantized one is kept to compare
            quantized_session = session
            session, providers = _ort_session(path, device, audited, stored)
    kernels = sorted({n.op_type for n in audited.graph.node if n.op_type.startswith(INTEGER_KERNELS)})
    notes += [QUANTIZED_OPERATORS_NOTE.format(ops=", ".join(kernels))] if kernels else []
    saved_session = None
    if "DynamicQuantizeLinear" in kernels:  # its scale is the whole batch's range: one sample at a time
        batch = 1
        notes.append(
            "DynamicQuantizeLinear scales by the range of the whole batch, so a sample's embedding depends on "
            "its batch: the model runs one sample at a time, each quantized on its own range"
        )
    elif batch and quantized_session is None and (free := symbolic_batch(audited, batch)) is not None:
        saved_session, audited = session, free  # the converters get the graph with its batch free too
        session, providers = _ort_session(path, device, free, stored)
    cleaned, slim_error = slimmed(audited, memory_limit_bytes())
    float32_graph(cleaned)  # the converters then give float32 modules (a float16 model is audited in float32)
    standard_scalers(cleaned)  # skl2onnx's Scaler, which no converter supports, as Sub and Mul
    conversions, failed = convert_onnx(cleaned, device), []
    first = next_module(conversions, failed)
    raw = RawModel(
        path=path,
        format="onnx",
        declared_input_shape=shape,
        fixed_batch=batch,
        torch_module=first.module if first else None,
        session=session,
        non_smooth_ops=sorted(value_op_types(audited) & NON_SMOOTH_ONNX),
        providers=providers,
        output_name=output_name,
        notes=notes,
        converter=first.converter if first else None,
        pending_conversions=conversions,
        failed_conversions=failed,
        slim_error=slim_error,
        stored_dtype=stored,
        quantized_session=quantized_session,
    )
    if saved_session is not None:
        raw.saved_batch = SavedBatch(
            batch,
            onnx_runner(saved_session, output_name),
            onnx_runner(session, output_name),
            lambda model, free: setattr(model, "fixed_batch", None if free else batch),
        )
    return raw


def onnx_runner(session, output_name: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A torch-in, torch-out forward pass through an onnxruntime session (no gradients), in the
    input's declared floating-point type, the audited output returned as float32 on the input's device."""
    meta = session.get_inputs()[0]
    dtype = {"tensor(double)": np.float64, "tensor(float16)": np.float16}.get(meta.type, np.float32)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = session.run([output_name], {meta.name: x.detach().cpu().numpy().astype(dtype)})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(x.device)

    return run


def next_module(conversions: Iterator[Conversion], failed: list[Conversion]) -> Conversion | None:
    """The next conversion that gives a module; the attempts that fail on the way go to `failed`."""
    for conversion in conversions:
        if conversion.module is not None:
            return conversion
        failed.append(conversion)
    return None


def conversion_failure(raw: RawModel, disagreements: list[str]) -> str:
    """Why no converted module is used, in one line: the operator no converter supports when
    that is the cause, else each converter's failure or disagreement with onnxruntime."""
    unsupported = {c.unsupported_op for c in raw.failed_conversions}
    if not disagreements and len(unsupported) == 1 and None not in unsupported:
        text = f"operator {unsupported.pop()} is supported by no converter ({', '.join(CONVERTERS)})"
    else:
        text = "; ".join([c.error for c in raw.failed_conversions] + disagreements)
    return text + (f"; {raw.slim_error}" if raw.slim_error else "")


def check_onnx_declared_sizes(proto, path: Path, limit: int | None = None) -> None:
    """Refuse a graph whose weights or statically known tensors (after shape inference with
    constant propagation, e.g. a ConstantOfShape of a huge constant shape) exceed `limit` bytes:
    running it would allocate or loop over that many elements before any check could end."""
    import onnx

    limit = memory_limit_bytes() if limit is None else limit
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # inference is best effort: weights are still checked below
        inferred = proto
    weights = sum(_elements(init.dims) * ONNX_ITEM_BYTES.get(init.data_type, 8) for init in proto.graph.initializer)
    if weights > limit:
        raise InputError(
            f"{display_path(path)} declares {describe_bytes(weights)} of weights; splitaudit loads at "
            f"most {describe_bytes(limit)} ({memory_limit_source()})"
        )
    for info in (*inferred.graph.value_info, *inferred.graph.output):
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        size = _elements(dims) * ONNX_ITEM_BYTES.get(tensor.elem_type, 8) if dims and None not in dims else 0
        if size > limit:
            raise InputError(
                f"{display_path(path)}: tensor {info.name!r} declares shape {dims} "
                f"({describe_bytes(size)}), over the {describe_bytes(limit)} a "
                f"model may allocate here ({memory_limit_source()})"
            )


def _elements(dims) -> int:
    return int(np.prod([int(d) for d in dims], dtype=object)) if len(dims) else 1


def select_onnx_output(proto, path: Path, wanted: str | None) -> tuple[str, list[str]]:
    """The output audited as the embedding: --output-name, else the only one, else the first (said
    in a note). The others are dropped from the graph, so conversion builds the chosen one alone."""
    names = [o.name for o in proto.graph.output]
    if wanted is not None and wanted not in names:
        raise InputError(
            f"--output-name {wanted!r} is not an output of {display_path(path)} (outputs: {', '.join(names)})"
        )
    chosen = wanted or names[0]
    notes = (
        []
        if wanted or len(names) == 1
        else [
            f"the model has {len(names)} outputs ({', '.join(names)}); auditing the first, {chosen!r} "
            "(choose another with --output-name)"
        ]
    )
    for output in [o for o in proto.graph.output if o.name != chosen]:
        proto.graph.output.remove(output)
    return chosen, notes


def _graph_inputs(proto) -> list:
    """Graph inputs that are not initializers (older exporters list weights as inputs too)."""
    weights = {init.name for init in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in weights]


def onnx_input_shape(value_info) -> tuple[int | None, tuple[int, ...] | None]:
    """(fixed batch size or None, per-sample shape or None when some dimension is symbolic)."""
    dims = value_info.type.tensor_type.shape.dim
    if not dims:
        return None, None
    batch = dims[0].dim_value or None
    rest = [d.dim_value for d in dims[1:]]
    return batch, (tuple(rest) if all(rest) else None)


def _ort_session(path: Path, device: torch.device, proto=None, stored: torch.dtype = torch.float32):
    """An onnxruntime session on the CUDA provider when the device is CUDA and ORT can use it; on
    `proto` (the graph as rewritten in memory) when given, else on the file. On a float16 or
    bfloat16 graph, ORT's NCHWc layout pass (a float32 optimisation) is off: onnxruntime 1.31
    crashes the process with a segmentation fault in it on a float16 ViT stem's graph.
    onnxruntime's C++ logger writes its errors straight to stderr (in colour) before raising them;
    it is kept to fatal messages, for this session and for those onnxslim and the converters open,
    so that a failure reaches the terminal as splitaudit's one line."""
    import onnxruntime as ort

    ort.set_default_logger_severity(ORT_FATAL)
    options = ort.SessionOptions()
    options.log_severity_level = ORT_FATAL
    wanted = ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        wanted.insert(0, "CUDAExecutionProvider")
    disabled = ["NchwcTransformer"] if stored in LOW_PRECISION else []
    try:
        source = str(path) if proto is None else proto.SerializeToString()
        session = ort.InferenceSession(source, sess_options=options, providers=wanted, disabled_optimizers=disabled)
    except Exception as exc:
        raise InputError(f"onnxruntime cannot load {path}: {first_line(exc)}") from exc
    return session, session.get_providers()  # the providers actually in use


def _onnx2pytorch(proto) -> nn.Module:
    from onnx2pytorch import ConvertModel

    return ConvertModel(proto, experimental=True)


def _onnx2torch(proto) -> nn.Module:
    """onnx2torch, on the graph upgraded to opset 13 when it is older: its converters start at
    the opset-13 versions of several operators (Clip, Pad, Split, Squeeze...)."""
    import onnx
    from onnx2torch import convert

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), ONNX2TORCH_OPSET)
    if opset < ONNX2TORCH_OPSET:
        proto = onnx.version_converter.convert_version(proto, ONNX2TORCH_OPSET)
    return convert(proto)


# Tried in this order; the first whose module matches onnxruntime is used. benchmarks/converters.py
# gives the load matrix behind the order: on 52 graphs (torch, Paddle2ONNX- and tf2onnx-style,
# opsets 9-20), after the clean-up, onnx2pytorch converts all 52 with parity and onnx2torch 39;
# onnx2torch is kept as the fallback for graphs onnx2pytorch fails on or gets wrong.
CONVERTERS: dict[str, Callable] = {"onnx2pytorch": _onnx2pytorch, "onnx2torch": _onnx2torch}


def convert_onnx(proto, device: torch.device) -> Iterator[Conversion]:
    """Each converter's attempt on the cleaned graph, lazily (the next is converted only when the
    one before fails or disagrees with onnxruntime)."""
    import_torchvision_or_stub()
    quiet_converted_modules()
    for name, convert in CONVERTERS.items():
        try:
            module = audit_precision(convert(proto).eval().to(device))[0]  # a float64 graph runs in float64
        except Exception as exc:  # converters raise anything from KeyError to NotImplementedError
            yield Conversion(name, None, f"{name}: {first_line(exc)}", _unsupported_op(exc))
            continue
        for p in module.parameters():
            p.requires_grad_(False)
        yield Conversion(name, module)


def quiet_converted_modules() -> None:
    """Keep the converters' own UserWarnings off the terminal: their modules index tensors with
    lists (torch warns that this idiom changes in a later version) on every forward pass of a
    ViT's graph, four lines of a dependency's source paths in every audit; their results are
    checked against onnxruntime instead (check_parity)."""
    for package in CONVERTERS:
        warnings.filterwarnings("ignore", category=UserWarning, module=rf"{package}(\.|$)")


def _unsupported_op(exc: Exception) -> str | None:
    """The operator a converter names when it has no converter for it."""
    match = re.search(r"op_type=(\w+)|operation_type='(\w+)'", str(exc))
    return next(g for g in match.groups() if g) if isinstance(exc, NotImplementedError) and match else None


def check_onnx_output_type(session, name: str | None) -> None:
    """Embeddings must be floating point: an integer output (argmax, a quantised code) has no
    gradient and no Fisher information to bound."""
    output = next(o for o in session.get_outputs() if name is None or o.name == name)
    if output.type not in ONNX_FLOAT_TYPES:
        others = [o.name for o in session.get_outputs() if o.type in ONNX_FLOAT_TYPES]
        hint = f"; choose a floating-point output with --output-name ({', '.join(others)})" if others else ""
        if any(o.type.startswith("seq(map") for o in session.get_outputs()):  # skl2onnx's ZipMap of probabilities
            hint += "; a skl2onnx classifier converted with options={'zipmap': False} outputs a tensor instead"
        raise InputError(
            f"the model's output {output.name!r} is {output.type}; a bottom model must output floating-point "
            f"embeddings{hint}"
        )
