"""Flat features for the scikit-learn attacks (k-means, attribute probes), bounded in size.

At 3x224x224 a raw input has 150,528 dimensions (and an early split's embedding as many):
k-means with 10 restarts and the probes' standardised copies would then hold several float64
copies of the data and run for a long time. Above MAX_DIMENSIONS, features are projected on
their leading principal components (randomised PCA, fitted on the attacker's own data). The
projection keeps the directions of largest variance, which is where k-means' cluster structure
lies (Ding & He, ICML 2004: PCA is the continuous relaxation of k-means), so the reduced
baseline is the honest one an attacker would run; the attack details say when it was applied.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.decomposition import PCA

MAX_DIMENSIONS = 4096  # features above this are reduced
COMPONENTS = 256  # principal components kept (at most samples - 1)


def flat(x: torch.Tensor) -> np.ndarray:
    """Samples as rows of a float32 matrix (float32 halves the memory of float64 at 224 px)."""
    return x.detach().flatten(1).cpu().numpy().astype(np.float32, copy=False)


def reduced(fit_on: torch.Tensor, *others: torch.Tensor, seed: int = 0) -> tuple[list[np.ndarray], dict]:
    """[fit_on, *others] as flat features, projected on fit_on's leading principal components
    when they have more than MAX_DIMENSIONS dimensions; and a description for the details."""
    arrays = [flat(fit_on), *(flat(x) for x in others)]
    dims = arrays[0].shape[1]
    if dims <= MAX_DIMENSIONS:
        return arrays, {"dimensions": dims, "reduction": "none"}
    components = min(COMPONENTS, len(arrays[0]) - 1)
    pca = PCA(n_components=components, svd_solver="randomized", random_state=seed).fit(arrays[0])
    explained = float(pca.explained_variance_ratio_.sum())
    return [pca.transform(a) for a in arrays], {
        "dimensions": dims,
        "reduction": f"PCA to {components} components",
        "explained_variance": explained,
    }
