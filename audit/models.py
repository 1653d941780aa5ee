"""Load a bottom model (TorchScript or ONNX) behind one interface, the `Encoder`.

ONNX models are checked, cleaned (splitaudit.onnx_graph: dynamic dims declared as -1 or 0,
Constant-node weights), converted to a differentiable torch module (onnx2pytorch, else
onnx2torch) and compared with onnxruntime on real data; the first converted module that matches
is used. When none converts or matches, the model runs black-box through onnxruntime (forward
passes only, no gradients).
"""

from __future__ import annotations

import importlib.machinery
import re
import sys
import threading
import types
import warnings
import zipfile
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from splitaudit.errors import InputError
from splitaudit.onnx_graph import declare_dynamic_dims, op_types, slimmed
from splitaudit.safety import describe_bytes, display_path, memory_limit_bytes, require_regular_file
from splitaudit.stochastic import apply_model_mode, describe_mode, randomness_error, refuse_onnx_randomness

TORCHSCRIPT_SUFFIXES = {".pt", ".pth", ".ts", ".jit", ".torchscript"}
PARITY_RTOL = 1e-4
DEFAULT_BATCH = 256
MODEL_CHECK_SECONDS = 300  # loading checks (conversion, parity, first passes) must end within this
BATCH_CHECK_SAMPLES = 4  # samples run as a batch of their own to check that no output depends on the rest of the batch
BATCH_DEPENDENCE_RTOL = 1e-4
ONNX2TORCH_OPSET = 13  # onnx2torch gets older graphs upgraded to this opset (its converters start there)
ONNX_FLOAT_TYPES = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}
ONNX_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16, 16: 2}

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
}
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
NON_SMOOTH_MODULES = {
    "ReLU",
    "ReLU6",
    "LeakyReLU",
    "PReLU",
    "RReLU",
    "Hardtanh",
    "Hardsigmoid",
    "Hardswish",
    "Threshold",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d",
    "AdaptiveMaxPool3d",
}


@dataclass
class RawModel:
    """A model file opened but not yet checked against data."""

    path: Path
    format: str
    declared_input_shape: tuple[int, ...] | None
    fixed_batch: int | None
    torch_module: nn.Module | None
    session: object | None = None
    converter: str | None = None  # the converter that gave torch_module (ONNX)
    pending_conversions: Iterator[Conversion] = field(default_factory=lambda: iter(()))  # converters not yet tried
    failed_conversions: list[Conversion] = field(default_factory=list)
    slim_error: str | None = None  # why the graph clean-up did not run
    non_smooth_ops: list[str] = field(default_factory=list)
    providers: list[str] = field(default_factory=list)
    output_name: str | None = None  # the ONNX output audited as the embedding
    notes: list[str] = field(default_factory=list)
    mode: str = "saved"  # --model-mode it was opened in (audit/stochastic.py)
    training_modules: list[str] = field(default_factory=list)  # submodules in training mode ("" = root)
    tokens: object | None = None  # splitaudit.tokens.TokenSpace when cut after a token-embedding lookup


