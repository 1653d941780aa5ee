"""What `splitaudit demo` audits: the bundled samples (sample_models/), nothing downloaded.

The digits CNN by default. With --text, the path users take with a language model: a local
Hugging Face checkpoint folder (text_gpt2/, a 3-block GPT-2) cut after block 2 and raw text
(text.jsonl, labels and the sensitive attribute in its fields). That path needs the hf extra; a base
install falls back, with one line saying how to enable it, to the same messages as token ids
through the bundled ONNX bottom, which audits the same attacks: the demo is the first command a new
user runs, and a demo that fails for want of an optional extra demonstrates nothing.
"""

from __future__ import annotations

import importlib.util
from importlib.resources import files

HF_MODULES = ("transformers", "safetensors", "tokenizers")  # the hf extra's packages
HF_MISSING = (
    'the text demo audits a Hugging Face checkpoint folder with the hf extra (pip install "splitaudit[hf]"), '
    "not installed here: auditing the same messages as token ids through the bundled ONNX bottom instead"
)
DIGITS = {"model": "digits_cnn.onnx", "aux": "digits.npz", "top_model": "digits_cnn_top.pt"}
TEXT_CHECKPOINT = {"model": "text_gpt2", "aux": "text.jsonl"}
TEXT_CHECKPOINT_SETTINGS = {"split_layer": 2, "label_column": "intent", "attr_column": "region"}
TEXT_ONNX = {"model": "text_bottom.onnx", "aux": "text.npz", "vocab": "text_vocab.json"}


def hf_installed() -> bool:
    """Whether the hf extra's packages can be imported (found, not imported: that takes seconds)."""
    return all(importlib.util.find_spec(name) is not None for name in HF_MODULES)


def demo_inputs(text: bool) -> tuple[dict, str | None]:
    """The demo's AuditOptions fields (the sample's paths and settings), and the line to print when
    the text demo falls back to its ONNX sample (None otherwise)."""
    samples = files("splitaudit.sample_models")
    if not text:
        return _paths(samples, DIGITS), None
    if hf_installed():
        return {**_paths(samples, TEXT_CHECKPOINT), **TEXT_CHECKPOINT_SETTINGS}, None
    return _paths(samples, TEXT_ONNX), HF_MISSING


def _paths(samples, names: dict) -> dict:
    return {key: str(samples / name) for key, name in names.items()}
