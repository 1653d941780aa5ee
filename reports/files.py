"""Files the reports write: JSON with non-finite numbers spelt as strings, written atomically.

The lowest room of the reports: the writer, SARIF and JUnit all write through it, and it imports
no renderer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path, displayable

NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def to_strict_json(value):
    """Replace inf/nan by the strings "inf"/"-inf"/"nan" so that any JSON parser reads the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): to_strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_strict_json(v) for v in value]
    return value


def from_strict_json(value):
    """Inverse of to_strict_json."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    if isinstance(value, dict):
        return {k: from_strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_strict_json(v) for v in value]
    return value


def write_atomic(out_dir: Path, relative: Path | str, data: bytes) -> Path:
    """Write out_dir/relative through a temporary file in the same folder and an atomic rename, so
    that a crash or a full disk leaves either the old file or the whole new one, never a cut one.
    Refuses any path that would land outside out_dir. The file's own name is not followed: a
    symlink planted there is replaced, never written through (the temporary file is created
    exclusively, and the rename replaces the name itself)."""
    root = out_dir.resolve()
    target = root / relative
    path = target.parent.resolve() / target.name
    if target.name in ("", ".", "..") or (path.parent != root and root not in path.parents):
        raise InputError(
            f"refusing to write {display_path(path)}: it is outside the output folder {display_path(root)}"
        )
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    try:
        with handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, 0o644)
        os.replace(handle.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise
    return path


def write_json(data: dict, path: Path) -> Path:
    text = json.dumps(to_strict_json(displayable(data)), indent=2, allow_nan=False) + "\n"
    return write_atomic(path.parent, path.name, text.encode("utf-8"))