@dataclass
class Encoder:
    """A bottom model f on inputs in the audit's space (any --normalize folded in)."""

    path: str
    format: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    device: torch.device
    torch_fn: nn.Module | None
    blackbox_fn: Callable[[torch.Tensor], torch.Tensor]
    fixed_batch: int | None
    parity_max_abs_err: float | None
    stochastic: bool
    warnings: list[str]
    providers: list[str]
    mode: str = "saved"
    training_modules: list[str] = field(default_factory=list)

    @property
    def differentiable(self) -> bool:
        return self.torch_fn is not None

    @property
    def gradient_mode(self) -> str:
        return "autograd" if self.differentiable else "finite-difference"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """f(x) for a batch; differentiable when the model is."""
        fn = self.torch_fn if self.torch_fn is not None else self.blackbox_fn
        return _in_batches(fn, x, self.fixed_batch)

    @torch.no_grad()
    def embed(
        self, x: torch.Tensor, batch_size: int = DEFAULT_BATCH, on_samples: Callable[[int], object] | None = None
    ) -> torch.Tensor:
        """f(x) for any number of samples, in batches, without gradients, on the model's device.

        Batches hold at most batch_size samples and memory.FORWARD_VALUES input values (a few
        dozen 3x224x224 images), and only one batch is on the device at a time; on_samples, when
        given, is told how many samples each batch held (a progress bar's update)."""
        from splitaudit.memory import forward_batch

        size = forward_batch(tuple(x.shape[1:]), batch_size)
        parts = []
        for chunk in x.split(size):
            parts.append(self(chunk.to(self.device)))
            if on_samples is not None:
                on_samples(len(chunk))
        return torch.cat(parts)

    def architecture(self) -> nn.Module | None:
        """The torch module (normalisation included) for re-initialised copies, if known."""
        return self.torch_fn

    def describe(self) -> dict:
        return {
            "path": self.path,
            "format": self.format,
            "input_shape": list(self.input_shape),
            "output_shape": list(self.output_shape),
            "gradient_mode": self.gradient_mode,
            "parity_max_abs_err": self.parity_max_abs_err,
            "stochastic": self.stochastic,
            "mode": self.mode,
            "training_modules": list(self.training_modules),
            "warnings": list(self.warnings),
            "providers": list(self.providers),
        }


