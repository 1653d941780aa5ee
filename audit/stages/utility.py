"""Utility under noise: the task accuracy a split model keeps when its embeddings are noised.

The price of the defence that the privacy bounds are bought with. With the top model g
(--top-model) it is the deployed split model's accuracy, g(f(x) + N(0, sigma^2 I)) against the
target labels. Without g it is estimated by a probe (the attribute attack's probe: logistic
regression or a small MLP, chosen on held-out aux data) trained on noisy aux embeddings with
their labels and scored on noisy target embeddings: what a top model trained under the same
noise could reach. The report says which. Its drop from sigma = 0 is the utility loss.
"""

from __future__ import annotations

import numpy as np
import torch

from splitaudit.attacks.attribute import MLP_EPOCHS, QUICK_MLP_EPOCHS, probe_attack
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.errors import InputError

TOP_MODEL_BATCH = 512
SOURCE_WORDS = {
    "top-model": "accuracy of the top model (--top-model) on noisy embeddings of the labelled target data",
    "probe": "accuracy of a probe trained on noisy aux embeddings with their labels and scored on noisy target "
    "embeddings (no classifier --top-model given: an estimate of what a top model trained under this noise reaches)",
}


def utility_source(ctx: AuditContext) -> str:
    """The top model's accuracy only when it outputs the class scores: one declared to be the server's
    body g of U-shaped SL (--top-model-role body) has no classifier to score, so a probe measures."""
    return "top-model" if ctx.top_model_forward is not None and ctx.top_model_role == "classifier" else "probe"


def measure_utility(ctx: AuditContext) -> dict:
    """Task accuracy at ctx.noise_sigma, mean and std over the audit's seeds (fresh noise each)."""
    source = utility_source(ctx)
    entry = {"source": source, "description": SOURCE_WORDS[source], "noise_sigma": ctx.noise_sigma}
    reason = _unmeasurable(ctx, source)
    if reason:
        return {**entry, "status": "skipped", "accuracy": None, "accuracy_std": None, "reason": reason}
    accuracies = [
        _top_model_accuracy(ctx, seed) if source == "top-model" else _probe_accuracy(ctx, seed) for seed in ctx.seeds
    ]
    return {
        **entry,
        "status": "ok",
        "reason": "",
        "accuracy": float(np.mean(accuracies)),
        "accuracy_std": float(np.std(accuracies)),
        "seeds": list(ctx.seeds),
    }


def _unmeasurable(ctx: AuditContext, source: str) -> str | None:
    """Why the task accuracy cannot be measured here: no labels, or (for the probe, which is trained on
    aux) aux labels of a single class, from which no classifier can be fitted."""
    if ctx.aux.y is None or ctx.target.y is None:
        return "the data has no labels (npz 'y', --label-column, or an image folder's class names)"
    if source == "probe" and len(ctx.aux.y.unique()) < 2:
        return "the aux labels hold a single class: no probe can be trained to stand in for a top model"
    return None


def utility_section(ctx: AuditContext, clean: dict | None = None) -> dict:
    """measure_utility at ctx.noise_sigma plus `clean_accuracy` (sigma = 0, measured unless given)
    and `loss` = clean_accuracy - accuracy (in accuracy units; > 0 means the noise costs accuracy)."""
    section = measure_utility(ctx)
    if section["status"] != "ok":
        return {**section, "clean_accuracy": None, "loss": None}
    if clean is None:
        clean = section if ctx.noise_sigma == 0 else measure_utility(ctx.at_sigma(0.0))
    return {**section, "clean_accuracy": clean["accuracy"], "loss": clean["accuracy"] - section["accuracy"]}


@torch.no_grad()
def _top_model_accuracy(ctx: AuditContext, seed: int) -> float:
    """Fraction of target samples whose noisy embedding g classifies as its label."""
    observed = ctx.observed_embeddings("target", ctx.generator(seed))
    try:
        logits = torch.cat([ctx.top_model_forward(chunk) for chunk in observed.split(TOP_MODEL_BATCH)])
    except Exception as exc:  # a top model that does not take these embeddings is bad input
        raise InputError(
            f"the top model does not accept the bottom model's embeddings of shape "
            f"{tuple(observed.shape[1:])}: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from exc
    if logits.ndim != 2 or logits.shape[0] != len(observed) or logits.shape[1] < (ctx.num_classes or 0):
        raise InputError(
            f"the top model should return (batch, classes) logits for {ctx.num_classes} classes; it returned "
            f"shape {tuple(logits.shape)} (if it is the server's body g, pass --top-model-role body)"
        )
    return float((logits.argmax(1) == label_indices(ctx.target).to(logits.device)).double().mean())


def label_indices(data) -> torch.Tensor:
    """The labels as the class indices a classifier outputs: the data's own integer labels where every
    class is an integer (the loader numbers classes 0..K-1 in sorted order, which is another index when
    the labels are, say, {1, 2}, or one class of several), else the loader's numbers (text labels)."""
    names = data.class_names
    if names and all(name.lstrip("-").isdigit() for name in names):
        return torch.tensor([int(name) for name in names], device=data.y.device)[data.y]
    return data.y


def _probe_accuracy(ctx: AuditContext, seed: int) -> float:
    """The attribute attack's probe, fitted to the task labels instead of the attribute."""
    noise = ctx.generator(seed)
    result = probe_attack(
        ctx.observed_embeddings("aux", noise),
        ctx.aux.y.cpu().numpy(),
        ctx.observed_embeddings("target", noise),
        ctx.target.y.cpu().numpy(),
        seed,
        QUICK_MLP_EPOCHS if ctx.quick else MLP_EPOCHS,
    )
    return result["scores"]["accuracy"]
