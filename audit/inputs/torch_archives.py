"""Torch's zip archives (torch.save, torch.jit.save, torch.export.save) opened through allow-lists,
before torch reads them.

torch reads these archives with its own zip reader (PyTorchFileReader), which finds members by name
ignoring letter case, and it unpickles some members: torch.load retries with weights_only=False
inside torch.export.load, and torch.jit.load runs TorchScript code while it unpickles. So splitaudit
reads the archive's bytes once, checks them with that same reader, and hands torch the same bytes.
An archive passes when every member is one torch writes, spelled exactly as torch spells it, no two
names differ only in letter case, Python's zipfile sees the same members as torch's reader, the sizes
fit in memory, and every pickle imports only allow-listed names.
"""

from __future__ import annotations

import io
import pickletools
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch._C import PyTorchFileReader

from splitaudit.core.errors import InputError
from splitaudit.core.safety import describe_bytes, display_path, memory_limit_bytes
from splitaudit.inputs.raw_model import first_line

ZIP_MAGIC = b"PK\x03\x04"  # what torch.load checks before it takes a file for a zip archive
STORAGE_GLOBAL = re.compile(r"torch\.[A-Za-z0-9]+Storage")
# Opcodes that import by other means than GLOBAL; torch's writers (pickle protocol 2) never emit them.
OTHER_IMPORTS = {"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}
# Names torch.save writes for tensors (torch.load rebuilds them with these).
TENSOR_GLOBALS = {
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "collections.OrderedDict",
    "torch.device",
}
# Operators that read or create files: no model of an audit needs them.
FILE_OPERATORS = {"aten::save", "aten::from_file"}


@dataclass(frozen=True)
class Layout:
    """The members an archive of one kind may hold, by the names (relative to the archive's root
    folder) torch writes; `refused` names members with the reason they are refused (matched
    ignoring case), `advice` says how to write an archive splitaudit accepts."""

    what: str
    members: dict[str, str]  # kind -> regular expression of the member names of that kind
    advice: str
    refused: tuple[tuple[str, str], ...] = ()


class Archive:
    """A torch zip archive whose members passed its Layout, read through torch's own reader."""

    def __init__(self, data: bytes, label: str, layout: Layout) -> None:
        self.label = label
        try:
            self._reader = PyTorchFileReader(io.BytesIO(data))
            names = self._reader.get_all_records()
        except Exception as exc:  # torch's reader raises RuntimeError on anything malformed
            raise InputError(f"{label} is not a {layout.what} ({first_line(exc)}); {layout.advice}") from exc
        self.sizes = _zipfile_sizes_of_the_same_members(data, names, label, layout)
        self.kinds = {name: member_kind(name, layout, label) for name in _distinct(names, label)}
        total = sum(self.sizes.values())
        if total > memory_limit_bytes():
            raise InputError(
                f"{label} unpacks to {describe_bytes(total)}, more than the {describe_bytes(memory_limit_bytes())} "
                "a model may take (a quarter of this machine's memory)"
            )

    def named(self, kind: str) -> list[str]:
        return [name for name, found in self.kinds.items() if found == kind]

    def read(self, name: str) -> bytes:
        try:
            return self._reader.get_record(name)
        except Exception as exc:  # a corrupt record (CRC, inflate) raises RuntimeError
            raise InputError(f"{self.label}: {name} cannot be read ({first_line(exc)})") from exc


def read_archive(path: Path) -> bytes:
    """The file's bytes, once: the checks and torch then read the same bytes (nothing can swap the
    file between them), after its size was checked against the memory limit."""
    size = path.stat().st_size
    if size > memory_limit_bytes():
        raise InputError(
            f"{display_path(path)} is {describe_bytes(size)}, more than the {describe_bytes(memory_limit_bytes())} "
            "a model may take (a quarter of this machine's memory)"
        )
    return path.read_bytes()


def member_kind(name: str, layout: Layout, label: str) -> str:
    """The kind of member `name` is in `layout`, or InputError naming why it is refused."""
    for pattern, why in layout.refused:
        if re.fullmatch(pattern, name, re.IGNORECASE):
            raise InputError(f"{label} holds {name}: {why}; {layout.advice}")
    for kind, pattern in layout.members.items():
        if re.fullmatch(pattern, name):
            return kind
    if any(re.fullmatch(pattern, name, re.IGNORECASE) for pattern in layout.members.values()):
        raise InputError(
            f"{label} holds {name}, spelled in other letter case than torch writes it (torch finds members "
            f"ignoring case, so this one would bypass checks); {layout.advice}"
        )
    raise InputError(f"{label} holds {name}, which is not part of a {layout.what}; {layout.advice}")


def _distinct(names: list[str], label: str) -> list[str]:
    """The names, when no two of them differ only in letter case (or not at all): torch's reader
    would pick one of them, and a check could read the other."""
    seen: dict[str, str] = {}
    for name in names:
        folded = name.casefold()
        if folded in seen:
            raise InputError(f"{label} holds both {seen[folded]} and {name}, which torch's reader cannot tell apart")
        seen[folded] = name
    return names


def _zipfile_sizes_of_the_same_members(data: bytes, names: list[str], label: str, layout: Layout) -> dict[str, int]:
    """Each member's unpacked size as the central directory states it (which torch's reader allocates
    by), once Python's zipfile is found to see the same members as torch's reader under one root
    folder: torch.export.load falls back to zipfile for an older format, and a crafted zip could show
    each reader other files. (torch 2.11 and earlier readers do not state sizes.)"""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except Exception as exc:  # BadZipFile, struct.error, ... on a crafted directory
        raise InputError(f"{label} is not a {layout.what} ({first_line(exc)}); {layout.advice}") from exc
    listed = [info.filename for info in infos]
    root = listed[0].split("/", 1)[0] if listed else ""
    if sorted(listed) != sorted(f"{root}/{name}" for name in names) or len(set(listed)) != len(listed):
        raise InputError(f"{label}: Python's zipfile and torch's reader see different members; {layout.advice}")
    return {info.filename.removeprefix(f"{root}/"): info.file_size for info in infos}


def pickle_imports(data: bytes, label: str) -> list[str]:
    """The module.name of every GLOBAL in a pickle, read without unpickling it. A pickle that imports
    any other way (STACK_GLOBAL, INST, OBJ, the extension registry) or cannot be parsed is refused:
    torch writes protocol 2, where GLOBAL is the only import."""
    names = []
    try:
        for opcode, argument, _ in pickletools.genops(data):
            if opcode.name in OTHER_IMPORTS:
                raise InputError(f"{label} imports with {opcode.name}, which torch's writers never use")
            if opcode.name == "GLOBAL":
                module, _, name = str(argument).partition(" ")
                if " " in name or not module or not name:
                    raise InputError(f"{label} imports '{argument}', which is no module and name")
                names.append(f"{module}.{name}")
    except InputError:
        raise
    except Exception as exc:  # pickletools raises ValueError and others on malformed input
        raise InputError(f"{label} is not a readable pickle ({first_line(exc)})") from exc
    return names


def check_pickle(archive: Archive, name: str, allowed: Callable[[str], bool], reader: str) -> None:
    """Refuse the pickle `name` when it imports anything `allowed` does not accept; `reader` names
    who would unpickle it, for the message."""
    label = f"{archive.label}: {name}"
    for imported in pickle_imports(archive.read(name), label):
        if not allowed(imported):
            raise InputError(
                f"{label} refers to {imported}, which {reader} would import or resolve; splitaudit never does "
                "(it accepts only the tensor, storage and container names torch writes)"
            )


TORCH_SAVE = Layout(
    what="torch.save archive",
    members={
        "pickle": r"data\.pkl",
        "storage": r"data/\d+",
        "format": r"version|byteorder|\.format_version|\.storage_alignment|\.data/version|\.data/serialization_id",
    },
    advice="it must hold tensors only, as torch.save writes them",
)


def is_tensor_global(name: str) -> bool:
    return name in TENSOR_GLOBALS or STORAGE_GLOBAL.fullmatch(name) is not None


def check_tensor_pickle(data: bytes, label: str) -> None:
    """Refuse a torch.save archive (nested in a .pt2) that holds anything but tensors, before torch
    loads it with weights_only=False: a zip in torch.save's layout whose pickle imports only the
    names that rebuild tensors, and that torch's safe loader (weights_only=True) reads too."""
    if not data.startswith(ZIP_MAGIC):  # else torch.load would unpickle it as a legacy file
        raise InputError(f"{label} is not a zip archive as torch.save writes; {TORCH_SAVE.advice}")
    archive = Archive(data, label, TORCH_SAVE)
    check_pickle(archive, "data.pkl", is_tensor_global, "torch.load")
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise InputError(f"{label} is not plain tensors ({first_line(exc)}); {TORCH_SAVE.advice}") from exc
