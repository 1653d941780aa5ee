"""Train and export splitaudit's bundled sample bottom models, reproducibly.

Data comes from scikit-learn (shipped inside the package, nothing downloaded):

- ``digits_cnn``: 8x8 digits, a small CNN with smooth operators (GELU, average pooling) and a
  final affine-free LayerNorm, trained with cross-entropy (undefended).
- ``digits_cnn_peloss``: the same architecture trained with cross-entropy plus the potential
  energy loss of Zheng et al. (IJCAI 2024, eq. 7): a repulsion ``1/arccos`` between same-class
  embeddings on the layer-normalised sphere (a defended model).
- ``digits_cnn_r3elu``: the same architecture with R3eLU (Mao et al., 2023, eq. 3) on its
  layer-normalised embedding: each unit is kept with probability R3ELU_KEEP as max(0, v + Laplace
  noise of scale R3ELU_SCALE), else sent as 0 (a randomised, stochastic defence, on at inference).
  Shipped as TorchScript only: an ONNX export carries RandomUniformLike nodes, which splitaudit
  refuses (onnxruntime draws them unseeded and the converters do not keep them).
- ``digits_mlp``: 8x8 digits flattened, a GELU MLP.
- ``breast_cancer_mlp``: breast_cancer features min-max scaled to [0, 1]; the feature
  ``mean radius`` is withheld from the model's input and, binarised at its median, is the
  sensitive attribute.

Each model is exported as TorchScript (``.pt``) and, when deterministic, ONNX (``.onnx``, opset 20, dynamic batch),
with its top model (``*_top.pt``) for the attacks that use one. The data ships as ``.npz``
(``x`` in [0, 1], ``y``, ``attr``). Run: ``python sample_models/build.py``.

The text samples (``python sample_models/build.py --text`` rebuilds them alone), for ``splitaudit
demo --text``: ``text_bottom``, a small transformer bottom over token ids and its generated corpus
(text_sample.py), and ``text_gpt2``, a GPT-2 checkpoint folder with the same corpus as raw text
(text_checkpoint.py; it needs the hf extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer, load_digits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from text_checkpoint import build_text_checkpoint  # noqa: E402  (sibling scripts, not package modules)
from text_sample import build_text_sample  # noqa: E402

HERE = Path(__file__).resolve().parent
SEED = 0
TRAIN_FRACTION = 0.7
PE_ALPHA = 1.0
R3ELU_KEEP = 0.8  # R3eLU's probability p of sending a unit (Mao et al., 2023, eq. 3), fixed, not input-dependent
R3ELU_SCALE = 0.5  # scale of R3eLU's Laplace noise, on layer-normalised (unit-variance) pre-activations
WITHHELD_FEATURE = "mean radius"


class DigitsCNN(nn.Module):
    """1x8x8 -> 128: conv-GELU-avgpool-conv-GELU, flattened and layer-normalised (no affine)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.conv2 = nn.Conv2d(16, 8, 3, padding=1)
        self.norm = nn.LayerNorm(128, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.gelu(self.conv1(x)))
        h = F.gelu(self.conv2(h))
        return self.norm(h.flatten(1))


class R3eLU(nn.Module):
    """Randomized-response ReLU (Mao et al., 2023, eq. 3): max(0, v + z), z ~ Laplace(0, scale), with
    probability keep, else 0. The probability is fixed (eq. 3), not input-dependent as Algorithm
    1's p_i, so the randomness is independent of the input and dFIL's bound stays valid. A
    defence, so it draws in eval mode too."""

    def __init__(self, keep: float, scale: float) -> None:
        super().__init__()
        self.keep = keep
        self.scale = scale

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        u = torch.rand_like(v) - 0.5
        laplace = -self.scale * torch.sign(u) * torch.log1p(-2 * u.abs())
        kept = (torch.rand_like(v) < self.keep).to(v.dtype)
        return kept * F.relu(v + laplace)


