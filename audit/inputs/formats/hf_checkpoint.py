"""Hugging Face checkpoint folders (config.json, safetensors, tokenizer files), cut after block
--split-layer (audit/inputs/hf_checkpoints.py); only the checkpoint's own files are read, copied to
workers and digested (audit/inputs/checkpoint_folder.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from splitaudit.inputs.checkpoint_folder import checkpoint_files, is_checkpoint_folder
from splitaudit.inputs.hf_checkpoints import open_checkpoint
from splitaudit.inputs.model_format import ModelLoader, ModelRequest
from splitaudit.inputs.raw_model import RawModel


class CheckpointFolder(ModelLoader):
    def detect(self, path: Path) -> bool:
        return is_checkpoint_folder(path)

    def open(self, path: Path, device: torch.device, request: ModelRequest) -> RawModel:
        """The checkpoint cut after block --split-layer: a token model whose vocabulary is its own
        tokenizer's (or --vocab's)."""
        return self.open_file(path, device, request)

    def open_file(self, path: Path, device: torch.device, request: ModelRequest) -> RawModel:
        return open_checkpoint(path, device, request.split_layer, request.vocab)

    def files(self, path: Path) -> dict[str, bytes]:
        return {f"{path.name}/{name}": file.read_bytes() for name, file in checkpoint_files(path)}

    def member_files(self, path: Path) -> list[tuple[str, Path]]:
        return checkpoint_files(path)
