"""Fine-tuning (model completion) attack: Zheng et al. (IJCAI 2024, "Protecting Split Learning by
Potential Energy Loss", IJCAI 2024), section 3.2 and appendix B.

Threat model: the attacker holds the trained bottom model (frozen) and k labelled samples per
class from the same domain. It observes their forward embeddings (noisy under --noise-sigma)
and trains a fresh top model on them, then labels the target samples from their embeddings.
The baseline is Zheng et al.'s (IJCAI 2024) A(D; null): the same k-shot data training a whole model from
scratch on raw inputs, without the bottom model.

Example::

    ctx.attack_options["fine-tune"] = {"head": "mlp", "k": [1, 5]}
    get_attack("fine-tune").run(ctx)["metrics"]["accuracy_by_k"]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.kmeans import largest_class_share
from splitaudit.attacks.parts.nets import bottom_architecture, mlp, reinitialized_copy, seeded
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.memory import batch_within, forward_batch, per_sample_bytes
from splitaudit.core.options import option
from splitaudit.core.plateau import STOPPED_BY_CAP
from splitaudit.core.threads import threads_for

DEFAULT_KS = (1, 5, 10, 40)
QUICK_KS = (1, 10)
EPOCH_CAP = 1000  # Zheng et al. (IJCAI 2024), app. B: stop when the training error < 0.01 or after 1,000 epochs
QUICK_EPOCH_CAP = 200
TARGET_TRAINING_ERROR = 0.01
LEARNING_RATE = 1e-3  # Adam with its default parameters (Zheng et al., IJCAI 2024, app. B)
BATCH_SIZE = 64
MLP_HIDDEN = 128
EVAL_BATCH = 1024
HEADS = ("linear", "mlp", "top-model")


@dataclass(frozen=True)
class FineTuneOptions:
    """`[attack.fine-tune]`: the top model's head, the k sweep and the epoch cap."""

    head: str = option(
        "linear", "the fresh top model: linear, mlp, or the given top model re-initialised", choices=HEADS
    )
    k: tuple[int, ...] | None = option(
        None, f"labelled samples per class to try (default {list(DEFAULT_KS)}, quick {list(QUICK_KS)})", low=1
    )
    epochs: int | None = option(None, f"epoch cap (default {EPOCH_CAP}, quick {QUICK_EPOCH_CAP})", low=1)


@dataclass(frozen=True)
class FineTuneSettings:
    """The attack's knobs, from its options with the defaults that depend on --quick. Not quick_X
    options (Attack.options' rule): only k and epochs left unset take the quick defaults, while a
    quick_k would replace a k the user asks for under --quick too."""

    head: str
    ks: tuple[int, ...]
    epoch_cap: int

    @classmethod
    def from_context(cls, ctx: AuditContext) -> "FineTuneSettings":
        options = FineTuneAttack().options(ctx)
        requested = options.k or (QUICK_KS if ctx.quick else DEFAULT_KS)
        epoch_cap = options.epochs or (QUICK_EPOCH_CAP if ctx.quick else EPOCH_CAP)
        return cls(head=options.head, ks=tuple(sorted(set(requested))), epoch_cap=epoch_cap)


