"""The checks a model passes on real data before it is audited: a converted ONNX module matches
onnxruntime (parity), the outputs are one finite floating-point embedding per sample, no sample's
embedding depends on the rest of its batch, repeated passes agree (else the encoder is stochastic),
the model neither edits its own weights nor answers differently as the audit goes on (its
fingerprint), the top model runs on the embeddings, and loading ends within a time limit. Failures
raise InputError with a one-line reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from splitaudit.core.errors import InputError
from splitaudit.inputs.onnx_loading import ONNX_FLOAT_TYPES, conversion_failure, next_module
from splitaudit.inputs.precision import parity_rtol
from splitaudit.inputs.raw_model import Conversion, Normalized, RawModel, first_line, in_batches

PARITY_RTOL = 1e-4
MODEL_CHECK_SECONDS = 300  # loading checks (conversion, parity, first passes) must end within this
BATCH_CHECK_SAMPLES = 4  # samples run as a batch of their own to check that no output depends on the rest of the batch
BATCH_DEPENDENCE_RTOL = 1e-4
EMBEDDING_LIMIT = 1e15  # largest |embedding| audited: squared norms and distances of larger values overflow float32
FINGERPRINT_RTOL = 1e-3  # a deterministic model's answers may move this much (root mean square) between runs
SPREAD_MARGIN = 2.0  # a stochastic model's later draws may differ from its first by this many times its spread
CAPTURED_MUTATION = "mutate a captured tensor"  # torch.func's words when f edits a tensor it closes over


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


def settle_static_batch(raw: RawModel, inputs: torch.Tensor) -> str | None:
    """Decide how a model saved with a static batch runs (raw.saved_batch): whole batches when its
    free-batch form gives, on a batch of another size, the outputs of the model as saved run in
    chunks of its saved size (same shape, within the parity tolerance); else in chunks, and the note
    that says so and why (its batch size enters the computation: a Reshape to [1, -1], a batch baked
    into a constant). `inputs`: real data in the model's input space."""
    saved = raw.saved_batch
    if saved is None:
        return None
    if len(inputs) == saved.size:  # a batch of the saved size would show nothing
        inputs = torch.cat([inputs, inputs[:1]])
    try:
        with torch.no_grad():
            reference = in_batches(saved.saved, inputs, saved.size)
            saved.use_free(raw, True)
            batched = saved.free(inputs)
        agree = batched.shape == reference.shape and float((batched - reference).abs().max()) <= _tolerance(
            raw, reference
        )
    except Exception:  # the free-batch form fails on other batch sizes (a shape baked into the graph)
        agree = False
    saved.use_free(raw, agree)
    if agree:
        return None
    return (
        f"the model was saved with a static batch of {saved.size}, and its outputs depend on that size (a reshape "
        f"or constant has it built in), so it runs {saved.size} sample{'s' if saved.size > 1 else ''} per call: "
        "slower than a model exported with a dynamic batch dimension"
    )


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
    check_magnitude(z, what)


def check_magnitude(z: torch.Tensor, what: str) -> None:
    """InputError when outputs exceed EMBEDDING_LIMIT: the squared norms and distances the bounds
    and attacks take would overflow float32 to inf, and every number computed from them be void."""
    largest = float(z.abs().max()) if z.numel() else 0.0
    if largest > EMBEDDING_LIMIT:
        raise InputError(
            f"{what} returns values up to {largest:.3g} in magnitude; beyond {EMBEDDING_LIMIT:.0e} their squares "
            "overflow float32 in the bounds and attacks: scale the model's output down"
        )


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


@dataclass(frozen=True)
class Fingerprint:
    """The model's first answers on the inputs it was first checked on, and how far a later answer on
    them may differ, in root mean square: FINGERPRINT_RTOL of the answers' own for a deterministic
    model, SPREAD_MARGIN times the difference between its first two passes for a stochastic one. The
    audit asks again after its dFIL stage and at its end: a model whose answers drift (a call counter,
    state kept between calls) would otherwise get a bound computed on one function while its
    embeddings came from another."""

    probe: torch.Tensor
    answers: torch.Tensor
    allowed: float

    @classmethod
    def taken(cls, sample: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> "Fingerprint":
        """From the model's first two passes (first, second) over sample."""
        allowed = FINGERPRINT_RTOL * _rms(first) + SPREAD_MARGIN * _rms(first - second)
        return cls(sample, first, allowed)

    def confirm(self, fn: Callable, when: str) -> None:
        """InputError when fn's answers on the probe now differ from the first ones by more than allowed."""
        with torch.no_grad():
            now = fn(self.probe)
        change = _rms(now - self.answers) if now.shape == self.answers.shape else float("inf")
        if not change <= self.allowed:
            raise InputError(
                f"the model's output changed between calls: {when}, its answers on the same {len(self.probe)} inputs "
                f"differ from its first ones by {change:.3g} in root mean square (allowed {self.allowed:.3g}, from "
                "its own rounding and random draws); a model that keeps state between calls cannot be audited as "
                "one function"
            )


def _rms(z: torch.Tensor) -> float:
    return float(z.double().pow(2).mean().sqrt())


def state_digest(modules: list) -> dict[str, str]:
    """SHA-256 of every parameter and buffer of the modules, by name, read one tensor at a time:
    compared before and after the model runs, it shows a model that edits its own weights."""
    digests = {}
    for i, module in enumerate(modules):
        for name, tensor in module.state_dict().items():
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and not tensor.is_quantized:
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                digests[f"{i}:{name}"] = hashlib.sha256(data).hexdigest()
    return digests


def check_state_unchanged(before: dict[str, str], modules: list) -> None:
    """InputError naming the weights or buffers the model's forward passes changed."""
    after = state_digest(modules)
    changed = [name.partition(":")[2] for name, digest in before.items() if after.get(name) != digest]
    if changed:
        raise state_edit_error(", ".join(changed[:3]))


@contextlib.contextmanager
def naming_state_edits() -> Iterator[None]:
    """Re-raise torch.func's refusal of a model that edits a tensor it holds (a weight, a call
    counter) while it is differentiated as an InputError that names the cause."""
    try:
        yield
    except RuntimeError as exc:
        if CAPTURED_MUTATION not in str(exc).lower():
            raise
        raise state_edit_error("in place, while differentiated") from exc


def state_edit_error(which: str) -> InputError:
    return InputError(
        f"the model changes its own weights or buffers ({which}) when it runs: its answers then depend on how "
        "often it was called, so no one function could be audited; remove the in-place updates from forward "
        "(BatchNorm in training mode updates its running statistics: use --model-mode eval)"
    )
