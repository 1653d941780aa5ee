"""A model as a loader hands it over (RawModel), and what the loaders and the checks share:
running a model in its fixed batch size (in_batches), the two ways to run a model saved with a
static batch (SavedBatch), folding --normalize into it (Normalized),
the one-input rule, and an exception's first line for one-line error messages.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.data import IMAGE_CHANNELS


@dataclass
class Conversion:
    """One converter's attempt: the module, or the reason it failed."""

    converter: str
    module: nn.Module | None
    error: str | None = None
    unsupported_op: str | None = None


@dataclass
class SavedBatch:
    """A model saved with a static batch of `size` (an ONNX input [1, C, H, W], a torch.export
    program traced without a dynamic batch), opened with that dimension free. Both functions take
    model inputs; whether the free one gives the saved one's outputs on any batch is checked on real
    data (splitaudit.inputs.model_checks.settle_static_batch), which then calls use_free(raw, True) on
    the RawModel as it is then (loaders may have replaced it); until then it runs in chunks of `size`."""

    size: int
    saved: Callable[[torch.Tensor], torch.Tensor]  # the model as saved (called on batches of `size`)
    free: Callable[[torch.Tensor], torch.Tensor]  # the model with its batch dimension free
    use_free: Callable[[RawModel, bool], None]  # have it run whole batches (True) or chunks of `size` (False)


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
    mode: str = "saved"  # --model-mode it was opened in (audit/inputs/stochastic.py)
    training_modules: list[str] = field(default_factory=list)  # submodules in training mode ("" = root)
    tokens: object | None = None  # splitaudit.inputs.tokens.TokenSpace when cut after a token-embedding lookup
    stored_dtype: torch.dtype = torch.float32  # the weights' precision (audit/inputs/precision.py)
    saved_module: nn.Module | None = None  # a torch model as saved, when torch_module computes in another precision
    channels_last: bool = False  # takes H,W,C images, audited as C,H,W (audit_layout)
    scripted: object | None = None  # a TorchScript model's ScriptModule as loaded (token_models cuts its graph)
    quantized_session: object | None = None  # a quantized ONNX model as saved; `session` runs it straight-through
    saved_batch: SavedBatch | None = None  # saved with a static batch, opened with the batch free

    @property
    def runs_a_graph(self) -> bool:
        """Whether onnxruntime runs the model as saved (`session`) and `torch_module`, when there is one,
        is a converter's translation of that graph: the two are checked for parity before either is
        trusted, and the module's own weights are not the model's."""
        return self.session is not None


# torch's recurrent layers, by class name: a TorchScript module keeps it as its original_name.
RECURRENT_LAYERS = ("LSTM", "GRU", "RNN")


