"""SHA-256 digests of the files an audit reads, so that a report names exactly what it audited.

Every input is hashed through one chunked reader (file_sha256: a model may be many GiB): a file by
its bytes, a folder (an image folder, or a folder holding one .npz/.csv) by a digest over the sorted
list of (relative name, file digest) of every regular file under it, written as `sha256sum` writes
it, so that a reviewer can reproduce it with the shell commands docs/usage.md gives. A Hugging Face
checkpoint folder given as the model is digested the same way over its checkpoint files only
(splitaudit.inputs.checkpoint_folder: config, safetensors, tokenizer), the files the audit reads.

Race between hashing and loading: the loaders (onnx, torch, numpy, PIL) open the files themselves,
so their bytes cannot be the bytes hashed without reading every model twice into memory. Instead,
each file's identity (size, modification time in ns, inode, device) is taken before the loaders
open it (`InputFiles.before_loading`) and checked again when the audit ends (`confirm_unchanged`):
a file written or replaced anywhere between loading, hashing and the end of the audit refuses the
run (InputError, no report), so the digests recorded are those of the bytes that were audited.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.model_format import loader_for

CHUNK_BYTES = 4 * 1024**2  # read this much at a time: memory stays flat whatever the file's size
# The inputs an audit reads, in the order a report lists them and verification checks them.
ROLES = ("model", "model-external-data", "top-model", "aux", "target", "vocab", "config")
OPTION_OF_ROLE = {"model": "model", "top-model": "top_model", "aux": "aux", "target": "target", "vocab": "vocab"}


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in CHUNK_BYTES pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def folder_files(folder: Path) -> list[tuple[str, Path]]:
    """(relative POSIX name, path) of every regular file under folder, sorted by the name's bytes
    (as `LC_ALL=C sort` sorts); symlinked folders are not followed, as the loaders do not follow them."""
    found = [(p.relative_to(folder).as_posix(), p) for p in folder.rglob("*") if p.is_file()]
    return sorted(found, key=lambda item: os.fsencode(item[0]))


def input_files(folder: Path, role: str | None) -> list[tuple[str, Path]]:
    """The files a folder input is: a model's Hugging Face checkpoint folder is its checkpoint files
    (config, safetensors, tokenizer: what the loader reads and workers copy), any other folder every
    regular file under it."""
    members = loader_for(folder).member_files(folder) if role == "model" else None
    return folder_files(folder) if members is None else members


def folder_sha256(folder: str | Path, role: str | None = None) -> tuple[str, int, int]:
    """A folder's digest: SHA-256 over one `sha256sum` line ("HEX  NAME\\n") per file of input_files,
    and the number of files and their total bytes."""
    digest, count, size = hashlib.sha256(), 0, 0
    for name, path in input_files(Path(folder), role):
        digest.update(f"{file_sha256(path)}  ".encode() + os.fsencode(name) + b"\n")
        count, size = count + 1, size + path.stat().st_size
    return digest.hexdigest(), count, size


def identity(path: Path, role: str | None = None) -> tuple:
    """What changes when a file (or any file of a folder input) is written, replaced or removed."""
    if path.is_dir():
        return tuple((name, identity(p)) for name, p in input_files(path, role))
    try:
        st = path.stat()
    except OSError:
        return ("missing",)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def digest_record(role: str, path: Path, location: str | None = None) -> dict:
    """One input's entry of provenance.files: its role, path as given, kind, bytes and SHA-256."""
    if path.is_dir():
        sha, count, size = folder_sha256(path, role)
        record = {"role": role, "path": display_path(path), "kind": "folder", "sha256": sha, "bytes": size}
        record["files"] = count
    else:
        record = {"role": role, "path": display_path(path), "kind": "file", "sha256": file_sha256(path)}
        record["bytes"] = path.stat().st_size
    if location is not None:
        record["location"] = location
    return record


@dataclass
class InputFiles:
    """The files of one audit: taken before the loaders open them, hashed after they did."""

    paths: dict[str, Path]  # by role: the files named by the options (and the config file)
    identities: dict[str, tuple] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)

    @classmethod
    def before_loading(cls, options, config_file: str | None = None) -> "InputFiles":
        """The options' input files (paths only: a model or data given in memory has no file), with
        their identities as they are before anything reads them."""
        paths = {
            role: Path(value)
            for role, name in OPTION_OF_ROLE.items()
            if isinstance(value := getattr(options, name), (str, os.PathLike)) and str(value)
        }
        if config_file:
            paths["config"] = Path(config_file)
        return cls(paths, {role: identity(path, role) for role, path in paths.items()})

    def hash_all(self) -> list[dict]:
        """Every input's digest record in ROLES order, an ONNX model's external data files after it
        (found once the model has loaded, so the graph is known to be valid)."""
        records, paths = [], dict(self.paths)
        try:
            for role in ROLES:
                if role == "model-external-data" and "model" in paths:
                    for location in loader_for(paths["model"]).external_files(paths["model"]):
                        path = paths["model"].parent / location
                        self.identities[f"{role}:{location}"] = identity(path)
                        records.append(digest_record(role, path, location))
                elif role in paths:
                    records.append(digest_record(role, paths[role]))
        except OSError as exc:  # removed or made unreadable since the loaders read it
            raise InputError(
                f"{display_path(exc.filename or '')} could not be read again to record its digest ({exc.strerror}): "
                "rerun on files nobody is changing"
            ) from exc
        self.records = records
        return records

    def confirm_unchanged(self) -> None:
        """InputError when a file changed between the moment before loading and now: the report
        would otherwise record digests of bytes that were not the ones audited."""
        for key, before in self.identities.items():
            role, _, location = key.partition(":")
            path = self.paths["model"].parent / location if location else self.paths[role]
            if identity(path, role) != before:
                raise InputError(
                    f"{display_path(path)} ({role}) changed while it was being audited; its digest would not "
                    "describe what was measured: rerun on files nobody is writing"
                )