class DigitsCNNR3eLU(nn.Module):
    """DigitsCNN whose layer-normalised embedding goes through R3eLU before it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn = DigitsCNN()
        self.r3elu = R3eLU(R3ELU_KEEP, R3ELU_SCALE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.r3elu(self.cnn(x))


def mlp(sizes: list[int]) -> nn.Sequential:
    """A GELU MLP with the given layer widths (no activation after the last layer)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def potential_energy_loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean of 1/arccos(cos angle) over same-class pairs (Zheng et al., IJCAI 2024, eq. 7)."""
    u = F.normalize(z, dim=1)
    cos = (u @ u.T).clamp(-1 + 1e-6, 1 - 1e-6)
    same = (y[:, None] == y[None, :]) & ~torch.eye(len(y), dtype=torch.bool)
    return (1.0 / torch.arccos(cos[same])).mean()


def train_split(
    bottom: nn.Module, top: nn.Module, x: torch.Tensor, y: torch.Tensor, pe_alpha: float = 0.0, epochs: int = 60
) -> None:
    """Train bottom+top jointly with cross-entropy (+ pe_alpha * PELoss), Adam, batch 64."""
    params = list(bottom.parameters()) + list(top.parameters())
    opt = torch.optim.Adam(params, lr=2e-3)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(64):
            z = bottom(x[idx])
            loss = F.cross_entropy(top(z), y[idx])
            if pe_alpha:
                loss = loss + pe_alpha * potential_energy_loss(z, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def accuracy(bottom: nn.Module, top: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((top(bottom(x)).argmax(1) == y).float().mean())


def export(name: str, bottom: nn.Module, top: nn.Module, example: torch.Tensor, onnx: bool = True) -> None:
    """Write NAME.pt (TorchScript), NAME.onnx (opset 20, dynamic batch; unless onnx is false) and NAME_top.pt."""
    bottom.eval()
    top.eval()
    # A stochastic bottom differs from itself on every call: no trace check against a second run.
    torch.jit.trace(bottom, example, check_trace=onnx).save(str(HERE / f"{name}.pt"))
    with torch.no_grad():
        embedding = bottom(example)
    torch.jit.trace(top, embedding).save(str(HERE / f"{name}_top.pt"))
    if not onnx:
        return
    torch.onnx.export(
        bottom,
        (example,),
        str(HERE / f"{name}.onnx"),
        opset_version=20,
        dynamo=True,
        input_names=["x"],
        output_names=["z"],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        external_data=False,
    )


def split_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(SEED).permutation(n)
    cut = int(TRAIN_FRACTION * n)
    return perm[:cut], perm[cut:]


def digits_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Digits as 1x8x8 in [0, 1]; attribute: the digit is >= 5."""
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target.astype(np.int64)
    return x, y, (y >= 5).astype(np.int64)


def breast_cancer_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """29 min-max scaled features; attribute: withheld 'mean radius' above its median."""
    d = load_breast_cancer()
    col = list(d.feature_names).index(WITHHELD_FEATURE)
    withheld = d.data[:, col]
    feats = np.delete(d.data, col, axis=1)
    span = feats.max(0) - feats.min(0)
    x = ((feats - feats.min(0)) / span).astype(np.float32)
    return x, d.target.astype(np.int64), (withheld > np.median(withheld)).astype(np.int64)


def build(name: str, data, bottom: nn.Module, top: nn.Module, pe_alpha: float = 0.0) -> dict:
    x, y, attr = data
    train, test = split_indices(len(x))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    train_split(bottom, top, xt[train], yt[train], pe_alpha=pe_alpha)
    bottom.eval()
    top.eval()
    acc = accuracy(bottom, top, xt[test], yt[test])  # a stochastic bottom: one draw per test sample
    stochastic = isinstance(bottom, DigitsCNNR3eLU)
    export(name, bottom, top, xt[:2], onnx=not stochastic)
    print(f"{name}: test accuracy {acc:.4f}")
    summary = {
        "test_accuracy": round(acc, 4),
        "input_shape": list(x.shape[1:]),
        "n_train": len(train),
        "n_test": len(test),
        "pe_alpha": pe_alpha,
    }
    if stochastic:
        summary["r3elu"] = {"keep": R3ELU_KEEP, "laplace_scale": R3ELU_SCALE}
    return summary


def main() -> None:
    torch.set_num_threads(2)
    if "--text" in sys.argv[1:]:
        summary = json.loads((HERE / "models.json").read_text())
        build_text_samples(summary)
        (HERE / "models.json").write_text(json.dumps(summary, indent=2) + "\n")
        return
    digits, cancer = digits_data(), breast_cancer_data()
    np.savez_compressed(HERE / "digits.npz", x=digits[0], y=digits[1], attr=digits[2])
    np.savez_compressed(HERE / "breast_cancer.npz", x=cancer[0], y=cancer[1], attr=cancer[2])
    summary = {}
    for name, data, make_bottom, make_top, alpha in [
        ("digits_cnn", digits, DigitsCNN, lambda: mlp([128, 64, 10]), 0.0),
        ("digits_cnn_peloss", digits, DigitsCNN, lambda: mlp([128, 64, 10]), PE_ALPHA),
        ("digits_cnn_r3elu", digits, DigitsCNNR3eLU, lambda: mlp([128, 64, 10]), 0.0),
        ("digits_mlp", digits, lambda: nn.Sequential(nn.Flatten(), mlp([64, 128, 32])), lambda: mlp([32, 10]), 0.0),
        ("breast_cancer_mlp", cancer, lambda: mlp([29, 32, 16]), lambda: mlp([16, 2]), 0.0),
    ]:
        torch.manual_seed(SEED)
        summary[name] = build(name, data, make_bottom(), make_top(), pe_alpha=alpha)
    build_text_samples(summary)
    (HERE / "models.json").write_text(json.dumps(summary, indent=2) + "\n")


def build_text_samples(summary: dict) -> None:
    """The text demo's samples into `summary`: the ONNX bottom over token ids, and the checkpoint
    folder with the same messages as raw text."""
    summary["text_bottom"] = build_text_sample(HERE)
    summary["text_gpt2"] = build_text_checkpoint(HERE)


if __name__ == "__main__":
    main()
