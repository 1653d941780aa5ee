"""Stochastic encoders: which mode is audited, seeded draws, and errors that name randomness.

A bottom model can draw random numbers in its forward pass (dropout left on, noise added inside
it, randomised activations such as the R3eLU of Mao et al., 2023). Which of its modules draw is
a stated choice (`--model-mode`): the mode the model was saved in (default), eval (every module
in eval mode: dropout off) or train (every module in training mode). The Jacobian products and
the attacks then face the encoder's own draws (estimators/jacobian.py, audit/context/audit_context.py), seeded
per job with core.draws.seeded_draws. ONNX graphs that draw are refused here, and
failures caused by draws are named (InputError) instead of surfacing as internal errors.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from splitaudit.core.errors import InputError

# Modules whose training mode mixes the samples of a batch: refused in train mode (the batch
# independence check cannot run once the encoder draws random numbers).
BATCH_STATISTICS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")
# Words of torch's messages when a transform meets a random operator it cannot batch or differentiate.
RANDOMNESS_MARKERS = ("randomness", "random operation", "bernoulli", "dropout", "randn", "rand_like", "multinomial")
# ONNX operators that draw random numbers (Dropout only with training_mode true).
ONNX_RANDOM_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial")


def apply_model_mode(module: nn.Module, mode: str) -> list[str]:
    """Put module in the asked mode (saved: left as it is) and return the names of its submodules
    in training mode ("" for the root), sorted. Train mode refuses batch statistics; a model saved
    with them in training mode gets the batch-independence check of model_checks.py instead. `mode`
    is one of config.MODEL_MODES, checked with the other options (AuditOptions.validate)."""
    if mode != "saved":
        module.train(mode == "train")
    if mode == "train":
        _refuse_batch_statistics(module)
    return sorted(name for name, sub in module.named_modules() if sub.training)


def _refuse_batch_statistics(module: nn.Module) -> None:
    """InputError naming the first module that would use batch statistics in training mode."""
    for name, sub in module.named_modules():
        kind = getattr(sub, "original_name", None) or type(sub).__name__  # TorchScript keeps the class name
        if kind.startswith(BATCH_STATISTICS):
            raise InputError(
                f"--model-mode train puts {name or '<root>'} ({kind}) in training mode, where it uses batch "
                "statistics and mixes the samples of a batch; use --model-mode saved or eval"
            )


def describe_mode(mode: str, training: list[str], stochastic: bool) -> str | None:
    """One line for the report's warnings on which mode was audited and what that means, where it
    matters: the model draws random numbers or the mode was chosen (model.mode always says it)."""
    if not stochastic and mode == "saved":
        return None
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
        return line + (
            "; it still draws random numbers (torch.jit.trace records dropout's training flag as a constant, and "
            "noise drawn in forward ignores the mode), so the audit faces its draws, as a server would"
        )
    if stochastic:
        return line + "; its random draws (dropout, internal noise) stay on in the audit, as a server would face them"
    return line + ("; repeated passes agree, so no module draws random numbers" if mode == "train" else "")


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