class Normalized(nn.Module):
    """Folds --normalize into the encoder: f((x - mean) / std), so MSEs live in x's space."""

    def __init__(self, inner: nn.Module, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner((x - self.mean) / self.std)


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when torch sees a GPU, else cpu; an explicit cuda without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but torch sees no CUDA GPU; use --device auto or cpu")
    return torch.device(name)


def open_model(
    path: str | Path | nn.Module,
    device: torch.device,
    output_name: str | None = None,
    mode: str = "saved",
    mask_input: bool = False,
) -> RawModel:
    """Open a model file (or take an in-memory module) in `mode` (audit/stochastic.py: saved, eval
    or train); raise InputError with a one-line reason when it cannot be used. mask_input: a
    TorchScript or ONNX model may take a second (attention mask) input, which audit/tokens.py binds."""
    if isinstance(path, nn.Module):
        if output_name is not None:
            raise InputError("--output-name selects an output of an ONNX model, not of a torch module")
        return wrap_module(path, device, mode)
    path = require_regular_file(path, "model file")
    if detect_format(path) == "torchscript":
        if output_name is not None:
            raise InputError("--output-name selects an output of an ONNX model; TorchScript models have one")
        return _open_torchscript(path, device, mode, mask_input)
    if mode == "train":
        raise InputError("--model-mode train applies to TorchScript and torch modules; an ONNX graph runs as exported")
    return _open_onnx(path, device, output_name, mask_input)


def wrap_module(module: nn.Module, device: torch.device, mode: str = "saved") -> RawModel:
    """An in-memory torch module (the Python API), copied so that the caller's module is left as it was."""
    copy = deepcopy(module).to(device)
    training = apply_model_mode(copy, mode)
    for p in copy.parameters():
        p.requires_grad_(False)
    layers = {type(m).__name__ for m in copy.modules()}
    return RawModel(
        path=Path(f"<in-memory {type(module).__name__}>"),
        format="torch",
        declared_input_shape=None,
        fixed_batch=None,
        torch_module=copy,
        non_smooth_ops=sorted(layers & NON_SMOOTH_MODULES),
        mode=mode,
        training_modules=training,
    )


def detect_format(path: Path) -> str:
    if path.suffix.lower() == ".onnx":
        return "onnx"
    if path.suffix.lower() in TORCHSCRIPT_SUFFIXES or zipfile.is_zipfile(path):
        return "torchscript"
    return "onnx"


def _open_torchscript(path: Path, device: torch.device, mode: str = "saved", mask_input: bool = False) -> RawModel:
    try:
        with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; users still ship it
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:  # torch raises RuntimeError/ValueError/pickle errors alike
        raise InputError(
            f"{path} is not a loadable TorchScript model ({_first_line(exc)}); "
            "save it with torch.jit.trace(...).save() or torch.jit.script(...).save()"
        ) from exc
    training = apply_model_mode(module, mode)  # TorchScript keeps each module's .training as saved
    required = [a.name for a in module.forward.schema.arguments[1:] if not a.has_default_value()]
    check_single_input(required[:1] if mask_input and len(required) == 2 else required, path)
    for p in module.parameters():
        p.requires_grad_(False)
    ops = {node.kind().split("::")[-1] for node in module.inlined_graph.nodes()}
    return RawModel(
        path=path,
        format="torchscript",
        declared_input_shape=None,
        fixed_batch=None,
        torch_module=Unoptimized(module),
        non_smooth_ops=sorted(ops & NON_SMOOTH_TORCHSCRIPT),
        mode=mode,
        training_modules=training,
    )


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


def _open_onnx(path: Path, device: torch.device, output_name: str | None = None, mask_input: bool = False) -> RawModel:
    import onnx

    try:
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise InputError(f"{path} is not a valid ONNX model (truncated or corrupt?): {_first_line(exc)}") from exc
    names = [i.name for i in _graph_inputs(proto)]
    check_single_input(names[:1] if mask_input and len(names) == 2 else names, path)
    check_onnx_declared_sizes(proto, path)
    refuse_onnx_randomness(proto, path)
    output_name, notes = select_onnx_output(proto, path, output_name)
    redeclared = declare_dynamic_dims(proto)
    batch, shape = _onnx_input_shape(_graph_inputs(proto)[0])
    session, providers = _ort_session(path, device, proto if redeclared else None)
    cleaned, slim_error = slimmed(proto, memory_limit_bytes())
    conversions, failed = _convert_onnx(cleaned, device), []
    first = _next_module(conversions, failed)
    return RawModel(
        path=path,
        format="onnx",
        declared_input_shape=shape,
        fixed_batch=batch,
        torch_module=first.module if first else None,
        session=session,
        non_smooth_ops=sorted(op_types(proto) & NON_SMOOTH_ONNX),
        providers=providers,
        output_name=output_name,
        notes=notes,
        converter=first.converter if first else None,
        pending_conversions=conversions,
        failed_conversions=failed,
        slim_error=slim_error,
    )


def _next_module(conversions: Iterator[Conversion], failed: list[Conversion]) -> Conversion | None:
    """The next conversion that gives a module; the attempts that fail on the way go to `failed`."""
    for conversion in conversions:
        if conversion.module is not None:
            return conversion
        failed.append(conversion)
    return None


def _conversion_failure(raw: RawModel, disagreements: list[str]) -> str:
    """Why no converted module is used, in one line: the operator no converter supports when
    that is the cause, else each converter's failure or disagreement with onnxruntime."""
    unsupported = {c.unsupported_op for c in raw.failed_conversions}
    if not disagreements and len(unsupported) == 1 and None not in unsupported:
        text = f"operator {unsupported.pop()} is supported by no converter ({', '.join(CONVERTERS)})"
    else:
        text = "; ".join([c.error for c in raw.failed_conversions] + disagreements)
    return text + (f"; {raw.slim_error}" if raw.slim_error else "")


def check_single_input(names: list[str], path: Path) -> None:
    """splitaudit audits f(x) of one input; a model that needs several is refused, naming them."""
    if len(names) != 1:
        raise InputError(
            f"{display_path(path)} has {len(names)} inputs ({', '.join(repr(n) for n in names) or 'none'}); "
            "splitaudit audits bottom models with one input (export the model with the other inputs fixed)"
        )


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
            f"most {describe_bytes(limit)} (a quarter of this machine's memory)"
        )
    for info in (*inferred.graph.value_info, *inferred.graph.output):
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        size = _elements(dims) * ONNX_ITEM_BYTES.get(tensor.elem_type, 8) if dims and None not in dims else 0
        if size > limit:
            raise InputError(
                f"{display_path(path)}: tensor {info.name!r} declares shape {dims} "
                f"({describe_bytes(size)}), over the {describe_bytes(limit)} a "
                "model may allocate here (a quarter of this machine's memory)"
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


def _onnx_input_shape(value_info) -> tuple[int | None, tuple[int, ...] | None]:
    """(fixed batch size or None, per-sample shape or None when some dimension is symbolic)."""
    dims = value_info.type.tensor_type.shape.dim
    if not dims:
        return None, None
    batch = dims[0].dim_value or None
    rest = [d.dim_value for d in dims[1:]]
    return batch, (tuple(rest) if all(rest) else None)


def _ort_session(path: Path, device: torch.device, proto=None):
    """An onnxruntime session on the CUDA provider when the device is CUDA and ORT can use it; on
    `proto` (the graph as rewritten in memory) when given, else on the file."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    wanted = ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        wanted.insert(0, "CUDAExecutionProvider")
    try:
        source = str(path) if proto is None else proto.SerializeToString()
        session = ort.InferenceSession(source, sess_options=options, providers=wanted)
    except Exception as exc:
        raise InputError(f"onnxruntime cannot load {path}: {_first_line(exc)}") from exc
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


@dataclass
class Conversion:
    """One converter's attempt: the module, or the reason it failed."""

    converter: str
    module: nn.Module | None
    error: str | None = None
    unsupported_op: str | None = None


def _convert_onnx(proto, device: torch.device) -> Iterator[Conversion]:
    """Each converter's attempt on the cleaned graph, lazily (the next is converted only when the
    one before fails or disagrees with onnxruntime)."""
    _import_torchvision_or_stub()
    for name, convert in CONVERTERS.items():
        try:
            module = convert(proto).eval().to(device)
        except Exception as exc:  # converters raise anything from KeyError to NotImplementedError
            yield Conversion(name, None, f"{name}: {_first_line(exc)}", _unsupported_op(exc))
            continue
        for p in module.parameters():
            p.requires_grad_(False)
        yield Conversion(name, module)


def _unsupported_op(exc: Exception) -> str | None:
    """The operator a converter names when it has no converter for it."""
    match = re.search(r"op_type=(\w+)|operation_type='(\w+)'", str(exc))
    return next(g for g in match.groups() if g) if isinstance(exc, NotImplementedError) and match else None


def _import_torchvision_or_stub() -> None:
    """onnx2pytorch imports torchvision for a few detection ops (RoiAlign, NMS, DeformConv).

    PyPI's torchvision is a CUDA build whose extension cannot load next to a CPU-only torch;
    its import then fails. Those ops are then unavailable (conversion of a model that uses
    them fails, and the model runs black-box); every other operator converts as usual.
    """
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]

    def unavailable(attr: str):
        if attr.startswith("__"):  # module metadata (__file__, __spec__...) stays absent
            raise AttributeError(attr)

        def fail(*_args, **_kwargs):
            raise RuntimeError(f"torchvision.{attr} is unavailable: torchvision does not load here")

        return fail

    for name in ("torchvision", "torchvision.ops", "torchvision.io"):
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() callers (torch.onnx) need one
        stub.__getattr__ = unavailable
        stub.__path__ = []
        sys.modules[name] = stub


