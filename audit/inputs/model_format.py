"""The shape every model format takes: a ModelLoader subclass (audit/inputs/formats/, one module each)
and its line in core/registries.py MODEL_FORMATS. The audit asks `loader_for(path)` and never names
a format: opening a model as the user asked (`ModelRequest`), cutting a token model after its
embedding lookup, copying its files to a worker, listing the files its digest covers and writing a
whole model as the ONNX graph `splitaudit cuts` cuts all go through the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from splitaudit.core.errors import InputError
from splitaudit.core.registries import MODEL_FORMATS, ModelFormat, resolve
from splitaudit.core.safety import display_path, require_regular_file
from splitaudit.inputs.raw_model import RawModel
from splitaudit.inputs.tokens import MaskSlot, TokenSpace, load_vocab

SPLIT_LAYER_ONLY = "--split-layer cuts a Hugging Face checkpoint folder (config.json + *.safetensors)"


@dataclass(frozen=True)
class ModelRequest:
    """What the user asked of the model file: the output audited (--output-name), the mode it runs in
    (--model-mode), token inputs (--vocab), the block a checkpoint is cut after (--split-layer), and
    whether it may take a second input, an attention mask (a token model's)."""

    output_name: str | None = None
    mode: str = "saved"
    vocab: object = None
    split_layer: int | None = None
    mask_input: bool = False


@dataclass(frozen=True)
class WholeGraph:
    """A whole model as the ONNX graph `splitaudit cuts` cuts: the graph's file, and where the graph
    was written from another form (a torch.export program), `check(x, the graph's output on x)`,
    which raises InputError where the graph does not compute what the file does (None: the file is
    the graph)."""

    path: Path
    check: Callable[[np.ndarray, np.ndarray], object] | None = None


class ModelLoader:
    """One model format. Subclasses say how a file is recognised (`detect`) and opened (`open_file`);
    the others have defaults a format overrides where it can do more: a token model cut after its
    embedding lookup (`from_embeddings`), its files as a worker receives them (`files`), the files
    loading it reads besides it (`external_files`), the files a folder format consists of
    (`member_files`), the whole model as an ONNX graph to cut (`whole_graph`)."""

    format: ModelFormat  # its registry entry, set by loader_for

    def detect(self, path: Path) -> bool:
        """Whether `path` is a model of this format (read no more of it than that takes)."""
        raise NotImplementedError

    def open_file(self, path: Path, device: torch.device, request: ModelRequest) -> RawModel:
        """The model at `path` as saved, checked before anything runs it; InputError with one line when it cannot be used."""
        raise NotImplementedError

    def open(self, path: Path, device: torch.device, request: ModelRequest) -> RawModel:
        """The model as the request asks: whole, or cut after its token lookup when it names a vocabulary."""
        if request.split_layer is not None:
            raise InputError(SPLIT_LAYER_ONLY)
        path = require_regular_file(path, "model file")
        if request.vocab is None:
            return self.open_file(path, device, request)
        raw, table, slot = self.from_embeddings(path, device, request)
        vocab = load_vocab(request.vocab, len(table))
        return replace(raw, tokens=TokenSpace(table.float().to(device), vocab, slot))

    def from_embeddings(
        self, path: Path, device: torch.device, request: ModelRequest
    ) -> tuple[RawModel, torch.Tensor, MaskSlot | None]:
        """The model cut after its token-embedding lookup (on embeddings [T, D]), its embedding table, and
        the slot its attention mask is bound in (None without one)."""
        raise InputError(
            f"--vocab (token inputs) needs a TorchScript or ONNX model; {self.format.description} is not cut yet"
        )

    def files(self, path: Path) -> dict[str, bytes]:
        """The model's bytes by file name, as a worker process receives them."""
        return {path.name: path.read_bytes()}

    def external_files(self, path: Path) -> list[str]:
        """Files besides the model that loading it reads (names relative to its folder): what the
        report's provenance digests beside it."""
        return []

    def member_files(self, path: Path) -> list[tuple[str, Path]] | None:
        """The files a folder model consists of, (relative name, path); None for a single file."""
        return None

    def whole_graph(self, path: Path, folder: Path) -> WholeGraph:
        """The whole model as an ONNX graph, written in `folder` where the format is not ONNX itself,
        with the check that it computes what the file does: what `splitaudit cuts` cuts."""
        raise InputError(
            f"{display_path(path)}: splitaudit cuts takes a whole model as ONNX (.onnx) or a torch.export program "
            f"(.pt2): its graph is what is cut, and this is {self.format.description}, which keeps none to cut "
            "(export a torch model with torch.onnx.export)"
        )


def loader_for(path) -> ModelLoader:
    """The loader of the first registered format that recognises `path`, else the fallback format's."""
    path = Path(path)
    for fmt in MODEL_FORMATS.values():
        loader = _loader(fmt)
        if loader.detect(path):
            return loader
    return _loader(next(fmt for fmt in MODEL_FORMATS.values() if fmt.fallback))


def _loader(fmt: ModelFormat) -> ModelLoader:
    loader = resolve(fmt.loader)()
    loader.format = fmt
    return loader
