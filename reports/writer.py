"""Write and read result files: strict JSON (non-finite numbers as strings), HTML, Markdown."""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import os
import re
import stat
from pathlib import Path
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup, escape
from tabulate import tabulate

from splitaudit.core.errors import InputError
from splitaudit.core.registries import formats_of
from splitaudit.core.result import READABLE_VERSIONS, first_error, schema_of_kind, upgraded
from splitaudit.core.safety import display_path, displayable, nested_deeper_than, require_regular_file
from splitaudit.reports.consistency import check_consistency, regated
from splitaudit.reports.documents import Document, write_document
from splitaudit.reports.files import from_strict_json, to_strict_json, write_atomic, write_json
from splitaudit.reports.view import build_view
from splitaudit.reports.view_elements import Figure, Table

MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|#])")
LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")  # what str.splitlines splits at
# A list item, thematic break, setext underline or fence at the start of a value ('- ', '+ ', '---', '===', '~~~',
# '1. ', '2) '): its marker is backslash-escaped, as a value may stand at the start of a Markdown line.
LEADING_MARKER = re.compile(r"^(\s*)([-+=~](?=[-+=~\s]|$)|\d{1,9}(?=[.)](?:\s|$)))")
MAX_REPORT_BYTES = 256 * 1024**2  # a report.json is a few MB at most; larger is not one of ours
MAX_JSON_DEPTH = 64  # a report nests about 8 levels; deeper input is hostile
LOCK_NAME = ".splitaudit.lock"
UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


def read_json_file(path: Path, what: str = "report"):
    """Parse a JSON file (as stored: non-finite numbers still strings) from an untrusted source: a regular file of bounded size, UTF-8, not
    nested so deeply that the parser recurses out. Any failure is one InputError line."""
    path = require_regular_file(path, what)
    size = path.stat().st_size
    if size > MAX_REPORT_BYTES:
        raise InputError(f"{display_path(path)} is {size} bytes; a {what} is at most {MAX_REPORT_BYTES} bytes")
    try:
        document = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{display_path(path)} is not a splitaudit report.json (not UTF-8 text: {exc.reason} at byte {exc.start})"
        ) from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{display_path(path)} is not a splitaudit report.json (invalid JSON: {exc})") from exc
    except RecursionError as exc:
        raise InputError(f"{display_path(path)} is not a splitaudit report.json (nested too deeply)") from exc
    if nested_deeper_than(document, MAX_JSON_DEPTH):  # Python >= 3.12 parses deep JSON; later readers recurse
        raise InputError(f"{display_path(path)} is not a splitaudit report.json (nested too deeply)")
    return document


def load_result(path: Path) -> dict:
    """Read a report.json written by splitaudit; InputError names the first place it breaks the schema."""
    return displayable(checked_result(read_json_file(Path(path)), display_path(path)))


def checked_result(stored, source: str) -> dict:
    """A report.json document (as stored) checked against the schema, with its numbers restored."""
    if not isinstance(stored, dict) or "schema_version" not in stored:
        raise InputError(f"{source} is not a splitaudit report.json (no schema_version)")
    if stored["schema_version"] not in READABLE_VERSIONS:
        raise InputError(
            f"{source} is a report of schema version {stored['schema_version']!r}; this splitaudit "
            f"reads versions {', '.join(map(str, READABLE_VERSIONS))} (rerun the audit, or render it with the "
            "version that wrote it)"
        )
    current = upgraded(stored)
    error = first_error(current, schema_of_kind(current.get("kind")))
    if error:
        raise InputError(f"{source}: {error}")
    if current is stored:
        restored = from_strict_json(current)
        check_consistency(restored, source)
        return restored
    check_consistency(from_strict_json(stored), source, legacy=True)  # by the rules that wrote it
    return regated(from_strict_json(current))


def markdown_text(value) -> Markup:
    """Escape a value for Markdown: HTML entities for <>&" and backslashes for Markdown syntax; line
    breaks become spaces and a leading block marker is escaped, so that a string from the data or a
    report.json (a label, a file name) stays inside its line or table cell and starts no heading or list."""
    if isinstance(value, Markup):
        return value
    text = LINE_BREAKS.sub(" ", "" if value is None else str(value))
    return escape(LEADING_MARKER.sub(_escaped_marker, MARKDOWN_SPECIAL.sub(r"\\\1", text)))


def _escaped_marker(match: re.Match) -> str:
    """'- ' -> '\\- ', '1. ' -> '1\\. ' (the backslash goes before the punctuation that makes the marker)."""
    indent, marker = match.groups()
    return indent + (marker + "\\" if marker.isdigit() else "\\" + marker)


