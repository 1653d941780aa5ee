"""Raw text as token data: `--aux corpus.txt` (one text a line) or `corpus.jsonl` (one JSON object a
line: its `text`, labels and attributes from the fields --label-column/--attr-column name), tokenised
with the checkpoint's tokenizer (a Hugging Face folder) or --vocab's tokenizer.json (the `tokenizers`
library), then truncated and right-padded to one length: token ids x [N, T] and mask [N, T], checked
and embedded by the same code as a tokenised .npz (tokens.load_token_data), so the rest of the token
path is unchanged.

The length is the longest text's, at most --max-length and the model's context window (the aux
data's length for --target, so both parts have one shape). Truncation uses the tokenizer's own (special tokens such as BERT's [SEP] are
kept); what was truncated, padded and skipped is stated in the report (data.text).

Hostile files: the file size, the longest line and the memory the ids and embeddings will take
(lines x length) are checked before a text is decoded; invalid UTF-8 or JSON names its line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from splitaudit.core.errors import InputError
from splitaudit.core.safety import (
    describe_bytes,
    display_path,
    memory_limit_bytes,
    memory_limit_source,
    require_regular_file,
)
from splitaudit.inputs.data import Dataset, _labels
from splitaudit.inputs.tokens import TokenSpace, load_token_data

TEXT_SUFFIXES = (".txt", ".jsonl")
TEXT_FIELD = "text"  # the field of a .jsonl object that holds the text
MAX_LINE_BYTES = 1024**2  # one text; a longer line is not a sentence to audit (and is truncated anyway)
COUNT_CHUNK = 1024**2  # bytes read at a time while counting lines
ENCODE_BATCH_BYTES = 8 * 1024**2  # text tokenised at a time (untruncated, to count what is cut)
BYTES_PER_FILE_BYTE = 4  # a Python str holds up to 4 bytes a character: the file is checked at a quarter of the limit


def is_text_file(path) -> bool:
    """Whether `path` names raw text data (.txt or .jsonl)."""
    return isinstance(path, (str, Path)) and Path(path).suffix.lower() in TEXT_SUFFIXES


@dataclass
class Corpus:
    """The texts of a file with the line each came from, and their labels and attributes (jsonl)."""

    texts: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    labels: list | None = None
    attrs: list | None = None
    empty_lines: int = 0
    total_lines: int = 0


class TextEncoder:
    """Token ids of texts by a Hugging Face tokenizer or a `tokenizers` Tokenizer, special tokens
    added as the tokenizer adds them; `limit` truncates with the tokenizer's own truncation."""

    def __init__(self, tokenizer, source: str) -> None:
        self.tokenizer = tokenizer
        self.source = source  # "checkpoint" or "vocab"
        self.library = source == "vocab"  # the tokenizers library's Tokenizer, not a transformers tokenizer
        if self.library:  # a tokenizer.json may configure its own padding and truncation: ours apply
            padding = tokenizer.padding
            self.pad_id = int(padding["pad_id"]) if padding else 0
            tokenizer.no_padding()
            tokenizer.no_truncation()
        else:
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @property
    def name(self) -> str:
        return "tokenizers.Tokenizer" if self.library else type(self.tokenizer).__name__

    def encode(self, texts: list[str], limit: int | None = None) -> list[list[int]]:
        if not self.library:
            return self.tokenizer(
                texts, add_special_tokens=True, truncation=limit is not None, max_length=limit, verbose=False
            )["input_ids"]
        if limit is None:
            self.tokenizer.no_truncation()
        else:
            self.tokenizer.enable_truncation(limit)
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]


