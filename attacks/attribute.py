"""Attribute (property) inference attack: the offline form of the property inference attack in
Mao et al. (2023, "Secure Split Learning against Property Inference, Data Reconstruction,
and Feature Space Hijacking Attacks", sections 3 and 5.2.1).

Threat model: the attacker observes the embeddings the client sends (noisy under
--noise-sigma) and holds auxiliary samples from the same domain whose sensitive attribute it
knows. It trains an inference model (a probe) on the auxiliary embeddings and applies it to the
target samples' embeddings. Two probes are tried, logistic regression and a small MLP; the one
with the better accuracy on a held-out part of the attacker's own data is reported (the target's
attribute is never used to choose). Baseline: guessing the aux data's majority attribute, what an
attacker achieves without the embeddings (the advantage of Zheng et al., IJCAI 2024, Def. 1). The
same probes trained on the private inputs themselves are reported beside it as a reference
(details["raw_input_probe"]), never as the bar: a probe on embeddings that reads the attribute
less well than one on the inputs still leaks it, and calling that a failed attack would hide the
leak. Features
with more than 4096 dimensions are projected on their 256 leading principal components, fitted
on the attacker's aux data (attacks/parts/features.py); details["features"] says so.

Example::

    get_attack("attribute").run(ctx)["metrics"]  # {"accuracy": ..., "auc": ...}
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.parts.features import reduced
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.threads import threads_for

VALIDATION_FRACTION = 0.25
MLP_HIDDEN = 64
SKLEARN_INTERRUPTED = "Training interrupted by user"  # what sklearn's MLP warns when it swallows Ctrl-C
MLP_EPOCHS = 200
QUICK_MLP_EPOCHS = 60


class AttributeAttack(Attack):
    """A probe trained on auxiliary embeddings predicts the target samples' sensitive attribute."""

    name = "attribute"
    kind = "label"
    primary_metric = "accuracy"
    title = "Sensitive-attribute inference"
    baseline_name = "guessing the majority value"
    metrics = ("accuracy", "auc")
    needs = frozenset({"attribute"})
    assumptions = (
        "The attacker observes the embeddings and holds auxiliary samples with a known sensitive "
        "attribute; it trains a probe (logistic regression or a small MLP, chosen on its own "
        "validation data) on their embeddings and predicts the attribute of the target samples "
        "(property inference, Mao et al., 2023). Baseline: the majority guess; the same probes on the "
        "private inputs are shown as a reference."
    )

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        noise = ctx.generator(seed)
        aux_attr, target_attr = ctx.aux.attr.cpu().numpy(), ctx.target.attr.cpu().numpy()
        epochs = QUICK_MLP_EPOCHS if ctx.quick else MLP_EPOCHS
        attack = probe_attack(
            ctx.observed_embeddings("aux", noise),
            aux_attr,
            ctx.observed_embeddings("target", noise),
            target_attr,
            seed,
            epochs,
        )
        raw = probe_attack(ctx.aux.x, aux_attr, ctx.target.x, target_attr, seed, epochs)
        majority = majority_guess(aux_attr, target_attr)
        why = undefined_auc(target_attr, np.unique(aux_attr))
        return SeedOutcome(
            metrics=attack["scores"],
            baseline=majority["scores"],
            details={
                "probe": attack["probe"],
                "validation_accuracy": attack["validation_accuracy"],
                "baseline": majority["probe"],
                "raw_input_probe": raw,
                "majority": majority,
                **({"auc_undefined": why} if why else {}),
            },
        )


def probes(seed: int, epochs: int) -> dict[str, Pipeline]:
    """The candidate inference models, each on standardised features."""
    return {
        "logistic-regression": make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)),
        "mlp": make_pipeline(
            StandardScaler(), MLPClassifier(hidden_layer_sizes=(MLP_HIDDEN,), max_iter=epochs, random_state=seed)
        ),
    }


def probe_attack(
    aux: torch.Tensor, aux_attr: np.ndarray, target: torch.Tensor, target_attr: np.ndarray, seed: int, epochs: int
) -> dict:
    """Fit every probe on part of the aux data, keep the best on the rest, score it on the target."""
    arrays, reduction = reduced(aux, target, seed=seed)
    features, target_features = (a.astype(np.float64) for a in arrays)
    fit, val = validation_split(aux_attr, seed)
    fit_x, val_x, fit_a, val_a = features[fit], features[val], aux_attr[fit], aux_attr[val]
    fitted, validation = {}, {}
    with threads_for(features.size), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the epoch cap is deliberate
        for name, probe in probes(seed, epochs).items():
            fitted[name] = fit_interruptibly(probe, fit_x, fit_a)
            validation[name] = float(probe.score(val_x, val_a))
        best = max(validation, key=validation.get)
        scores = probe_scores(fitted[best], target_features, target_attr)
    return {"probe": best, "validation_accuracy": validation, "scores": scores, "features": reduction}


