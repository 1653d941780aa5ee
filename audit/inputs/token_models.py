"""Token models cut at their embedding lookup: the audited function maps the input embeddings
E (T x D) to the hidden states. The lookup is located in the graph (TorchScript: the
`aten::embedding` on the ids input; ONNX: the Gather of a weight table by the ids input, possibly
after a Cast; each format's loader in audit/inputs/formats/) and the model is cut there; a model that
also takes an attention mask runs with the mask bound for a call in its `MaskSlot`
(audit/inputs/tokens.py). `open_audited_model` and `load_audited_data` are where the audit chooses
between a token model and any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.data import Dataset, load_dataset
from splitaudit.inputs.model_format import SPLIT_LAYER_ONLY, ModelRequest, loader_for
from splitaudit.inputs.models import open_model
from splitaudit.inputs.raw_model import RawModel, audit_layout
from splitaudit.inputs.text_data import is_text_file, load_text_data, text_note
from splitaudit.inputs.tokens import ALL_ONES_NOTE, MASK_NOTE, load_token_data


@dataclass(frozen=True)
class ModelSource:
    """The audited model as the user gave it: the model (a file, a checkpoint folder or a torch module),
    what was asked of it, and --input-shape. A worker process receives this, with the model's files,
    to open its copy as the parent opened the original."""

    model: object
    request: ModelRequest = ModelRequest()
    input_shape: tuple[int, ...] | None = None

    @classmethod
    def of(cls, options: AuditOptions) -> "ModelSource":
        request = ModelRequest(options.output_name, options.model_mode, options.vocab, options.split_layer)
        return cls(options.model, request, tuple(options.input_shape) if options.input_shape else None)


def open_audited_model(source: ModelSource, device: torch.device) -> RawModel:
    """The model as the audit sees it (in --model-mode, on inputs of --input-shape or its declared
    shape, channels first: audit_layout): a Hugging Face checkpoint folder cut after block
    --split-layer; cut after its token-embedding lookup when --vocab declares token inputs; as it is
    otherwise. Its format's loader (loader_for) opens it."""
    model, request = source.model, source.request
    if isinstance(model, nn.Module):
        if request.split_layer is not None:
            raise InputError(SPLIT_LAYER_ONLY)
        if request.vocab is not None:
            raise InputError("--vocab (token inputs) needs a model file (TorchScript or ONNX), not a torch module")
        return audit_layout(open_model(model, device, request.output_name, request.mode), source.input_shape)
    raw = loader_for(model).open(Path(model), device, request)
    return raw if raw.tokens is not None else audit_layout(raw, source.input_shape)


def load_audited_data(
    path, input_shape, raw: RawModel, label_column=None, attr_column=None, vocab=None, max_length: int = 128
) -> Dataset:
    """The data in the audited model's input space: token ids as their embeddings for a token model,
    raw text (.txt/.jsonl) tokenised first (to input_shape's length when given: the aux data's, for a target)."""
    if is_text_file(path) or raw.tokens is not None:
        text = is_text_file(path)  # unpadded text needs no all-ones note: its own note says nothing was padded
        data = (
            _text_data(path, input_shape, raw, label_column, attr_column, vocab, max_length)
            if text
            else load_token_data(path, raw.tokens)
        )
        unmasked = ALL_ONES_NOTE if raw.tokens.masked is not None and not text else None
        note = MASK_NOTE if data.mask is not None else unmasked
        if note is not None and note not in raw.notes:
            raw.notes.append(note)
        return data
    if isinstance(path, Dataset) and path.mask is not None:
        raise InputError(
            f"{path.source}: 'mask' is an attention mask over token ids; pass vocab= with token ids in 'x'"
        )
    data = load_dataset(path, input_shape, label_column=label_column, attr_column=attr_column)
    raw.notes.extend(note for note in data.notes if note not in raw.notes)
    return data


def _text_data(path, input_shape, raw: RawModel, label_column, attr_column, vocab, max_length: int) -> Dataset:
    """A .txt/.jsonl file tokenised for a token model (InputError for any other model), its note in raw.notes."""
    if raw.tokens is None:
        raise InputError(
            f"{display_path(path)} is raw text, and this model does not take tokens: give a Hugging Face checkpoint "
            "folder with --split-layer, or a token model with --vocab tokenizer.json"
        )
    length = input_shape[0] if input_shape else None
    data = load_text_data(path, raw.tokens, vocab, max_length, length, label_column, attr_column)
    raw.notes.append(text_note(data.text, "target" if length else "auxiliary", data.source))
    return data