def prepare_encoder(raw: RawModel, sample: torch.Tensor, normalize: tuple | None = None) -> Encoder:
    """Check the model against a batch of real inputs and wrap it as an Encoder.

    sample: a batch in the audit's input space (before --normalize is applied).
    """
    device = sample.device
    mean, std = _normalization(normalize, tuple(sample.shape[1:]), device)
    notes: list[str] = list(raw.notes)
    blackbox = _blackbox_fn(raw, mean, std)
    torch_fn = Normalized(raw.torch_module, mean, std) if raw.torch_module is not None else None
    parity = None
    if raw.format == "onnx":
        torch_fn, parity = _check_parity(raw, mean, std, blackbox, sample, notes)
    reference = torch_fn if torch_fn is not None else blackbox
    try:
        with torch.no_grad():
            first = _in_batches(reference, sample, raw.fixed_batch)
            second = _in_batches(reference, sample, raw.fixed_batch)
    except Exception as exc:
        raise randomness_error(exc) or InputError(
            input_dtype_mismatch(raw, sample)
            or f"the model cannot run on inputs of shape {tuple(sample.shape[1:])}: {_first_line(exc)}; "
            + _input_shape_advice(raw)
        ) from exc
    check_embeddings(first, len(sample))
    stochastic = _differs(first, second)
    mode_note = describe_mode(raw.mode, raw.training_modules, stochastic)
    notes[:0] = [mode_note] if mode_note else []
    if not stochastic:
        check_batch_independence(reference, sample, first, raw.fixed_batch)
    else:
        notes.append(
            "stochastic encoder: repeated forward passes differ; attacks see fresh draws, and dFIL averages "
            "the Jacobian over the encoder's draws (see dfil.notes). Whether a sample's embedding depends on "
            "the rest of its batch could not be checked"
        )
    if raw.non_smooth_ops:
        notes.append(
            "non-smooth operators (" + ", ".join(raw.non_smooth_ops) + "): dFIL is only defined almost "
            "everywhere; a smooth variant (GELU, average pooling) gives a sharper audit"
        )
    return Encoder(
        path=str(raw.path),
        format=raw.format,
        input_shape=tuple(sample.shape[1:]),
        output_shape=tuple(first.shape[1:]),
        device=device,
        torch_fn=torch_fn,
        blackbox_fn=blackbox,
        fixed_batch=raw.fixed_batch,
        parity_max_abs_err=parity,
        stochastic=stochastic,
        warnings=notes,
        providers=raw.providers,
        mode=raw.mode,
        training_modules=raw.training_modules,
    )


