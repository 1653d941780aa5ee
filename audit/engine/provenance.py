"""The result's provenance section: what was audited (each input file's SHA-256), by what (the versions
of splitaudit and of the libraries that loaded and measured the model), where (platform, device), how
(seeds, options, command line) and when (start and end), and a short fingerprint a reviewer can quote.

The files are hashed by splitaudit.inputs.digests; this module only assembles the section.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from splitaudit.core.config import SOURCE_FIELDS, AuditOptions
from splitaudit.core.safety import display_text
from splitaudit.core.version import __version__

# The libraries whose versions can change the numbers (the model's loaders and converters, the
# numerics underneath them), each with the distributions that install it.
VERSIONED = {
    "torch": ("torch",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino"),
    "onnx2pytorch": ("onnx2pytorch",),
    "onnx2torch": ("onnx2torch",),
    "numpy": ("numpy",),
    "scipy": ("scipy",),
    "scikit-learn": ("scikit-learn",),
}
FINGERPRINT_HEX = 12  # characters of the fingerprint: enough to tell reports apart, short enough to quote


@dataclass(frozen=True)
class Invocation:
    """How the audit was started: the command line (None from the Python API) and the --config file."""

    command_line: list[str] | None = None
    config_file: str | None = None


def package_versions() -> dict[str, str | None]:
    """splitaudit's version, Python's, and each VERSIONED library's (None when not installed; the
    distribution's name follows when it is not the library's, e.g. "1.31.1 (onnxruntime-gpu)")."""

    def installed(library: str) -> str | None:
        for distribution in VERSIONED[library]:
            try:
                found = version(distribution)
            except PackageNotFoundError:
                continue
            return found if distribution == library else f"{found} ({distribution})"
        return None

    return {"splitaudit": __version__, "python": platform.python_version(), **{n: installed(n) for n in VERSIONED}}


def fingerprint(files: list[dict], tool_version: str) -> str:
    """The first FINGERPRINT_HEX hex digits of a SHA-256 over the inputs' roles and digests and
    splitaudit's version: the same files audited by the same version give the same fingerprint,
    wherever they lie (paths are left out)."""
    content = {
        "splitaudit": tool_version,
        "files": [[f["role"], f.get("location", ""), f["sha256"]] for f in files],
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:FINGERPRINT_HEX]


def recorded_options(options: AuditOptions) -> tuple[dict, list[str]]:
    """The options as JSON values, enough to rebuild them (verify --recompute), and the names of the
    inputs given in memory (Python API: a module or arrays), recorded by their description only."""
    recorded, in_memory = {}, []
    for f in fields(options):
        value = getattr(options, f.name)
        if f.name in SOURCE_FIELDS and value is not None and not isinstance(value, (str, Path)):
            in_memory.append(f.name)
            value = display_text(str(getattr(value, "source", type(value).__name__)))
        recorded[f.name] = str(value) if isinstance(value, Path) else value
    return recorded, in_memory


def device_name(device: torch.device) -> str:
    """The accelerator's name (CUDA), else the processor's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def provenance_section(
    options: AuditOptions,
    files: list[dict],
    device: torch.device,
    seeds: list[int],
    converter: str | None,
    invocation: Invocation | None,
    started: datetime,
) -> dict:
    """The provenance section, ended now."""
    recorded, in_memory = recorded_options(options)
    invocation = invocation or Invocation()
    return {
        "fingerprint": fingerprint(files, __version__),
        "files": files,
        "in_memory": in_memory,
        "versions": package_versions(),
        "converter": converter,
        "platform": platform.platform(),
        "device": device.type,
        "device_name": device_name(device),
        "seed": options.seed,
        "seeds": list(seeds),
        "options": recorded,
        "command_line": [display_text(a) for a in invocation.command_line] if invocation.command_line else None,
        "started": started.isoformat(timespec="seconds"),
        "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