def markdown_url(path: str) -> Markup:
    """A relative file path as a Markdown link target."""
    return Markup(quote(path))


def markdown_table(table: Table) -> Markup:
    """A GitHub-flavoured Markdown table with every cell escaped."""
    return Markup(
        tabulate(
            [[markdown_text(c) for c in row] for row in table.rows],
            headers=[markdown_text(h) for h in table.headers],
            tablefmt="github",
            disable_numparse=True,
        )
    )


def html_environment() -> Environment:
    return Environment(
        loader=PackageLoader("splitaudit.reports", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def markdown_environment() -> Environment:
    """Autoescaped like HTML, but every interpolation also escapes Markdown syntax."""
    env = Environment(
        loader=PackageLoader("splitaudit.reports", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=markdown_text,
    )
    env.filters["md_table"] = markdown_table
    env.filters["md_url"] = markdown_url
    return env


def inline_figures(figures: list[Figure]) -> None:
    """Point each figure at a data URI, for a self-contained HTML file."""
    for figure in figures:
        figure.src = "data:image/png;base64," + base64.b64encode(figure.png).decode("ascii")


def save_figures(figures: list[Figure], out_dir: Path, folder: str) -> list[Path]:
    """Write each figure as a PNG in out_dir/folder and point it at its relative path. A symlink
    planted as the folder is refused (write_atomic refuses one that leads out; a dangling one
    would fail mkdir)."""
    paths = []
    if figures:
        if (out_dir / folder).is_symlink():
            raise InputError(
                f"{display_path(out_dir / folder)} is a symbolic link; splitaudit writes through no link "
                "inside the output folder: remove it"
            )
        (out_dir / folder).mkdir(parents=True, exist_ok=True)
    for index, figure in enumerate(figures):
        path = write_atomic(out_dir, Path(folder) / figure_file_name(index, figure.name), figure.png)
        figure.src = f"{folder}/{path.name}"
        paths.append(path)
    return paths


def figure_file_name(index: int, name: str) -> str:
    """NN-name.png with only [A-Za-z0-9_-] from the name: names come from report data (attack
    names in a report.json), which must never choose where a file goes."""
    slug = UNSAFE_NAME_CHARS.sub("_", name).strip("_")[:40]
    return f"{index:02d}-{slug or 'figure'}.png"


def write_html_document(document: Document, out_dir: Path) -> Path:
    """KIND.html: the document's view through the KIND.html.j2 template, its figures inline."""
    inline_figures(document.view.figures)
    page = html_environment().get_template(f"{document.kind}.html.j2").render(v=document.view)
    return write_atomic(out_dir, f"{document.kind}.html", page.encode("utf-8"))


def write_markdown_document(document: Document, out_dir: Path) -> Path:
    """KIND.md: the document's view through the KIND.md.j2 template, its figures in KIND_images/."""
    save_figures(document.view.figures, out_dir, f"{document.kind}_images")
    page = markdown_environment().get_template(f"{document.kind}.md.j2").render(v=document.view)
    return write_atomic(out_dir, f"{document.kind}.md", page.encode("utf-8"))


def write_json_document(document: Document, out_dir: Path) -> Path:
    """KIND.json: the result checked against its schema, or what the document takes from its view."""
    path = out_dir / f"{document.kind}.json"
    if document.json_from_view is not None:
        return write_json(document.json_from_view(document.view), path)
    return write_result_json(document.data, path, document.schema)


def render_html(result: dict) -> str:
    """The self-contained HTML report as a string (figures inline)."""
    view = build_view(result)
    inline_figures(view.figures)
    return html_environment().get_template("report.html.j2").render(v=view)


def render_summary_html(result: dict) -> str:
    """A short HTML fragment (verdict, summary, attacks table) for notebooks; no figures."""
    return html_environment().get_template("summary.html.j2").render(v=build_view(result, with_figures=False))


def write_result_json(result: dict, path: Path, schema: dict | None = None) -> Path:
    """report.json (or sweep.json with its schema), checked against the schema first: a result
    that breaks it is a bug, never written."""
    error = first_error(to_strict_json(result), schema)
    if error:
        raise RuntimeError(f"the result breaks the {path.name} schema at {error}")
    return write_json(result, path)


def write_reports(result: dict, out_dir: Path, formats: list[str]) -> list[Path]:
    """Write report.html / .md / .sarif / .junit.xml / .pdf (as asked), then report.json last, into out_dir;
    returns the paths written. A stale report.json is removed first, so that a complete report.json always
    belongs with complete pages of the same run (a crash in between leaves no report.json at all)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = displayable(result)
    if "json" in formats:
        with contextlib.suppress(FileNotFoundError):
            (out_dir / "report.json").unlink()
    return write_document(Document("report", result, lambda: build_view(result)), out_dir, formats)


def claim_output_folder(out: str | os.PathLike) -> Path:
    """Check --out before any computation: not empty, not a file or under one, writable.
    Creates the folder and returns it."""
    if not str(out).strip():
        raise InputError("--out is empty; name an output folder")
    path = Path(out)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            where = "is" if parent == path else f"is under {display_path(parent)}, which is"
            raise InputError(f"--out {display_path(path)} {where} a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the output folder {display_path(path)}: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"the output folder {display_path(path)} is not writable")
    return path


def document_file_name(document: str, fmt: str) -> str:
    """The file a document is written to in a format: report.json, sweep.junit.xml..."""
    return f"{document}.junit.xml" if fmt == "junit" else f"{document}.{fmt}"


def remove_previous_reports(out_dir: Path, document: str, junit: str | None = None) -> None:
    """Remove what an earlier run wrote as `document` ("report", "sweep", "cuts") in out_dir, in every
    format, by name (and the --junit file): a run that stops before it writes its own (SIGTERM, bad
    data found mid-way, a crash) then leaves no report that reads as its result. Only those names
    are touched; a symlink among them is removed itself, never followed; the figures folder is
    kept unless it is a symlink (its images are no report)."""
    names = [document_file_name(document, fmt) for fmt in formats_of(document)]
    paths = [out_dir / name for name in names] + ([Path(junit)] if junit else [])
    figures = out_dir / f"{document}_images"
    for path in paths + ([figures] if figures.is_symlink() else []):
        try:
            path.unlink()
        except (FileNotFoundError, IsADirectoryError):
            continue
        except OSError as exc:
            raise InputError(
                f"cannot remove the previous run's {display_path(path)}: {exc.strerror or exc}; "
                "remove it, or choose another --out"
            ) from exc


@contextlib.contextmanager
def output_lock(out_dir: Path):
    """Hold an exclusive lock on out_dir for one run; a second run on the same folder fails fast
    (two runs would otherwise mix their files). The lock file is never followed out of out_dir
    (see _open_lock_file) and is removed when the run ends only if this run created it."""
    lock = out_dir / LOCK_NAME
    fd, created = _locked_file(lock, out_dir)
    try:
        yield out_dir
    finally:
        if created and _names(lock, fd):
            with contextlib.suppress(OSError):
                os.unlink(lock)  # while still holding it: a waiting run then sees a new file (below)
        os.close(fd)


def _locked_file(lock: Path, out_dir: Path) -> tuple[int, bool]:
    """An open descriptor holding flock on `lock`, and whether this run created the file; retried
    when the file was removed or replaced meanwhile."""
    while True:
        try:
            fd, created = _open_lock_file(lock, out_dir)
        except FileNotFoundError:  # removed between the exclusive creation and the opening
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise InputError(
                f"another splitaudit run is writing to {display_path(out_dir)} (it holds "
                f"{display_path(lock)}); wait for it or choose another --out"
            ) from exc
        if _names(lock, fd):
            return fd, created
        os.close(fd)  # the holder removed the file after we opened it: lock the new one


def _open_lock_file(lock: Path, out_dir: Path) -> tuple[int, bool]:
    """A read-only descriptor on the lock file, and whether this call created it: created
    exclusively when absent, else opened without following a symlink (a planted link would make
    splitaudit create or lock its target anywhere) or blocking on a FIFO, and refused unless it is
    a regular file with no other name (a hard link to a file elsewhere)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        return os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    except OSError as exc:
        raise InputError(f"cannot create the lock file {display_path(lock)}: {exc.strerror or exc}") from exc
    try:
        fd = os.open(lock, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        kind = "a symbolic link" if lock.is_symlink() else f"unreadable ({exc.strerror or exc})"
        raise InputError(_foreign_lock(lock, out_dir, kind)) from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = "a hard link to another file" if stat.S_ISREG(info.st_mode) else "not a regular file"
        raise InputError(_foreign_lock(lock, out_dir, kind))
    return fd, False


def _foreign_lock(lock: Path, out_dir: Path, kind: str) -> str:
    return (
        f"the lock file {display_path(lock)} is {kind}, not one splitaudit made; splitaudit writes "
        f"through no link inside {display_path(out_dir)}: remove it, or choose another --out"
    )


def _names(lock: Path, fd: int) -> bool:
    """Whether the name `lock` (not followed) still names the file open as `fd`."""
    try:
        named = os.stat(lock, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