def input_dtype_mismatch(raw: RawModel, sample: torch.Tensor) -> str | None:
    """Why a model that failed on the data fails, when the cause is the data's dtype (integer
    token ids for a float model, or the reverse): the ONNX input's declared type, or, for torch
    modules, whether the module runs on a few samples cast to the other kind. None otherwise."""
    if raw.session is not None:
        declared = raw.session.get_inputs()[0]
        if (declared.type in ONNX_FLOAT_TYPES) == sample.is_floating_point():
            return None
        wanted = f"{declared.type} values (input {declared.name!r})"
    else:
        other = sample[:2].long() if sample.is_floating_point() else sample[:2].float()
        try:
            with torch.no_grad():
                _in_batches(raw.torch_module, other, raw.fixed_batch)
        except Exception:
            return None
        wanted = f"{other.dtype} values (it runs on them)"
    kind = "floating-point inputs" if sample.is_floating_point() else "integer data (token ids)"
    return (
        f"the model takes {wanted}, but the data holds {sample.dtype}: a model for {kind} is needed, "
        "or data of the model's type"
    )


def _input_shape_advice(raw: RawModel) -> str:
    """What to check after a shape failure: the dynamic dimensions the ONNX graph declares, if any."""
    if raw.session is not None and raw.declared_input_shape is None:
        dims = raw.session.get_inputs()[0].shape
        if any(not isinstance(d, int) for d in dims[1:]):
            shown = ", ".join(str(d) for d in dims)
            return f"the model declares its input as [{shown}] with dynamic sizes: give the one it takes with --input-shape"
    return "check --input-shape and the data"


def _check_parity(raw: RawModel, mean: torch.Tensor, std: torch.Tensor, blackbox, sample, notes: list[str]):
    """The first converted module that matches onnxruntime on the sample, and its max abs error;
    converters are tried in turn (raw.torch_module and raw.converter end as the one used), and
    when none matches the model runs black-box: (None, the last error measured)."""
    try:
        with torch.no_grad():
            reference = _in_batches(blackbox, sample, raw.fixed_batch)
    except Exception:  # the data does not fit the model at all: prepare_encoder says why
        return None, None
    tolerance = PARITY_RTOL * max(1.0, float(reference.abs().max()))
    disagreements: list[str] = []
    err = None
    conversion = Conversion(raw.converter, raw.torch_module) if raw.torch_module is not None else None
    while conversion is not None:
        torch_fn = Normalized(conversion.module, mean, std).eval()
        err, problem = _parity_error(torch_fn, reference, sample, raw.fixed_batch, tolerance)
        if problem is None:
            raw.torch_module, raw.converter = conversion.module, conversion.converter
            if disagreements or raw.failed_conversions:
                notes.append(f"{_conversion_failure(raw, disagreements)}; using {conversion.converter}'s module")
            return torch_fn, err
        disagreements.append(f"{conversion.converter}: {problem}")
        conversion = _next_module(raw.pending_conversions, raw.failed_conversions)
    raw.torch_module = raw.converter = None
    notes.append(f"{_conversion_failure(raw, disagreements)}; running black-box through onnxruntime")
    return None, err


