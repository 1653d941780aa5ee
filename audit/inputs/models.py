"""Load a bottom model (a model file of any registered format, or an in-memory torch module) behind one
interface, the `Encoder`: open_model opens a file by its format's loader (audit/inputs/formats/),
prepare_encoder checks the opened model on real data
(splitaudit.inputs.model_checks) and wraps it. When no converter gives an ONNX model a module that
matches onnxruntime, the model runs black-box through onnxruntime (forward passes only, no gradients).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from splitaudit.core.draws import seeded_draws
from splitaudit.core.errors import InputError
from splitaudit.core.safety import require_regular_file
from splitaudit.inputs.model_checks import (
    Fingerprint,
    check_batch_independence,
    check_embeddings,
    check_parity,
    check_saved_precision,
    check_state_unchanged,
    check_top_model,
    input_dtype_mismatch,
    input_shape_advice,
    outputs_differ,
    settle_static_batch,
    state_digest,
)
from splitaudit.inputs.model_format import ModelRequest, loader_for
from splitaudit.inputs.onnx_loading import check_onnx_output_type, onnx_runner
from splitaudit.inputs.precision import audit_precision, precision_note
from splitaudit.inputs.raw_model import Normalized, RawModel, first_line, in_batches, model_layout
from splitaudit.inputs.stochastic import apply_model_mode, describe_mode, randomness_error

DEFAULT_BATCH = 256

# Layers whose derivative jumps, in an in-memory torch module (see onnx_loading.NON_SMOOTH_ONNX).
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
    converter: str | None = None  # the converter whose module is audited (an ONNX model's), if any
    mode: str = "saved"
    training_modules: list[str] = field(default_factory=list)
    fingerprint: Fingerprint | None = None  # its first answers on the loading checks' inputs (None: not rechecked)
    batch_note: str | None = None  # why it runs in chunks of the static batch it was saved with, if it does

    @property
    def differentiable(self) -> bool:
        return self.torch_fn is not None

    @property
    def gradient_mode(self) -> str:
        return "autograd" if self.differentiable else "finite-difference"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """f(x) for a batch; differentiable when the model is."""
        fn = self.torch_fn if self.torch_fn is not None else self.blackbox_fn
        return in_batches(fn, x, self.fixed_batch)

    @torch.no_grad()
    def embed(
        self, x: torch.Tensor, batch_size: int = DEFAULT_BATCH, on_samples: Callable[[int], object] | None = None
    ) -> torch.Tensor:
        """f(x) for any number of samples, in batches, without gradients, on the model's device.

        Batches hold at most batch_size samples and memory.FORWARD_VALUES input values (a few
        dozen 3x224x224 images), and only one batch is on the device at a time; on_samples, when
        given, is told how many samples each batch held (a progress bar's update)."""
        from splitaudit.core.memory import forward_batch

        size = forward_batch(tuple(x.shape[1:]), batch_size)
        parts = []
        for chunk in x.split(size):
            parts.append(self(chunk.to(self.device)))
            if on_samples is not None:
                on_samples(len(chunk))
        return torch.cat(parts)

    def confirm_unchanged(self, when: str) -> None:
        """InputError when the model's answers on its fingerprint's inputs have drifted from its first
        ones (`when` says at which stage); draws seeded, so the caller's random state is left alone."""
        if self.fingerprint is not None:
            with seeded_draws(0, self.device):
                self.fingerprint.confirm(self, when)

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
    """Open a model file as saved, by its format's loader (audit/inputs/formats/), or take an in-memory
    module, in `mode` (audit/inputs/stochastic.py: saved, eval or train); raise InputError with a
    one-line reason when it cannot be used. mask_input: a TorchScript or ONNX model may take a second
    (attention mask) input, which the token cuts bind."""
    if isinstance(path, nn.Module):
        if output_name is not None:
            raise InputError("--output-name selects an output of an ONNX model, not of a torch module")
        return wrap_module(path, device, mode)
    path = require_regular_file(path, "model file")
    return loader_for(path).open_file(path, device, ModelRequest(output_name, mode, mask_input=mask_input))


def wrap_module(module: nn.Module, device: torch.device, mode: str = "saved") -> RawModel:
    """An in-memory torch module (the Python API), copied so that the caller's module is left as it was."""
    copy = deepcopy(module).to(device)
    training = apply_model_mode(copy, mode)
    for p in copy.parameters():
        p.requires_grad_(False)
    layers = {type(m).__name__ for m in copy.modules()}
    computed, saved, dtype = audit_precision(copy)
    return RawModel(
        path=Path(f"<in-memory {type(module).__name__}>"),
        format="torch",
        declared_input_shape=None,
        fixed_batch=None,
        torch_module=computed,
        stored_dtype=dtype,
        saved_module=saved,
        non_smooth_ops=sorted(layers & NON_SMOOTH_MODULES),
        mode=mode,
        training_modules=training,
    )


def prepare_encoder(raw: RawModel, sample: torch.Tensor, normalize: tuple | None = None) -> Encoder:
    """Check the model against a batch of real inputs and wrap it as an Encoder.

    sample: a batch in the audit's input space (before --normalize is applied).
    """
    device = sample.device
    mean, std = _normalization(normalize, tuple(sample.shape[1:]), device)
    notes: list[str] = list(raw.notes)
    held = [m for m in (raw.torch_module, raw.saved_module) if m is not None and not raw.runs_a_graph]
    weights = state_digest(held)
    batch_note = settle_static_batch(raw, model_layout((sample - mean) / std, raw.channels_last))
    notes.extend([batch_note] if batch_note else [])
    blackbox = _blackbox_fn(raw, mean, std)
    torch_fn = Normalized(raw.torch_module, mean, std, raw.channels_last) if raw.torch_module is not None else None
    parity = None
    if raw.runs_a_graph:
        torch_fn, parity = check_parity(raw, mean, std, blackbox, sample, notes)
    elif raw.saved_module is not None:
        parity = check_saved_precision(raw, torch_fn, blackbox, sample)
    precision = precision_note(raw.stored_dtype, parity) if torch_fn is not None else None
    notes.extend([precision] if precision else [])
    reference = torch_fn if torch_fn is not None else blackbox
    try:
        with torch.no_grad():
            first = in_batches(reference, sample, raw.fixed_batch)
            second = in_batches(reference, sample, raw.fixed_batch)
    except InputError:  # the model's own wrappers say what is wrong (a missing --output-name key)
        raise
    except Exception as exc:
        raise randomness_error(exc) or InputError(
            input_dtype_mismatch(raw, sample)
            or f"the model cannot run on inputs of shape {tuple(sample.shape[1:])}: {first_line(exc)}; "
            + input_shape_advice(raw)
        ) from exc
    check_embeddings(first, len(sample))
    if raw.quantized_session is not None:
        notes.append(quantization_note(raw, mean, std, sample, first))
    stochastic = outputs_differ(first, second)
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
    check_state_unchanged(weights, held)
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
        converter=raw.converter if torch_fn is not None else None,
        mode=raw.mode,
        training_modules=raw.training_modules,
        fingerprint=Fingerprint.taken(sample, first, second),
        batch_note=batch_note,
    )