class FineTuneAttack(Attack):
    """Train a fresh top model on k-shot embeddings (bottom model frozen); accuracy on the target."""

    name = "fine-tune"
    kind = "label"
    primary_metric = "accuracy"
    needs = frozenset({"labels"})
    title = "Model completion (fine-tune)"
    baseline_name = "a model trained from scratch on the same labelled samples"
    baseline_role = "raw-input"
    metrics = ("accuracy", "accuracy_by_k")
    series = {
        "accuracy_by_k": {
            "title": "Accuracy against labelled samples per class",
            "key": "k per class",
            "axis": "labelled samples per class (k)",
            "value": "accuracy on target data",
        }
    }
    Options = FineTuneOptions
    assumptions = (
        "The attacker holds the trained bottom model (frozen) and k labelled samples per class from "
        "the same domain, and trains a fresh top model on their embeddings (model completion, "
        "Zheng et al., IJCAI 2024). Baseline: the same labelled samples training a whole model from scratch on "
        "raw inputs."
    )

    advantage_basis = "the largest gain over the k values tried (the bottom model helps most with few labels)"

    def advantage(self, metrics: dict, baseline: dict) -> float:
        """The largest accuracy gain over the k sweep: the bottom model helps most with few
        labels (Zheng et al., IJCAI 2024), and a gate on the advantage must see that worst case."""
        return max(self._gains(metrics, baseline).values())

    def advantage_at(self, metrics: dict, baseline: dict) -> str:
        """The k where the seeds' mean accuracies differ most (each seed's advantage is its own largest gain)."""
        gains = self._gains(metrics, baseline)
        return f"k={max(gains, key=gains.get)}"

    def inconclusive_reason(self, entry: dict, not_converged: list[str]) -> str:
        """Also inconclusive when the attacker's head is no better than always guessing the most
        frequent class at every k: it learned nothing from the embeddings, so it measured nothing."""
        reasons = [super().inconclusive_reason(entry, not_converged)]
        floor = entry["details"].get("majority_accuracy")
        best = max(entry["metrics"]["accuracy_by_k"].values())
        if floor is not None and best <= floor:
            reasons.append(
                f"its head did no better than always guessing the most frequent class at any k (accuracy {best:.4g} "
                f"against {floor:.4g}): more epochs (fine-tune.epochs) or another head (fine-tune.head) may help"
            )
        return "; ".join(r for r in reasons if r)

    @staticmethod
    def _gains(metrics: dict, baseline: dict) -> dict:
        return {k: metrics["accuracy_by_k"][k] - baseline["accuracy_by_k"][k] for k in metrics["accuracy_by_k"]}

    def missing(self, ctx: AuditContext) -> str | None:
        reason = super().missing(ctx)
        if reason is None and self.options(ctx).head == "top-model" and ctx.top_model is None:
            if ctx.top_model_forward is not None:
                return "head 'top-model' needs the top model as a torch module; no converter loads this --top-model"
            return "head 'top-model' needs the top model (--top-model)"
        return reason

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        settings = FineTuneSettings.from_context(ctx)
        noise = ctx.generator(seed)
        z_aux = ctx.observed_embeddings("aux", noise)
        z_target = ctx.observed_embeddings("target", noise)
        shots = k_shot_indices(ctx.aux.y, settings.ks, seed)
        attack, baseline, epochs, baseline_epochs = {}, {}, {}, {}
        with threads_for(ctx.target.x.numel(), ctx.device):
            for k, index in shots.items():
                labels = ctx.aux.y[index]
                head = make_head(settings.head, ctx, z_aux[index], labels, seed)
                epochs[k] = train_classifier(head, z_aux[index], labels, settings.epoch_cap, seed)
                attack[k] = accuracy(head, z_target, ctx.target.y)
                scratch = from_scratch_model(settings.head, ctx, ctx.aux.x[index], labels, seed)
                baseline_epochs[k] = train_classifier(scratch, ctx.aux.x[index], labels, settings.epoch_cap, seed)
                baseline[k] = accuracy(scratch, ctx.target.x, ctx.target.y)
        largest = max(shots, key=int)
        return SeedOutcome(
            metrics={"accuracy": attack[largest], "accuracy_by_k": attack},
            baseline={"accuracy": baseline[largest], "accuracy_by_k": baseline},
            details={
                "head": settings.head,
                "k": [int(k) for k in shots],
                "majority_accuracy": largest_class_share(ctx.target.y),
                "epoch_cap": settings.epoch_cap,
                "attack_epochs_by_k": epochs,
                "baseline_epochs_by_k": baseline_epochs,
                "attack_stopped_by_k": {k: stopped_by(n, settings.epoch_cap) for k, n in epochs.items()},
                "baseline_stopped_by_k": {k: stopped_by(n, settings.epoch_cap) for k, n in baseline_epochs.items()},
            },
        )