def text_encoder(tokens: TokenSpace, vocab_path) -> TextEncoder:
    """The tokenizer raw text is read with: --vocab's tokenizer.json when given, else the checkpoint's."""
    if vocab_path is None and tokens.tokenizer is not None:
        return TextEncoder(tokens.tokenizer, "checkpoint")
    if vocab_path is None:
        raise InputError(
            "raw text needs a tokenizer: give --vocab tokenizer.json (or a Hugging Face checkpoint folder)"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise InputError('raw text with --vocab needs the tokenizers library: pip install "splitaudit[hf]"') from exc
    try:
        return TextEncoder(Tokenizer.from_file(str(vocab_path)), "vocab")
    except Exception as exc:
        raise InputError(
            f"--vocab {display_path(vocab_path)} is not a tokenizer.json the tokenizers library reads "
            f"({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}); raw text needs a tokenizer, "
            "not a list of tokens"
        ) from exc


def load_text_data(
    path,
    tokens: TokenSpace,
    vocab_path=None,
    max_length: int = 128,
    length: int | None = None,
    label_column: str | None = None,
    attr_column: str | None = None,
) -> Dataset:
    """A .txt/.jsonl file as token data: its texts tokenised, truncated and right-padded to `length`
    (the aux data's, for a target) or to the longest text's, at most `max_length` and the model's
    context window; the facts of that in the Dataset's `text`."""
    path = require_regular_file(path, "data file")
    jsonl = path.suffix.lower() == ".jsonl"
    if not jsonl and (label_column or attr_column):
        raise InputError(
            f"{display_path(path)} is plain text (one text a line, no fields): labels and attributes come from the "
            "fields of a .jsonl file"
        )
    encoder = text_encoder(tokens, vocab_path)
    limit = length or min(max_length, tokens.positions or max_length)
    total_lines = _checked_size(path, limit, tokens.table.shape[1])
    corpus = _read_corpus(path, jsonl, label_column, attr_column, total_lines)
    ids, mask, facts = _tokenised(corpus, encoder, limit, fixed=length is not None, path=path)
    y, names = _labels(corpus.labels, label_column, len(ids), path)
    attr, _ = _labels(corpus.attrs, attr_column, len(ids), path)
    data = Dataset(
        x=torch.from_numpy(ids.astype(np.float32)),
        y=y,
        attr=attr,
        class_names=names,
        source=str(path),
        mask=None if mask.all() else torch.from_numpy(mask),  # no padding: as an .npz without a mask
        text={
            "format": "jsonl" if jsonl else "txt",
            "tokenizer": encoder.name,
            "tokenizer_source": encoder.source,
            "lines": corpus.total_lines,
            "texts": len(corpus.texts),
            "empty_lines_skipped": corpus.empty_lines,
            "max_length": max_length,
            "limit": limit,
            "limit_source": "aux-length" if length else "max-length" if limit == max_length else "context-window",
            **facts,
        },
    )
    return load_token_data(data, tokens)


def text_note(text: dict, role: str, source: str) -> str:
    """One sentence for the report on how a text file became token ids."""
    tokenizer = "the checkpoint's tokenizer" if text["tokenizer_source"] == "checkpoint" else "--vocab's tokenizer"
    return (
        f"{role} data {display_path(source)}: {text['texts']} texts ({text['empty_lines_skipped']} empty lines "
        f"skipped) tokenised with {tokenizer} ({text['tokenizer']}, special tokens added), truncated or right-padded "
        f"to {text['length']} tokens (at most {text['limit']}: {_limited_by(text)}): {text['truncated']} truncated, "
        f"{text['padded']} padded (pad id {text['pad_id']}, masked out)"
    )


def _limited_by(text: dict) -> str:
    return {
        "max-length": f"--max-length {text['max_length']}",
        "context-window": f"the model's context window; --max-length {text['max_length']}",
        "aux-length": "the auxiliary data's length",
    }[text["limit_source"]]


def _checked_size(path: Path, length: int, dim: int) -> int:
    """The file's line count, after checking its size and what its lines will take once tokenised
    (ids as int64 and float32, the mask, embeddings of `dim` float32) against the memory limit."""
    limit = memory_limit_bytes()
    size = path.stat().st_size
    if size * BYTES_PER_FILE_BYTE > limit:
        raise InputError(
            f"{display_path(path)} is {describe_bytes(size)} of text; splitaudit reads at most "
            f"{describe_bytes(limit // BYTES_PER_FILE_BYTE)} of text ({memory_limit_source()})"
        )
    lines = _count_lines(path)
    needed = lines * length * (8 + 4 + 1 + 4 * dim)
    if needed > limit:
        raise InputError(
            f"{display_path(path)} has {lines} lines: at {length} tokens each their ids and {dim}-dimensional "
            f"embeddings take {describe_bytes(needed)}; splitaudit loads at most {describe_bytes(limit)} "
            f"({memory_limit_source()}): use fewer texts or a smaller --max-length"
        )
    return lines


def _count_lines(path: Path) -> int:
    count, last = 0, b"\n"
    with path.open("rb") as handle:
        while chunk := handle.read(COUNT_CHUNK):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _read_corpus(path: Path, jsonl: bool, label_column, attr_column, total_lines: int) -> Corpus:
    """The non-empty texts of the file with their line numbers (and jsonl fields); InputError naming
    the line for a line over MAX_LINE_BYTES, invalid UTF-8, or (jsonl) a line that is not an object
    with a string `text` and the named fields."""
    corpus = Corpus(labels=[] if label_column else None, attrs=[] if attr_column else None, total_lines=total_lines)
    with path.open("rb") as handle:
        for number in range(1, total_lines + 1):
            raw = handle.readline(MAX_LINE_BYTES + 2)
            if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise InputError(
                    f"{display_path(path)}, line {number}: longer than {describe_bytes(MAX_LINE_BYTES)}; one line "
                    "holds one text (a sentence or a paragraph)"
                )
            line = _decoded(raw, number, path)
            if not line.strip():
                corpus.empty_lines += 1
                continue
            record = _record(line, number, path, label_column, attr_column) if jsonl else {TEXT_FIELD: line}
            if not record[TEXT_FIELD].strip():
                corpus.empty_lines += 1
                continue
            corpus.texts.append(record[TEXT_FIELD])
            corpus.lines.append(number)
            for values, name in ((corpus.labels, label_column), (corpus.attrs, attr_column)):
                if values is not None:
                    values.append(record[name])
    return corpus


def _decoded(raw: bytes, number: int, path: Path) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{display_path(path)}, line {number}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
            "save the file as UTF-8"
        ) from exc
    return (line.removeprefix("\ufeff") if number == 1 else line).rstrip("\r\n")


