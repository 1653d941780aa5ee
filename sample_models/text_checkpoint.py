"""The bundled text sample as users have one: a local Hugging Face checkpoint folder and raw text.

`splitaudit demo --text` audits `text_gpt2/` (a 3-block GPT-2 as `save_pretrained` writes it:
config.json, model.safetensors, tokenizer.json and tokenizer_config.json) cut after block 2
(`--split-layer 2`: the client keeps the embedding and the first two blocks, the server the third,
the final norm and the head) on `text.jsonl`, one message a line with its intent (`intent`, the
task label) and its city's region (`region`, the sensitive attribute). The messages are the ONNX
sample's (text_sample.py: the same seed, the same 600 sentences), written as words; the tokenizer is
word-level over the same vocabulary, so token ids are the ONNX sample's ids. The model is GPT-2's
layout (pre-norm blocks, learned positions, causal attention: the sequential inversion applies) with
a mean-pooled linear top trained on the intent, as the ONNX bottom was. Run: `python
sample_models/text_checkpoint.py` (or `python sample_models/build.py --text`); it needs the hf extra.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from text_sample import LENGTH, SEED, corpus, train, vocabulary  # noqa: E402  (a sibling script)

FOLDER = "text_gpt2"
CORPUS = "text.jsonl"
INTENTS = ["send", "owes", "book", "ask"]  # the names of text_sample.TEMPLATES, in order
BLOCKS = 3
SPLIT_LAYER = 2  # the demo's --split-layer
DIM = 32
UNKNOWN, PAD = "<unk>", "<pad>"  # appended to the vocabulary, so the sample's ids are unchanged


class PooledGPT2(torch.nn.Module):
    """GPT-2's hidden states after every block and the final norm: what text_sample.train pools."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).last_hidden_state


def write_corpus(path: Path, ids: np.ndarray, intents: np.ndarray, northern: np.ndarray) -> None:
    """One JSON object a line: the message's words, its intent's name and its city's region."""
    words = vocabulary()
    lines = [
        json.dumps({"text": " ".join(words[i] for i in row), "intent": INTENTS[y], "region": "north" if a else "south"})
        for row, y, a in zip(ids, intents, northern)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def word_tokenizer(transformers):
    """A whitespace word-level fast tokenizer over the sample's vocabulary (ids as in text.npz)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [*vocabulary(), UNKNOWN, PAD]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=UNKNOWN, pad_token=PAD)


def build_text_checkpoint(here: Path) -> dict:
    """Write text.jsonl and the text_gpt2/ checkpoint folder (weights trained with seed SEED)."""
    from splitaudit.inputs.optional_imports import import_transformers

    transformers = import_transformers()
    torch.manual_seed(SEED)
    ids, intents, northern = corpus(np.random.default_rng(SEED))
    tokenizer = word_tokenizer(transformers)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=2 * LENGTH,
        n_embd=DIM,
        n_layer=BLOCKS,
        n_head=2,
        n_inner=2 * DIM,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's 50256 names no token of this vocabulary; the texts carry none
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = transformers.GPT2Model(config)
    accuracy = train(PooledGPT2(model), torch.from_numpy(ids), torch.from_numpy(intents))
    folder = here / FOLDER
    model.eval().save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    write_corpus(here / CORPUS, ids, intents, northern)
    print(f"text_gpt2: training accuracy {accuracy:.4f}")
    return {
        "train_accuracy": round(accuracy, 4),
        "blocks": BLOCKS,
        "split_layer": SPLIT_LAYER,
        "vocab_size": len(tokenizer),
        "n": len(ids),
    }


if __name__ == "__main__":
    build_text_checkpoint(Path(__file__).resolve().parent)
