"""The checks a model passes on real data before it is audited: a converted ONNX module matches
onnxruntime (parity), the outputs are one finite floating-point embedding per sample, no sample's
embedding depends on the rest of its batch, repeated passes agree (else the encoder is stochastic),
the top model runs on the embeddings, and loading ends within a time limit. Failures raise
InputError with a one-line reason.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from splitaudit.core.errors import InputError
from splitaudit.inputs.onnx_loading import ONNX_FLOAT_TYPES, Conversion, conversion_failure, next_module
from splitaudit.inputs.precision import parity_rtol
from splitaudit.inputs.raw_model import Normalized, RawModel, first_line, in_batches

PARITY_RTOL = 1e-4
MODEL_CHECK_SECONDS = 300  # loading checks (conversion, parity, first passes) must end within this
BATCH_CHECK_SAMPLES = 4  # samples run as a batch of their own to check that no output depends on the rest of the batch
BATCH_DEPENDENCE_RTOL = 1e-4


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
                in_batches(raw.torch_module, other, raw.fixed_batch)
        except Exception:
            return None
        wanted = f"{other.dtype} values (it runs on them)"
    kind = "floating-point inputs" if sample.is_floating_point() else "integer data (token ids)"
    return (
        f"the model takes {wanted}, but the data holds {sample.dtype}: a model for {kind} is needed, "
        "or data of the model's type"
    )


def input_shape_advice(raw: RawModel) -> str:
    """What to check after a shape failure: the dynamic dimensions the ONNX graph declares, if any."""
    if raw.session is not None and raw.declared_input_shape is None:
        dims = raw.session.get_inputs()[0].shape
        if any(not isinstance(d, int) for d in dims[1:]):
            shown = ", ".join(str(d) for d in dims)
            return f"the model declares its input as [{shown}] with dynamic sizes: give the one it takes with --input-shape"
    return "check --input-shape and the data"


def check_parity(raw: RawModel, mean: torch.Tensor, std: torch.Tensor, blackbox, sample, notes: list[str]):
    """The first converted module that matches onnxruntime on the sample, and its max abs error;
    converters are tried in turn (raw.torch_module and raw.converter end as the one used), and
    when none matches the model runs black-box: (None, the last error measured)."""
    try:
        with torch.no_grad():
            reference = in_batches(blackbox, sample, raw.fixed_batch)
    except Exception:  # the data does not fit the model at all: prepare_encoder says why
        return None, None
    tolerance = _tolerance(raw, reference)
    disagreements: list[str] = []
    err = None
    conversion = Conversion(raw.converter, raw.torch_module) if raw.torch_module is not None else None
    while conversion is not None:
        torch_fn = Normalized(conversion.module, mean, std, raw.channels_last).eval()
        err, problem = _parity_error(torch_fn, reference, sample, raw.fixed_batch, tolerance)
        if problem is None:
            raw.torch_module, raw.converter = conversion.module, conversion.converter
            if disagreements or raw.failed_conversions:
                notes.append(f"{conversion_failure(raw, disagreements)}; using {conversion.converter}'s module")
            return torch_fn, err
        disagreements.append(f"{conversion.converter}: {problem}")
        conversion = next_module(raw.pending_conversions, raw.failed_conversions)
    raw.torch_module = raw.converter = None
    notes.append(f"{conversion_failure(raw, disagreements)}; running black-box through onnxruntime")
    return None, err


def check_saved_precision(raw: RawModel, torch_fn: Callable, saved: Callable, sample: torch.Tensor) -> float | None:
    """The largest difference between the float32 computation of a torch model stored in float16 or
    bfloat16 and the model as saved, run on the sample; InputError when it exceeds rounding (the model
    casts inside forward, say), since the audit would then differentiate another function. None when
    the model cannot run as saved here (a CPU without a half-precision kernel it uses): not checked."""
    try:
        with torch.no_grad():
            reference = in_batches(saved, sample, raw.fixed_batch)
    except Exception:
        return None
    tolerance = _tolerance(raw, reference)
    err, problem = _parity_error(torch_fn, reference, sample, raw.fixed_batch, tolerance)
    if problem is not None:
        dtype = str(raw.stored_dtype).removeprefix("torch.")
        found = "fails to run" if err is None else f"differs from it run as saved by {err:.3g} (> {tolerance:.3g})"
        raise InputError(
            f"the model is stored in {dtype}, and its float32 copy, which the audit differentiates, {found}: "
            "it may cast inside forward; save the model in float32 (model.float())"
        )
    return err


def _tolerance(raw: RawModel, reference: torch.Tensor) -> float:
    """The largest difference a computation of the model may have from its reference run: PARITY_RTOL,
    or rounding in a low stored precision, relative to the largest |output| (at least 1)."""
    return parity_rtol(raw.stored_dtype, PARITY_RTOL) * max(1.0, float(reference.abs().max()))


def _parity_error(torch_fn, reference, sample, fixed_batch, tolerance) -> tuple[float | None, str | None]:
    """(max abs error against onnxruntime, None) or (error or None, what is wrong)."""
    try:
        with torch.no_grad():
            err = float((in_batches(torch_fn, sample, fixed_batch) - reference).abs().max())
    except Exception as exc:
        return None, f"the converted model fails to run ({first_line(exc)})"
    if not err <= tolerance:
        return err, f"the converted model disagrees with onnxruntime (max abs error {err:.3g} > {tolerance:.3g})"
    return err, None


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
        small = in_batches(fn, sample[:k], fixed_batch)
    change = float((small - batch[:k]).abs().max())
    scale = max(1.0, float(batch[:k].abs().max()))
    if not change <= BATCH_DEPENDENCE_RTOL * scale:
        raise InputError(
            f"the model's output for a sample depends on the other samples in its batch (the first {k} samples "
            f"in a batch of {k} vs of {len(sample)} differ by {change:.3g}): BatchNorm in training mode or batch "
            "mixing; audit it with --model-mode eval, or export it in eval mode (model.eval()), so that samples "
            "are independent"
        )


def check_top_model(forward: Callable, embeddings: torch.Tensor) -> None:
    """The top model g gets the same checks as the bottom model: it runs on the embeddings and
    returns one finite, floating-point output per sample (attacks that train on g's output
    would otherwise report numbers computed from NaN)."""
    try:
        with torch.no_grad():
            out = forward(embeddings)
    except Exception as exc:
        raise InputError(
            f"--top-model cannot run on the embeddings of shape {tuple(embeddings.shape[1:])}: {first_line(exc)}"
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


def outputs_differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, float(a.abs().max()))
    return float((a - b).abs().max()) > 1e-6 * scale