def _record(line: str, number: int, path: Path, label_column, attr_column) -> dict:
    """A jsonl line's object, with a string `text` and a class value in each named field."""
    where = f"{display_path(path)}, line {number}"
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where}: not JSON ({str(exc)[:120]}); a .jsonl file holds one JSON object a line") from exc
    if not isinstance(record, dict):
        raise InputError(f"{where}: a JSON {type(record).__name__}, not an object with a {TEXT_FIELD!r} field")
    if not isinstance(record.get(TEXT_FIELD), str):
        raise InputError(f"{where}: no {TEXT_FIELD!r} field holding a string")
    for name, flag in ((label_column, "--label-column"), (attr_column, "--attr-column")):
        if name is None:
            continue
        value = record.get(name)
        if isinstance(value, (dict, list)) or value is None:
            shown = "missing" if name not in record else "null" if value is None else f"a JSON {type(value).__name__}"
            raise InputError(f"{where}: {flag} field {name[:60]!r} is {shown}; it must hold a class (text or integer)")
    return record


def _tokenised(
    corpus: Corpus, encoder: TextEncoder, limit: int, fixed: bool, path: Path
) -> tuple[np.ndarray, np.ndarray, dict]:
    """(ids [N, T], mask [N, T], facts): each text tokenised, truncated to `limit` by the tokenizer
    where longer, right-padded with the pad id to T (limit when `fixed`, else the longest kept text)."""
    rows, lengths = [], []
    for batch in _batches(corpus.texts):
        full = encoder.encode(batch)
        long = [i for i, ids in enumerate(full) if len(ids) > limit]
        cut = encoder.encode([batch[i] for i in long], limit) if long else []
        lengths += [len(ids) for ids in full]
        for i, ids in zip(long, cut):
            full[i] = ids
        rows += full
    empty = [corpus.lines[i] for i, ids in enumerate(rows) if not ids]
    if empty:
        raise InputError(
            f"{display_path(path)}, line {empty[0]}: the text has no tokens once tokenised ({len(empty)} such lines)"
        )
    length = limit if fixed else max(len(ids) for ids in rows)
    ids = np.full((len(rows), length), encoder.pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = True
    facts = {
        "length": length,
        "longest": max(lengths),
        "truncated": sum(n > limit for n in lengths),
        "padded": sum(len(row) < length for row in rows),
        "pad_id": encoder.pad_id,
    }
    return ids, mask, facts


def _batches(texts: list[str]):
    """The texts in consecutive batches of about ENCODE_BATCH_BYTES characters."""
    start, size = 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= ENCODE_BATCH_BYTES:
            yield texts[start : i + 1]
            start, size = i + 1, 0
    if start < len(texts):
        yield texts[start:]
