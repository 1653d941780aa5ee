"""The bundled text sample for `splitaudit demo --text`: a small transformer bottom over token ids.

A generated corpus of bank-like messages with private-looking content (names, cities, amounts),
eight tokens each, from four templates (the intent is the label), each message headed by the
city it concerns; the sensitive attribute is whether that city is northern (half of the ten, so
the attribute is balanced). Names are drawn Zipf-like, so the tail names occur in
fewer than 1% of the sentences: the rare, private tokens an inversion attack should not recover.
The bottom (token embedding, learned positions, two pre-norm GELU transformer layers, GPT-2's
layout) is trained with a mean-pooled linear top on the intent.

The attribute probe's baseline is the same probe on the raw token embeddings, which reads the city
token exactly (accuracy 1), so the probe on the hidden states can at best tie it. With the city at
varying positions (2 or 6) and post-norm layers, the hidden states scattered it enough that the
probe reached 0.91 on the 300 aux sentences and the attack was reported as failed; with the city
at a fixed position and pre-norm blocks (whose residual stream keeps each token's embedding) it
reads the city as well as the raw probe does. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 0
SENTENCES = 600
LENGTH = 8
DIM = 32
EPOCHS = 30
NAMES = [
    "alice", "bruno", "chen", "dara", "elif", "farid", "greta", "hugo", "ines", "jonas",
    "kemal", "lena", "marco", "nadia", "oskar", "priya", "quinn", "rosa", "sven", "tariq",
    "ursula", "vikram", "wanda", "xavier", "yara", "zoltan", "amara", "bodhi", "cyra", "dmitri",
]  # fmt: skip
CITIES = ["oslo", "bergen", "tromso", "umea", "oulu", "lisbon", "seville", "naples", "athens", "valletta"]
NORTHERN = set(CITIES[:5])
AMOUNTS = [f"{n}eur" for n in (15, 40, 75, 120, 250, 480, 900, 1500, 3200, 7800)]
TEMPLATES = [  # intent: eight tokens, {c} city (the header), {n} name, {a} amount
    "{c} : send {a} to {n} today .",
    "{c} : {n} owes me {a} now .",
    "{c} : book a table for {n} .",
    "{c} : is {n} still living here ?",
]


def vocabulary() -> list[str]:
    words = sorted({w for t in TEMPLATES for w in t.split() if not w.startswith("{")})
    return words + NAMES + CITIES + AMOUNTS


def corpus(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [N, 8], intent, northern city) for SENTENCES generated messages."""
    index = {w: i for i, w in enumerate(vocabulary())}
    zipf = 1.0 / np.arange(1, len(NAMES) + 1) ** 1.1
    rows, intents, northern = [], [], []
    for _ in range(SENTENCES):
        intent = int(rng.integers(len(TEMPLATES)))
        name = NAMES[rng.choice(len(NAMES), p=zipf / zipf.sum())]
        city, amount = CITIES[rng.integers(len(CITIES))], AMOUNTS[rng.integers(len(AMOUNTS))]
        words = TEMPLATES[intent].format(n=name, c=city, a=amount).split()
        rows.append([index[w] for w in words])
        intents.append(intent)
        northern.append(int(city in NORTHERN))
    return np.array(rows, dtype=np.int64), np.array(intents), np.array(northern)


class TextBottom(nn.Module):
    """ids [N, 8] -> hidden states [N, 8, 32]: embedding + positions + 2 causal pre-norm GELU
    transformer layers (a GPT-style client side: each position attends to itself and earlier ones)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Parameter(0.1 * torch.randn(LENGTH, DIM))
        layer = nn.TransformerEncoderLayer(
            DIM, 2, 2 * DIM, dropout=0.0, batch_first=True, activation="gelu", norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(LENGTH), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.tok(ids) + self.pos, mask=self.causal, is_causal=True)


def train(bottom: nn.Module, ids: torch.Tensor, intents: torch.Tensor) -> float:
    """Adam on the intent through a mean-pooled linear top; returns the final training accuracy."""
    top = nn.Linear(DIM, len(TEMPLATES))
    optimizer = torch.optim.Adam([*bottom.parameters(), *top.parameters()], lr=3e-3)
    for _ in range(EPOCHS):
        for batch in torch.randperm(len(ids)).split(64):
            optimizer.zero_grad()
            F.cross_entropy(top(bottom(ids[batch]).mean(dim=1)), intents[batch]).backward()
            optimizer.step()
    bottom.eval()
    with torch.no_grad():
        return float((top(bottom(ids).mean(dim=1)).argmax(1) == intents).float().mean())


def build_text_sample(here: Path) -> dict:
    """Write text.npz, text_vocab.json and text_bottom.onnx (dynamo, opset 20, dynamic batch)."""
    torch.manual_seed(SEED)
    ids, intents, northern = corpus(np.random.default_rng(SEED))
    vocab = vocabulary()
    bottom = TextBottom(len(vocab))
    accuracy = train(bottom, torch.from_numpy(ids), torch.from_numpy(intents))
    np.savez_compressed(here / "text.npz", x=ids, y=intents, attr=northern)
    (here / "text_vocab.json").write_text(json.dumps(vocab, indent=0) + "\n")
    torch.onnx.export(
        bottom,
        (torch.from_numpy(ids[:2]),),
        str(here / "text_bottom.onnx"),
        opset_version=20,
        dynamo=True,
        input_names=["input_ids"],
        output_names=["hidden"],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        external_data=False,
    )
    print(f"text_bottom: training accuracy {accuracy:.4f}")
    return {"train_accuracy": round(accuracy, 4), "input_shape": [LENGTH], "vocab_size": len(vocab), "n": SENTENCES}
