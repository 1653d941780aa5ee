"""Clustering attack: Zheng et al. (IJCAI 2024, "Protecting Split Learning by Potential Energy
Loss", IJCAI 2024), section 3.2 (clustering attack), section 5.3 and appendix B.0.3.

Threat model: the attacker holds the trained bottom model and many unlabelled samples (here the
target samples' observed embeddings, noisy under --noise-sigma) and knows the number of classes.
It clusters the embeddings with k-means; each cluster then stands for one label. Accuracy is
taken under the best one-to-one cluster-to-label assignment (Hungarian), as the paper does.
The baseline is the same clustering on the raw inputs, without the bottom model. Features with
more than 4096 dimensions (raw 3x224x224 inputs, early-split embeddings) are first projected on
their 256 leading principal components (attacks/parts/features.py); the details say so.

Example::

    get_attack("kmeans").run(ctx)["metrics"]  # {"accuracy": ..., "nmi": ..., "ari": ...}
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.parts.features import flat, reduced
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.threads import threads_for

N_INIT = 10  # Zheng et al. (IJCAI 2024), app. B.0.3: scikit-learn's k-means with 10 initialisations
MAX_ITER = 300  # scikit-learn's default, which the paper used; explicit so results do not move with it


class KMeansAttack(Attack):
    """k-means on target embeddings, scored against the true labels under the best assignment."""

    name = "kmeans"
    kind = "label"
    primary_metric = "accuracy"
    title = "Clustering (k-means)"
    baseline_name = "k-means on the raw inputs"
    baseline_role = "raw-input"
    metrics = ("accuracy", "nmi", "ari")
    needs = frozenset({"labels"})
    assumptions = (
        "The attacker holds the trained bottom model and unlabelled target samples, and knows the "
        "number of classes; it clusters their embeddings with k-means (Zheng et al., IJCAI 2024). Labels are used "
        "only to score the clusters. Baseline: k-means on the raw inputs."
    )

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        embeddings = ctx.observed_embeddings("target", ctx.generator(seed))
        labels = ctx.target.y.cpu().numpy()
        (points,), attack_features = reduced(embeddings, seed=seed)
        (raw,), baseline_features = reduced(ctx.target.x, seed=seed)
        attack = cluster_scores(points, labels, ctx.num_classes, seed)
        baseline = cluster_scores(raw, labels, ctx.num_classes, seed)
        return SeedOutcome(
            metrics=attack,
            baseline=baseline,
            details={
                "n_clusters": ctx.num_classes,
                "n_init": N_INIT,
                "max_iter": MAX_ITER,
                "n_samples": len(labels),
                "features": attack_features,
                "baseline_features": baseline_features,
            },
        )


def cluster_scores(
    features: torch.Tensor | np.ndarray, labels: np.ndarray, n_clusters: int, seed: int
) -> dict[str, float]:
    """k-means on flattened features; accuracy under the best assignment, NMI and ARI."""
    clusters = kmeans_clusters(features, n_clusters, seed)
    return {
        "accuracy": best_assignment_accuracy(clusters, labels),
        "nmi": float(normalized_mutual_info_score(labels, clusters)),
        "ari": float(adjusted_rand_score(labels, clusters)),
    }


def kmeans_clusters(features: torch.Tensor | np.ndarray, n_clusters: int, seed: int) -> np.ndarray:
    """The k-means cluster of each row of the flattened features (the paper's scikit-learn settings)."""
    points = (flat(features) if isinstance(features, torch.Tensor) else features).astype(np.float64)
    with threads_for(points.size):
        return KMeans(n_clusters=n_clusters, n_init=N_INIT, max_iter=MAX_ITER, random_state=seed).fit_predict(points)


def best_assignment_accuracy(clusters: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy under the one-to-one cluster-to-label map that maximises it (Hungarian method
    on the cluster-by-label count matrix; Zheng et al., IJCAI 2024, app. B.0.3)."""
    counts = np.zeros((clusters.max() + 1, labels.max() + 1), dtype=np.int64)
    np.add.at(counts, (clusters, labels), 1)
    rows, cols = linear_sum_assignment(counts, maximize=True)
    return float(counts[rows, cols].sum() / len(labels))


def largest_class_share(y: torch.Tensor) -> float:
    """The relabelled accuracy of any constant labelling: the largest class's share of y."""
    return float(torch.bincount(y).max()) / len(y)
