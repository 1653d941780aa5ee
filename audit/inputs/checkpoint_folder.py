"""What a Hugging Face checkpoint folder is to splitaudit: its config.json, its safetensors weights
(and their shard index) and its tokenizer files, nothing else. Those files, and only those, are
what the loader may read, what a worker's copy of the folder holds (--workers N, Ray) and what the
report's digest of the folder covers; a training folder's optimizer states, logs or pickled twins
beside them are neither copied nor hashed.

A listed file reached through a symlink that leads out of the folder is refused, as image folders
refuse theirs: the folder must not make the audit read, and record, files it does not hold. One
layout is read as it is: a Hugging Face cache snapshot (`models--NAME/snapshots/REVISION/`, what
`from_pretrained` downloads), whose files link into the same repository's `blobs/` folder.
No torch here: provenance lists these files without loading anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path, require_regular_file

CONFIG = "config.json"
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
    }
)
WEIGHT_INDEX = "model.safetensors.index.json"  # save_pretrained's map of a sharded checkpoint


def is_checkpoint_folder(path) -> bool:
    """Whether `path` is a folder with a config.json (what save_pretrained writes)."""
    return isinstance(path, (str, Path)) and Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def is_checkpoint_file(name: str) -> bool:
    """Whether a file of that name belongs to the checkpoint as splitaudit reads it."""
    return name in (CONFIG, WEIGHT_INDEX) or name in TOKENIZER_FILES or name.endswith(".safetensors")


def checkpoint_files(folder) -> list[tuple[str, Path]]:
    """(name, path) of the folder's checkpoint files, sorted by the name's bytes as folder digests
    sort theirs; InputError for one that leads out of the folder or is not a regular file."""
    folder = Path(folder)
    roots = allowed_roots(folder)
    found = []
    for path in folder.iterdir():
        if not is_checkpoint_file(path.name):
            continue
        target = path.resolve()
        if not any(target.is_relative_to(root) for root in roots):
            raise InputError(
                f"{display_path(path)} leads out of the checkpoint folder {display_path(folder)} (a symlink to "
                f"{display_path(target)}); splitaudit reads only files inside it: copy them in (cp -rL)"
            )
        found.append((path.name, require_regular_file(path, "checkpoint file")))
    return sorted(found, key=lambda item: os.fsencode(item[0]))


def allowed_roots(folder: Path) -> list[Path]:
    """Where the folder's files may lead: inside it, and for a Hugging Face cache snapshot
    (models--NAME/snapshots/REVISION) also its repository's blobs/ folder."""
    root = folder.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return [root, root.parent.parent / "blobs"]
    return [root]
