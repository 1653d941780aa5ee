"""Stochastic encoders: which mode is audited, seeded draws, and errors that name randomness.

A bottom model can draw random numbers in its forward pass (dropout left on, noise added inside
it, randomised activations such as R3eLU of Mao et al., ECCV 2020). Which of its modules draw is
a stated choice (`--model-mode`): the mode the model was saved in (default), eval (every module
in eval mode: dropout off) or train (every module in training mode). The Jacobian products and
the attacks then face the encoder's own draws (estimators/jacobian.py, audit/context.py); the
draws come from torch's global generator, so they are seeded here for reproducible numbers.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from splitaudit.config import MODEL_MODES
from splitaudit.errors import InputError

# Modules whose training mode mixes the samples of a batch: refused in train mode (the batch
# independence check cannot run once the encoder draws random numbers).
BATCH_STATISTICS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "InstanceNorm")
# ONNX operators that draw random numbers (Dropout only with training_mode true).
# Words of torch's messages when a transform meets a random operator it cannot batch or differentiate.
RANDOMNESS_MARKERS = ("randomness", "random operation", "bernoulli", "dropout", "randn", "rand_like", "multinomial")
ONNX_RANDOM_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial")


def check_model_mode(mode: str) -> str:
    if mode not in MODEL_MODES:
        raise InputError(f"--model-mode must be one of {', '.join(MODEL_MODES)}, got {mode!r}")
    return mode


def apply_model_mode(module: nn.Module, mode: str) -> list[str]:
    """Put module in the asked mode (saved: left as it is) and return the names of its submodules
    in training mode ("" for the root), sorted. Refuses batch statistics in training mode
    when the mode was chosen (the user's saved model gets the batch-independence check instead)."""
    check_model_mode(mode)
    if mode != "saved":
        module.train(mode == "train")
    training = sorted(name for name, sub in module.named_modules() if sub.training)
    mixing = [name or "<root>" for name, sub in module.named_modules() if sub.training and _is_batch_norm(sub)]
    if mode == "train" and mixing:
        raise InputError(
            f"--model-mode train puts {mixing[0]} ({_kind(module, mixing[0])}) in training mode, where it uses "
            "batch statistics and mixes the samples of a batch; use --model-mode saved or eval"
        )
    return training


def describe_mode(mode: str, training: list[str], stochastic: bool, format_: str) -> str:
    """One line for the report's warnings: which mode was audited and what that means."""
    if format_ == "onnx":
        return "ONNX graph audited as exported: its operators fix whether it draws random numbers"
    asked = {"saved": "the mode it was saved in", "eval": "eval mode", "train": "training mode"}[mode]
    what = (
        f"{len(training)} module(s) in training mode ({', '.join(n or '<root>' for n in training[:4])}"
        + (", ..." if len(training) > 4 else "")
        + ")"
        if training
        else "every module in eval mode"
    )
    line = f"model audited in {asked} (--model-mode {mode}): {what}"
    if stochastic and mode == "eval":
        line += (
            "; it still draws random numbers (torch.jit.trace records dropout's training flag as a constant, and "
            "noise drawn in forward ignores the mode), so the audit faces its draws, as a server would"
        )
    elif stochastic:
        line += "; its random draws (dropout, internal noise) stay on in the audit, as a server would face them"
    elif training and mode != "eval":
        line += "; repeated passes agree, so no module draws random numbers"
    return line


def _is_batch_norm(module: nn.Module) -> bool:
    return _module_type(module).startswith(BATCH_STATISTICS)


def _module_type(module: nn.Module) -> str:
    """The Python class name, also for TorchScript submodules (RecursiveScriptModule keeps it)."""
    return getattr(module, "original_name", None) or type(module).__name__


def _kind(root: nn.Module, name: str) -> str:
    return _module_type(root.get_submodule(name) if name != "<root>" else root)


def onnx_random_nodes(proto) -> list[str]:
    """'OpType (node name)' for each node of the graph that draws random numbers."""
    import onnx.numpy_helper

    found = []
    constants = {init.name: onnx.numpy_helper.to_array(init) for init in proto.graph.initializer}
    for node in proto.graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None:
            constants[node.output[0]] = onnx.numpy_helper.to_array(value)
    for node in proto.graph.node:
        if node.op_type in ONNX_RANDOM_OPS or (node.op_type == "Dropout" and _dropout_training(node, constants)):
            found.append(f"{node.op_type}{' training_mode=1' if node.op_type == 'Dropout' else ''} ({node.name!r})")
    return found


def _dropout_training(node, constants: dict) -> bool:
    """Dropout's training_mode input (opset 12+): true when it is a true constant or computed."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    value = constants.get(node.input[2])
    return value is None or bool(value.any())


def refuse_onnx_randomness(proto, path) -> None:
    """ONNX graphs that draw random numbers are refused naming the operator: onnxruntime draws
    without a seed and the converters drop or mistranslate these operators, so neither a sound
    Jacobian nor reproducible attacks could be had."""
    nodes = onnx_random_nodes(proto)
    if nodes:
        raise InputError(
            f"{path} draws random numbers in its graph ({', '.join(nodes[:3])}); splitaudit audits stochastic "
            "encoders from TorchScript or torch modules: save the model with torch.jit.script or trace instead"
        )


@contextlib.contextmanager
def naming_randomness() -> Iterator[None]:
    """Re-raise a failure caused by the model's random draws as an InputError that names it."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as exc:
        named = randomness_error(exc)
        if named is None:
            raise
        raise named from exc


def randomness_error(exc: BaseException) -> InputError | None:
    """An InputError naming the cause when exc comes from the model's random draws, else None."""
    lines = str(exc).splitlines() or [""]
    named = [line.strip() for line in lines if any(m in line.lower() for m in RANDOMNESS_MARKERS)]
    if not named or not isinstance(exc, (RuntimeError, NotImplementedError)):
        return None
    first = named[0][:200]
    return InputError(
        "the model draws random numbers in its forward pass in a way splitaudit cannot follow "
        f"({first}); audit it with --model-mode eval, or draw the randomness with torch.randn_like/dropout"
    )
