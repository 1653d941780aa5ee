"""Guards for hostile inputs: regular files only, bounded sizes, text any file system can hold.

splitaudit trusts nothing in its inputs (model files, data, report.json, config files): every
reader goes through these checks before it reads, so that a FIFO, a zip bomb or a path with
undecodable bytes ends in one clear InputError instead of a hang, a memory blow-up or a crash.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

from splitaudit.core.errors import InputError

GIB = 1024**3
MEMORY_LIMIT_VARIABLE = "SPLITAUDIT_MEMORY_LIMIT_GIB"  # overrides memory_limit_bytes()


def machine_memory_bytes() -> int:
    """This machine's physical memory (16 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX systems
        return 16 * GIB


def memory_limit_bytes() -> int:
    """What one loaded input may declare: a quarter of this machine's memory (arrays are copied
    while loading, e.g. to float32 and to the device), at least 1 GiB; the environment variable
    SPLITAUDIT_MEMORY_LIMIT_GIB sets it instead (more for a user who needs it, less on a shared machine)."""
    given = os.environ.get(MEMORY_LIMIT_VARIABLE)
    if given is None:
        return max(GIB, machine_memory_bytes() // 4)
    try:
        gib = float(given)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise InputError(f"{MEMORY_LIMIT_VARIABLE}={given!r} is not a number of GiB above 0")
    return int(gib * GIB)


def memory_limit_source() -> str:
    """Where memory_limit_bytes() comes from and how to change it, for the line that names the limit."""
    if MEMORY_LIMIT_VARIABLE in os.environ:
        return f"set by {MEMORY_LIMIT_VARIABLE}"
    return f"a quarter of this machine's memory; {MEMORY_LIMIT_VARIABLE}=N sets it to N GiB"


def describe_bytes(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / 1024**2:.3g} MiB"


def require_regular_file(path: str | Path, what: str) -> Path:
    """The path, when it names an existing regular file (symlinks followed); a FIFO, socket or
    device would block or stream forever, so they are refused before anything opens them."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError as exc:
        raise InputError(f"{what} not found: {display_path(path)}") from exc
    except OSError as exc:  # a symlink loop, a path under a file, no permission
        raise InputError(f"cannot read {what} {display_path(path)}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device?)"
        raise InputError(f"{what} {display_path(path)} is {kind}; pass a regular file")
    return path


def display_text(text: str) -> str:
    """A string any UTF-8 writer accepts: bytes that were not valid UTF-8 in a file name (kept by
    Python as lone surrogates, PEP 383) are shown as \\xNN escapes instead of crashing the writer."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that no file name produced (e.g. from JSON)
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def display_path(path: str | Path) -> str:
    return display_text(str(path))


def displayable(value):
    """display_text applied to every string (keys included) of a JSON-like value."""
    if isinstance(value, str):
        return display_text(value)
    if isinstance(value, dict):
        return {displayable(k): displayable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [displayable(v) for v in value]
    return value


def nested_deeper_than(document, limit: int) -> bool:
    """Whether lists/objects nest deeper than limit (checked without recursion)."""
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False
