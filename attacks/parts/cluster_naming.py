"""Label inference without labels or the client's tail: cluster the target embeddings, then name
each cluster by the shape of the class layout.

In U-shaped split learning offline, the server sees the client's embeddings of its private data
but neither their labels nor the tail h that reads them. The embeddings of a trained model form one
cluster per class, so k-means finds the partition (Zheng et al., IJCAI 2024, the kmeans attack);
what it cannot say is which cluster is which class. The attacker's labelled aux data can: classes
that look alike lie close together both in the input space and in the embedding space (a smooth f
keeps neighbours near), so the matrix of distances between the clusters' centroids resembles the
matrix of distances between the aux classes' input centroids, up to the unknown renaming. The
renaming that makes the two matrices agree best names the clusters (a quadratic assignment
problem, solved exactly for up to EXACT_CLASSES classes and by restarted pairwise swaps above).

Measured on U-shaped models of tests/support/ushaped.py (benchmarks/RESULTS.md, seed 0): the named labels
are right as often as the partition is on the flat LayerNorm model (0.98, where SDAR's simulated
tail h~ names the same clusters wrongly offline: 0.04) and the ResNet (0.94); only partly on the
MobileNet (0.65 of a 0.81 partition) and the ViT, whose layouts agree less (correlation 0.85
against 0.96): 0.23 of a 0.70 partition (majority 0.09). This naming step is this tool's own, not
part of Zhu et al. (NDSS 2025); it fails where the class layouts of input and embedding differ.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from splitaudit.attacks.kmeans import kmeans_clusters
from splitaudit.attacks.parts.features import reduced
from splitaudit.core.errors import InputError

EXACT_CLASSES = 8  # up to 8! = 40,320 renamings are all scored; above, restarted pairwise swaps
SWAP_RESTARTS = 200  # random starts of the pairwise-swap search (10 classes: ~1 s)


def geometry_named_labels(
    embeddings: torch.Tensor, aux_x: torch.Tensor, aux_y: torch.Tensor, classes: int, seed: int
) -> tuple[torch.Tensor, dict]:
    """A label for each target embedding (k-means cluster, named by the centroid layout) and the
    details of how: features used and the agreement of the two layouts (1: same up to scale)."""
    check_clusterable(aux_y, len(embeddings), classes)
    (points,), features = reduced(embeddings, seed=seed)
    clusters = torch.from_numpy(kmeans_clusters(points, classes, seed)).long()
    cluster_layout = centroid_distances(torch.from_numpy(np.asarray(points)).double(), clusters, classes)
    class_layout = centroid_distances(aux_x.detach().cpu().flatten(1).double(), aux_y.cpu(), classes)
    names = best_renaming(cluster_layout, class_layout, seed)
    agreement = float(np.corrcoef(cluster_layout.ravel(), class_layout[np.ix_(names, names)].ravel())[0, 1])
    return torch.from_numpy(names)[clusters].to(embeddings.device), {
        "features": features,
        "layout_agreement": agreement,
    }


def check_clusterable(aux_y: torch.Tensor, targets: int, classes: int) -> None:
    """InputError unless every class has aux samples to name a cluster after and there are at
    least as many targets as clusters."""
    missing = sorted(set(range(classes)) - set(aux_y.tolist()))
    if missing:
        raise InputError(
            f"sdar labels = clustered names each cluster after an aux class; the aux data has no "
            f"samples of class(es) {missing}: give aux data with every class, or use labels = inferred"
        )
    if targets < classes:
        raise InputError(
            f"sdar labels = clustered needs at least one target sample per class to form {classes} "
            f"clusters; got {targets} target samples"
        )


def centroid_distances(points: torch.Tensor, groups: torch.Tensor, count: int) -> np.ndarray:
    """Euclidean distances between the groups' centroids, divided by their mean (the two spaces
    have different scales; only the layout is compared)."""
    centroids = torch.stack([points[groups == k].mean(0) for k in range(count)])
    distances = torch.cdist(centroids, centroids).numpy()
    return distances / distances.mean()


def best_renaming(cluster_layout: np.ndarray, class_layout: np.ndarray, seed: int) -> np.ndarray:
    """names[i] = the class of cluster i, maximising sum_ij cluster_layout[i, j] class_layout[names[i],
    names[j]] (equivalently the least squared difference between the layouts, whose norms a
    renaming does not change)."""
    count = len(cluster_layout)
    score = lambda names: float((cluster_layout * class_layout[np.ix_(names, names)]).sum())
    if count <= EXACT_CLASSES:
        return np.array(max(itertools.permutations(range(count)), key=lambda p: score(np.array(p))))
    rng = np.random.default_rng(seed)
    best, best_score = None, -np.inf
    for _ in range(SWAP_RESTARTS):
        names = pairwise_swaps(rng.permutation(count), score)
        if score(names) > best_score:
            best, best_score = names, score(names)
    return best


def pairwise_swaps(names: np.ndarray, score) -> np.ndarray:
    """Swap two names while a swap raises the score (a local optimum of the renaming)."""
    names, current, improved = names.copy(), score(names), True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(len(names)), 2):
            names[[i, j]] = names[[j, i]]
            swapped = score(names)
            if swapped > current + 1e-12:
                current, improved = swapped, True
            else:
                names[[i, j]] = names[[j, i]]
    return names
