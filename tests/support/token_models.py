"""Small transformer bottoms over token ids, as users export them (TorchScript trace, ONNX legacy
and dynamo), and token data for them. Shared by the token tests."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from tests.support.architectures import export_onnx

VOCAB, DIM, LENGTH = 40, 8, 6


class TokenBottom(nn.Module):
    """nn.Embedding + learned positions + 2 nn.TransformerEncoderLayers (GELU), the split-LLM client side."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, length: int = LENGTH, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.1 * torch.randn(length, dim))
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def from_embeddings(self, e: torch.Tensor) -> torch.Tensor:
        return self.blocks(e + self.pos)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.from_embeddings(self.tok(ids))


def save_token_model(model: nn.Module, fmt: str, folder: Path, length: int = LENGTH) -> Path:
    """model saved as "torchscript" (torch.jit.trace), "legacy" or "dynamo" ONNX over int64 ids."""
    ids = torch.randint(0, model.tok.num_embeddings, (3, length))
    model = model.eval()
    if fmt == "torchscript":
        path = folder / "bottom.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.jit.trace(model, ids, check_trace=False).save(str(path))
        return path
    return export_onnx(model, ids, folder / f"bottom_{fmt}.onnx", exporter=fmt)


def save_token_data(folder: Path, n: int = 120, vocab: int = VOCAB, length: int = LENGTH, seed: int = 0) -> tuple:
    """(npz path, vocab.json path): ids [n, length] with a label and an attribute read off the tokens."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (n, length))
    np.savez(folder / "tokens.npz", x=x, y=x[:, 0] % 2, attr=(x[:, 1] >= vocab // 2).astype(int))
    (folder / "vocab.json").write_text(json.dumps([f"w{i}" for i in range(vocab)]))
    return str(folder / "tokens.npz"), str(folder / "vocab.json")