class Normalized(nn.Module):
    """Folds --normalize into the encoder: f((x - mean) / std), so MSEs live in x's space; for a
    model that takes channels-last images, the C,H,W images are moved to H,W,C first (audit_layout).

    A bottom with recurrent layers runs without oneDNN (mkldnn): on CPU its LSTM kernel in eval mode
    keeps no workspace, so a vector-Jacobian product through it fails ("got None for argument
    'workspace'") and forward-mode AD is not implemented for it; torch's native kernels give both.
    Checked on LSTM bottoms in TorchScript and ONNX (legacy and dynamo exports)."""

    def __init__(self, inner: nn.Module, mean: torch.Tensor, std: torch.Tensor, channels_last: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.recurrent = has_recurrent_layers(inner)
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with without_onednn() if self.recurrent else nullcontext():
            return self.inner(model_layout((x - self.mean) / self.std, self.channels_last))

    def unwrapped(self) -> nn.Module:
        """The wrapped model itself when the wrapper changes nothing (mean 0, std 1, no layout move),
        so its own methods can be called on the audit's inputs; else the wrapper."""
        plain = not self.channels_last and bool((self.mean == 0).all()) and bool((self.std == 1).all())
        return self.inner if plain and not self.recurrent else self


def model_layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A batch of the audit's C,H,W images in the model's layout (H,W,C when it takes channels last)."""
    return x.permute(0, 2, 3, 1) if channels_last else x


def audit_layout(raw: RawModel, input_shape: tuple[int, ...] | None) -> RawModel:
    """Fix the per-sample shape the audit works in: --input-shape, else the model's declared one.
    An image model that takes channels last (H,W,C with C 1 or 3, as tf2onnx writes Keras models)
    is audited on C,H,W images, moved to its layout before each pass: attacks, SSIM, figures and
    image folders all read images channels first, and MSE and dFIL do not depend on the order."""
    shape = tuple(input_shape) if input_shape else raw.declared_input_shape
    if (
        raw.tokens is None
        and shape
        and len(shape) == 3
        and shape[2] in IMAGE_CHANNELS
        and shape[0] not in IMAGE_CHANNELS
    ):
        shape = (shape[2], shape[0], shape[1])
        raw.channels_last = True
        raw.notes.append(
            f"the model takes channels-last images ({shape[1]}x{shape[2]}x{shape[0]}); the audit works on "
            f"{'x'.join(map(str, shape))} images and moves the channels last before each pass"
        )
    raw.declared_input_shape = shape
    return raw


def has_recurrent_layers(module: nn.Module) -> bool:
    """Whether any submodule is an LSTM, GRU or RNN (a torch layer, or one saved in TorchScript)."""
    return any(
        isinstance(m, nn.RNNBase) or getattr(m, "original_name", None) in RECURRENT_LAYERS for m in module.modules()
    )


def without_onednn():
    """oneDNN (mkldnn) kernels off for the block, torch's other mkldnn settings kept."""
    return torch.backends.mkldnn.flags(enabled=False, deterministic=torch.backends.mkldnn.deterministic)


@dataclass(frozen=True)
class Outputs:
    """What a torch model returns: one tensor, a sequence (tuple or list) of `count` outputs (None
    when unknown), or a dict (its keys when known)."""

    kind: str  # "tensor", "sequence" or "dict"
    count: int | None = None
    keys: tuple[str, ...] | None = None


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


def select_output(
    module: nn.Module, outputs: Outputs, output_name: str | None, path: Path
) -> tuple[nn.Module, list[str]]:
    """The module with its audited output chosen, and the note that says which: a tuple or list is
    indexed (--output-name 1), a dict keyed (--output-name pooled), a tensor taken as it is (where
    --output-name is refused)."""
    if outputs.kind == "tensor":
        if output_name is not None:
            raise InputError(f"--output-name selects one of several outputs; {display_path(path)} returns one tensor")
        return module, []
    if outputs.kind == "sequence":
        what = f"tuple of {outputs.count} outputs" if outputs.count is not None else "list of outputs"
        if output_name is not None and not (
            output_name.isdigit() and (outputs.count is None or int(output_name) < outputs.count)
        ):
            raise InputError(
                f"--output-name {output_name!r}: {display_path(path)} returns a {what}; name one by its index (0 for the first)"
            )
        note = (
            f"the model returns a {what}; auditing output {output_name or 0} (choose another with --output-name INDEX)"
        )
    else:
        named = f" ({', '.join(outputs.keys)})" if outputs.keys else ""
        if output_name is not None and outputs.keys and output_name not in outputs.keys:
            raise InputError(
                f"--output-name {output_name!r} is not an output of the model (outputs: {', '.join(outputs.keys)})"
            )
        note = (
            f"the model returns a dict of outputs{named}; auditing its first entry (choose one with --output-name KEY)"
        )
    return SelectedOutput(module, output_name), [] if output_name is not None else [note]


def check_single_input(names: list[str], path: Path) -> None:
    """splitaudit audits f(x) of one input; a model that needs several is refused, naming them."""
    if len(names) != 1:
        raise InputError(
            f"{display_path(path)} has {len(names)} inputs ({', '.join(repr(n) for n in names) or 'none'}); "
            "splitaudit audits bottom models with one input (export the model with the other inputs fixed)"
        )


def in_batches(fn: Callable, x: torch.Tensor, fixed_batch: int | None) -> torch.Tensor:
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


def first_line(exc: BaseException) -> str:
    """An exception's first line, at most 300 characters: error messages stay one line."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