def k_shot_indices(labels: torch.Tensor, ks: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """Indices of k samples per class for each k (nested: the 5-shot set holds the 1-shot set).

    k is capped by the smallest class count in the data; keys are the k values as strings.
    """
    y = labels.cpu().numpy()
    rng = np.random.default_rng(seed)
    per_class = [rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]
    cap = min(len(members) for members in per_class)
    shots = {}
    for k in sorted({min(k, cap) for k in ks}):
        index = np.concatenate([members[:k] for members in per_class])
        shots[str(k)] = torch.as_tensor(index, device=labels.device)
    return shots


def make_head(kind: str, ctx: AuditContext, features: torch.Tensor, labels: torch.Tensor, seed: int) -> nn.Module:
    """A fresh top model for these features: linear (class-mean init), MLP, or the top model's architecture."""
    classes = ctx.num_classes
    with seeded(seed):
        if kind == "linear":
            head = nn.Sequential(nn.Flatten(), class_mean_linear(features.flatten(1), labels, classes))
        elif kind == "mlp":
            head = mlp([features[0].numel(), MLP_HIDDEN, classes])
        else:
            head = reinitialized_copy(ctx.top_model, seed)
    return head.to(ctx.device)


def class_mean_linear(features: torch.Tensor, labels: torch.Tensor, classes: int) -> nn.Linear:
    """A linear layer whose weights are the class means (Zheng et al., IJCAI 2024, app. B), biased so that it
    starts as the nearest-class-mean classifier (bias -||mu_c||^2 / 2)."""
    counts = torch.bincount(labels, minlength=classes).clamp(min=1).to(features.dtype)
    means = torch.zeros(classes, features.shape[1], device=features.device, dtype=features.dtype)
    means.index_add_(0, labels, features)
    means /= counts[:, None]
    layer = nn.Linear(features.shape[1], classes)
    with torch.no_grad():
        layer.weight.copy_(means)
        layer.bias.copy_(-0.5 * (means**2).sum(1))
    return layer


def from_scratch_model(kind: str, ctx: AuditContext, x: torch.Tensor, labels: torch.Tensor, seed: int) -> nn.Module:
    """Zheng et al.'s (IJCAI 2024) A(D; null): the bottom architecture re-initialised, then the same kind of head."""
    bottom = bottom_architecture(ctx, seed)
    with torch.no_grad():
        features = torch.cat([bottom(chunk) for chunk in x.split(forward_batch(tuple(x.shape[1:]), EVAL_BATCH))])
    return nn.Sequential(bottom, make_head(kind, ctx, features, labels, seed))


def train_classifier(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, epoch_cap: int, seed: int) -> int:
    """Adam on cross-entropy until the training error is below 0.01 or the epoch cap; returns
    the number of epochs run. Mini-batches of 64 in a seeded order, accumulated over smaller
    micro-batches when 64 samples' activations exceed the memory budget (large images; BatchNorm
    layers then see the micro-batch's statistics)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    order = torch.Generator().manual_seed(seed)
    batches = math.ceil(len(inputs) / BATCH_SIZE)
    micro = batch_within(per_sample_bytes(model.eval(), inputs), BATCH_SIZE)  # eval: BN statistics untouched
    for epoch in range(epoch_cap):
        if 1.0 - accuracy(model, inputs, labels) < TARGET_TRAINING_ERROR:
            return epoch
        model.train()
        for index in torch.randperm(len(inputs), generator=order).to(inputs.device).chunk(batches):
            optimizer.zero_grad()
            for part in index.split(micro):  # gradient accumulation when a batch exceeds the memory budget
                loss = F.cross_entropy(model(inputs[part]), labels[part], reduction="sum") / len(index)
                loss.backward()
            optimizer.step()
    return epoch_cap


def stopped_by(epochs: int, epoch_cap: int) -> str:
    """Why a train_classifier run ended: the attacker's own signal (its training error below
    TARGET_TRAINING_ERROR, which it observes on its k-shot data) or the epoch cap. With k samples per
    class there is no data to spare for a held-out slice: Zheng et al.'s (IJCAI 2024) rule is the signal."""
    return "training_error" if epochs < epoch_cap else STOPPED_BY_CAP


@torch.no_grad()
def accuracy(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy of a classifier, in eval mode and in batches (the target set may be large)."""
    model.eval()
    size = forward_batch(tuple(inputs.shape[1:]), EVAL_BATCH)
    correct = sum(int((model(chunk).argmax(1) == y).sum()) for chunk, y in zip(inputs.split(size), labels.split(size)))
    return correct / len(labels)