def quantization_note(raw: RawModel, mean, std, sample: torch.Tensor, audited: torch.Tensor) -> str:
    """What the report says of a quantized model, with how far the audited (straight-through)
    function's embeddings are from the quantized model's on the sample."""
    quantized = in_batches(
        _blackbox_fn(replace(raw, session=raw.quantized_session), mean, std), sample, raw.fixed_batch
    )
    gap = float((quantized - audited).abs().max())
    share = gap / max(float(quantized.abs().max()), 1e-12)
    return (
        "the model is quantized (QuantizeLinear/DequantizeLinear): its exact Jacobian is zero almost everywhere, "
        "so gradients, dFIL and attacks use it with the quantization removed (straight-through, weights "
        f"dequantized), whose embeddings differ from the quantized model's by up to {gap:.3g} ({share:.1%} of the "
        "largest) on the data; the bounds describe that function"
    )


def _blackbox_fn(raw: RawModel, mean: torch.Tensor, std: torch.Tensor) -> Callable:
    """A torch-in, torch-out forward pass through onnxruntime (or the TorchScript module)."""
    if raw.session is None:
        module = raw.saved_module or raw.torch_module

        def run_module(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return module(model_layout((x - mean) / std, raw.channels_last))

        return run_module
    check_onnx_output_type(raw.session, raw.output_name)
    runner = onnx_runner(raw.session, raw.output_name)

    def run_onnx(x: torch.Tensor) -> torch.Tensor:
        return runner(model_layout((x.detach() - mean) / std, raw.channels_last))

    return run_onnx


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
    if raw.runs_a_graph:
        module, _ = check_parity(raw, zero, one, blackbox, embeddings, notes)
    forward = module if module is not None else blackbox
    check_top_model(forward, embeddings)
    return module, forward, [f"--top-model: {note}" for note in notes]


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