def validation_split(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit, validation) indices, VALIDATION_FRACTION of the samples for validation, stratified by
    label. A class with one sample cannot be stratified (a class of two split between aux and target
    leaves one): it goes to the fit part, since a probe predicts only classes it was fitted on. Where
    either part would be too small to hold every class, the split is random."""
    values, counts = np.unique(labels, return_counts=True)
    alone = np.isin(labels, values[counts < 2])
    rest = np.flatnonzero(~alone)
    n_val = math.ceil(VALIDATION_FRACTION * len(rest))
    if len(rest) == 0 or min(n_val, len(rest) - n_val) < int((counts >= 2).sum()):
        return train_test_split(np.arange(len(labels)), test_size=VALIDATION_FRACTION, random_state=seed)
    fit, val = train_test_split(rest, test_size=VALIDATION_FRACTION, random_state=seed, stratify=labels[rest])
    return np.concatenate([fit, np.flatnonzero(alone)]), val


def fit_interruptibly(probe: Pipeline, x: np.ndarray, y: np.ndarray) -> Pipeline:
    """probe.fit, with Ctrl-C kept: sklearn's MLP catches KeyboardInterrupt mid-training, warns
    SKLEARN_INTERRUPTED and returns a half-trained probe, so an interrupted audit would go on and
    report. That warning is made an error here and raised as the interrupt."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=SKLEARN_INTERRUPTED, category=UserWarning)
        try:
            return probe.fit(x, y)
        except UserWarning as exc:
            if SKLEARN_INTERRUPTED in str(exc):
                raise KeyboardInterrupt from exc
            raise


def probe_scores(probe: Pipeline, features: np.ndarray, attr: np.ndarray) -> dict[str, float]:
    """Accuracy and AUC (one-vs-rest for more than two values) of a fitted probe; an undefined AUC is
    NaN (written "nan" in report.json), and undefined_auc says why."""
    proba = probe.predict_proba(features)
    accuracy = float((probe.classes_[proba.argmax(1)] == attr).mean())
    return {"accuracy": accuracy, "auc": auc(attr, proba, probe.classes_)}


def auc(attr: np.ndarray, proba: np.ndarray, classes: np.ndarray) -> float:
    """ROC AUC of predicted probabilities; NaN where it is undefined (undefined_auc)."""
    if undefined_auc(attr, classes):
        return math.nan
    if len(classes) == 2:
        return float(roc_auc_score(attr == classes[1], proba[:, 1]))
    return float(roc_auc_score(attr, proba, multi_class="ovr", labels=classes))


def undefined_auc(attr: np.ndarray, classes: np.ndarray) -> str | None:
    """Why the probe's ROC AUC on these target values is undefined, or None: it ranks each value the
    probe knows against the rest, which needs target samples with and without it (scikit-learn
    would warn UndefinedMetricWarning and return NaN)."""
    values, classes = np.unique(attr).tolist(), list(classes.tolist())
    if len(values) < 2:
        return f"the target samples all hold one attribute value ({values[0]!r}): ROC AUC needs two"
    ranked = classes[1:] if len(classes) == 2 else classes
    absent = [c for c in ranked if c not in values]
    if absent:
        return f"attribute value {absent[0]!r}, which the probe learned, is absent from the target samples"
    unseen = [v for v in values if v not in classes]
    if unseen and len(classes) > 2:
        return f"the target samples hold attribute value {unseen[0]!r}, which the probe never saw, so cannot rank"
    return None


def majority_guess(aux_attr: np.ndarray, target_attr: np.ndarray) -> dict:
    """Predict the aux data's most frequent attribute value for everyone (AUC of a constant: 0.5,
    where an AUC is defined)."""
    values, counts = np.unique(aux_attr, return_counts=True)
    accuracy = float((target_attr == values[counts.argmax()]).mean())
    chance = math.nan if undefined_auc(target_attr, values) else 0.5
    return {"probe": "majority", "scores": {"accuracy": accuracy, "auc": chance}}
