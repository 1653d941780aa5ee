"""Naming k-means clusters by the class layout (attacks/parts/cluster_naming.py): a planted renaming is
found exactly, a smooth embedding of well-separated classes is named right, and a class missing
from the aux data is a clear input error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitaudit.attacks.parts.cluster_naming import best_renaming, centroid_distances, geometry_named_labels
from splitaudit.attacks.sdar import relabelled_accuracy
from splitaudit.core.errors import InputError


def layout(classes: int, seed: int) -> np.ndarray:
    points = torch.from_numpy(np.random.default_rng(seed).normal(size=(classes, 3)))
    return centroid_distances(points, torch.arange(classes), classes)


@pytest.mark.parametrize("classes", [6, 10])  # 6: every renaming scored; 10: restarted pairwise swaps
def test_a_planted_renaming_of_the_class_layout_is_recovered_exactly(classes):
    """Clusters laid out as the classes but numbered by a permutation: names[i] must be the class
    cluster i stands for, for every cluster (the layout of random 3-d points has no symmetry)."""
    class_layout = layout(classes, seed=classes)
    truth = np.random.default_rng(1).permutation(classes)  # cluster i is class truth[i]
    cluster_layout = class_layout[np.ix_(truth, truth)]
    assert np.array_equal(best_renaming(cluster_layout, class_layout, seed=0), truth)
    assert np.array_equal(best_renaming(cluster_layout, class_layout, seed=3), truth)  # any start


def synthetic(n_per_class: int, seed: int, centres: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(len(centres)).repeat_interleave(n_per_class)
    return centres[y] + 0.05 * torch.randn(len(y), centres.shape[1], generator=gen, dtype=torch.float64), y


def test_clusters_of_a_smooth_embedding_are_named_after_their_classes():
    """8 classes of 2-d inputs; the 'client' embeds them by a fixed smooth map into 16-d (tanh of a
    random linear map); k-means finds the clusters (two close centres share a few points) and the
    layout names each one: the label accuracy is the partition's own under the best renaming
    (a wrong name for even two clusters would cost 0.25); the same labels twice."""
    centres = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, size=(8, 2)))
    aux_x, aux_y = synthetic(40, 1, centres)
    target_x, target_y = synthetic(40, 2, centres)
    weights = torch.from_numpy(np.random.default_rng(3).normal(size=(2, 16))) * 0.5
    embeddings = torch.tanh(target_x @ weights).float()
    labels, details = geometry_named_labels(embeddings, aux_x, aux_y, 8, seed=0)
    partition = relabelled_accuracy(labels, target_y)
    assert partition > 0.9 and float((labels == target_y).double().mean()) == pytest.approx(partition, abs=1e-12)
    assert details["layout_agreement"] > 0.9
    again, _ = geometry_named_labels(embeddings, aux_x, aux_y, 8, seed=0)
    assert torch.equal(labels, again)


def test_a_class_missing_from_the_aux_data_is_an_input_error():
    aux_x, aux_y = torch.randn(30, 2), torch.arange(3).repeat(10)
    with pytest.raises(InputError, match=r"no samples of class\(es\) \[3\]"):
        geometry_named_labels(torch.randn(20, 4), aux_x, aux_y, 4, seed=0)
    with pytest.raises(InputError, match="at least one target sample per class"):
        geometry_named_labels(torch.randn(2, 4), aux_x, aux_y, 3, seed=0)