def _parity_error(torch_fn, reference, sample, fixed_batch, tolerance) -> tuple[float | None, str | None]:
    """(max abs error against onnxruntime, None) or (error or None, what is wrong)."""
    try:
        with torch.no_grad():
            err = float((_in_batches(torch_fn, sample, fixed_batch) - reference).abs().max())
    except Exception as exc:
        return None, f"the converted model fails to run ({_first_line(exc)})"
    if not err <= tolerance:
        return err, f"the converted model disagrees with onnxruntime (max abs error {err:.3g} > {tolerance:.3g})"
    return err, None


def _blackbox_fn(raw: RawModel, mean: torch.Tensor, std: torch.Tensor) -> Callable:
    """A torch-in, torch-out forward pass through onnxruntime (or the TorchScript module)."""
    if raw.session is None:
        module = raw.torch_module

        def run_module(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return module((x - mean) / std)

        return run_module
    session = raw.session
    meta = session.get_inputs()[0]
    check_onnx_output_type(session, raw.output_name)
    dtype = (
        np.float64 if meta.type == "tensor(double)" else np.float16 if meta.type == "tensor(float16)" else np.float32
    )

    def run_onnx(x: torch.Tensor) -> torch.Tensor:
        feed = ((x.detach() - mean) / std).cpu().numpy().astype(dtype)
        out = session.run([raw.output_name], {meta.name: feed})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(x.device)

    return run_onnx


def check_onnx_output_type(session, name: str | None) -> None:
    """Embeddings must be floating point: an integer output (argmax, a quantised code) has no
    gradient and no Fisher information to bound."""
    output = next(o for o in session.get_outputs() if name is None or o.name == name)
    if output.type not in ONNX_FLOAT_TYPES:
        raise InputError(
            f"the model's output {output.name!r} is {output.type}; a bottom model must output floating-point embeddings"
        )


def check_embeddings(z: torch.Tensor, n: int, what: str = "the model") -> None:
    """One floating-point, finite embedding per input sample, or InputError saying what is wrong."""
    if not isinstance(z, torch.Tensor):
        raise InputError(f"{what} returns {type(z).__name__}, not one tensor; export a model with one output")
    if not z.is_floating_point():
        raise InputError(f"{what} returns {z.dtype} values; it must output floating-point embeddings")
    if z.dim() < 2 or z.shape[0] != n:
        raise InputError(
            f"{what} returns shape {tuple(z.shape)} for {n} inputs; it must return one "
            "embedding per input (shape (batch, ...))"
        )
    if not torch.isfinite(z).all():
        raise InputError(f"{what} returns NaN or infinite values on the data")


def check_batch_independence(fn: Callable, sample: torch.Tensor, batch: torch.Tensor, fixed_batch: int | None) -> None:
    """Each sample's embedding must not depend on the other samples in its batch (BatchNorm in
    training mode, batch statistics, attention across the batch): dFIL differentiates each sample
    alone, so a batch-mixing model would get a bound that does not describe it. Refused.
    `batch` is fn(sample); the first few samples are run again as a smaller batch of their own."""
    k = min(BATCH_CHECK_SAMPLES, len(sample) - 1)
    if k < 2:  # batches of one break BatchNorm in training mode for other reasons; nothing to compare
        return
    with torch.no_grad():
        small = _in_batches(fn, sample[:k], fixed_batch)
    change = float((small - batch[:k]).abs().max())
    scale = max(1.0, float(batch[:k].abs().max()))
    if not change <= BATCH_DEPENDENCE_RTOL * scale:
        raise InputError(
            f"the model's output for a sample depends on the other samples in its batch (the first {k} samples "
            f"in a batch of {k} vs of {len(sample)} differ by {change:.3g}): BatchNorm in training mode or batch "
            "mixing; audit it with --model-mode eval, or export it in eval mode (model.eval()), so that samples "
            "are independent"
        )


def prepare_top_model(raw: RawModel, embeddings: torch.Tensor) -> tuple[nn.Module | None, Callable, list[str]]:
    """The top model g as (differentiable module or None, forward function, notes). An ONNX g is
    converted and checked for parity with onnxruntime on real embeddings as the bottom model is;
    where no converted module matches, g runs through onnxruntime: enough for the utility
    measurement (forward passes only), while attacks that train through g or copy its
    architecture go without it."""
    zero, one = torch.zeros((), device=embeddings.device), torch.ones((), device=embeddings.device)
    blackbox = _blackbox_fn(raw, zero, one)
    notes: list[str] = []
    module = raw.torch_module
    if raw.format == "onnx":
        module, _ = _check_parity(raw, zero, one, blackbox, embeddings, notes)
    forward = module if module is not None else blackbox
    check_top_model(forward, embeddings)
    return module, forward, [f"--top-model: {note}" for note in notes]


def check_top_model(forward: Callable, embeddings: torch.Tensor) -> None:
    """The top model g gets the same checks as the bottom model: it runs on the embeddings and
    returns one finite, floating-point output per sample (attacks that train on g's output
    would otherwise report numbers computed from NaN)."""
    try:
        with torch.no_grad():
            out = forward(embeddings)
    except Exception as exc:
        raise InputError(
            f"--top-model cannot run on the embeddings of shape {tuple(embeddings.shape[1:])}: {_first_line(exc)}"
        ) from exc
    check_embeddings(out, len(embeddings), "--top-model")


def within_time_limit(fn: Callable, *args, seconds: float | None = None, what: str = "the model checks"):
    """fn(*args) in a worker thread, or InputError when it has not finished after `seconds` (a
    hostile graph can loop over 10^13 elements inside one native call, which no signal interrupts).
    The abandoned thread is a daemon: it cannot keep the process alive."""
    seconds = MODEL_CHECK_SECONDS if seconds is None else seconds
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="splitaudit-model-check", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise InputError(
            f"{what} did not finish within {seconds:g} s (the limit for loading checks); the model "
            "is too slow or allocates too much for an audit"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _in_batches(fn: Callable, x: torch.Tensor, fixed_batch: int | None) -> torch.Tensor:
    """Run fn on x; models exported with a fixed batch size get padded chunks of that size."""
    if not fixed_batch or len(x) == fixed_batch:
        return fn(x)
    outputs = []
    for chunk in x.split(fixed_batch):
        pad = fixed_batch - len(chunk)
        if pad:
            chunk = torch.cat([chunk, chunk[:1].expand(pad, *chunk.shape[1:])])
        outputs.append(fn(chunk)[: fixed_batch - pad])
    return torch.cat(outputs)


def _normalization(normalize: tuple | None, sample_shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """--normalize as broadcastable (mean, std): two numbers, or C means then C stds (C = first dim)."""
    if not normalize:
        return torch.zeros((), device=device), torch.ones((), device=device)
    values = torch.tensor([float(v) for v in normalize], device=device)
    channels = sample_shape[0]
    if len(values) == 2:
        mean, std = values[0], values[1]
    elif len(values) == 2 * channels:
        per_channel = (channels,) + (1,) * (len(sample_shape) - 1)
        mean, std = values[:channels].view(per_channel), values[channels:].view(per_channel)
    else:
        raise InputError(
            f"--normalize takes MEAN,STD or {channels} means then {channels} stds; got {len(values)} numbers"
        )
    if (std <= 0).any():
        raise InputError("--normalize: every STD must be positive")
    return mean, std


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, float(a.abs().max()))
    return float((a - b).abs().max()) > 1e-6 * scale


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
