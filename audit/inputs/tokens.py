"""Token inputs (split LLMs): a bottom model over token ids, audited on its token embeddings.

`--vocab` declares that the data holds token ids (nothing infers it from shapes or values). The
model is cut after its token-embedding lookup (audit/inputs/token_models.py), and the data's `x` becomes
the embeddings E = table[ids]: dFIL, the prior, the bounds and the reconstruction attacks then
work in that continuous space; the table (`TokenSpace`) lets attacks decode embeddings to the
nearest tokens and the vocabulary turns ids into text. What the audit states for tokens is in
audit/stages/token_statement.py.

Padding: the data may hold an attention `mask` [N, T] (1 = real token, 0 = padding) and a
TorchScript or ONNX model a second (mask) input. The mask is not part of the private input being
bounded: it is held fixed per sample, so the audited function is f(E; mask) and its Jacobian is
over E only. The cut model (its torch module and, for ONNX, its onnxruntime session) takes the
mask bound for a call in its `MaskSlot` (`bound_mask`); samples are run in
groups that share one mask pattern (right-padding gives at most T + 1 of them), so every batch,
shard and probe the estimators make of a group sees that group's mask.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from splitaudit.core.errors import InputError
from splitaudit.core.safety import describe_bytes, display_path, require_regular_file
from splitaudit.inputs.data import Dataset, load_dataset

ALL_ONES_NOTE = (
    "the model takes an attention mask but the data has none ('mask' in the npz): it ran with an all-ones "
    "mask (every position a real token)"
)
MASK_NOTE = (
    "attention mask: held fixed per sample and not part of the private input being bounded; dFIL, the "
    "bounds and the attacks concern the token embeddings under each sample's own mask, and the token "
    "metrics count real (unpadded) positions only"
)
MAX_VOCAB_BYTES = 256 * 1024**2  # a tokenizer.json is tens of MB at most (a 256k vocabulary with merges)
NEAREST_CHUNK = 4096  # embeddings decoded to tokens at a time (distances to every row of the table)
# Default smoothing tau for token embeddings, as a fraction of the table's per-dimension spread:
# the 0.25 that works for [0, 1] pixels (Maeng et al., NeurIPS 2023, A.1) read as a fraction of the data's scale.
TOKEN_SMOOTHING_FRACTION = 0.25


@dataclass
class TokenSpace:
    """The model's token-embedding table [V, D] and the vocabulary that names its rows."""

    table: torch.Tensor
    vocab: list[str]
    masked: MaskSlot | None = None  # the mask the cut model runs with, when it takes one
    tokenizer: object | None = None  # a Hugging Face checkpoint's tokenizer: raw text is tokenised with it
    positions: int | None = None  # the most positions the model takes (a checkpoint's context window), if known

    def to(self, device) -> "TokenSpace":
        return replace(self, table=self.table.to(device))

    @property
    def size(self) -> int:
        return self.table.shape[0]

    def spread(self) -> float:
        """The table's per-dimension standard deviation around its mean row (its natural scale)."""
        return float((self.table - self.table.mean(dim=0)).pow(2).mean().sqrt())

    def default_smoothing(self) -> float:
        """tau for the smoothed prior: token embeddings take finitely many values, so the
        unsmoothed prior has infinite Fisher information and no finite van Trees bound."""
        return TOKEN_SMOOTHING_FRACTION * self.spread()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids [..., T] -> [..., T, D]."""
        return self.table[ids.to(self.table.device)]

    @torch.no_grad()
    def nearest(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Each embedding [..., D] decoded to the id of the nearest row of the table (Euclidean)."""
        flat = embeddings.detach().reshape(-1, embeddings.shape[-1]).to(self.table)
        norms = self.table.pow(2).sum(dim=1)
        ids = [(norms - 2 * chunk @ self.table.T).argmin(dim=1) for chunk in flat.split(NEAREST_CHUNK)]
        return torch.cat(ids).reshape(embeddings.shape[:-1])

    def text(self, ids) -> str:
        """Token ids joined as text (an id the vocabulary does not name is shown as <id>)."""
        return " ".join(self.vocab[i] if i < len(self.vocab) else f"<{i}>" for i in (int(t) for t in ids))


def load_vocab(path: str | Path, rows: int) -> list[str]:
    """A JSON list of strings (index = id), or a `tokenizers` tokenizer.json (model.vocab as
    {token: id} or Unigram's [[token, score], ...], plus added_tokens), naming at most `rows` tokens
    (the model's embedding table): ids are checked before the list they index is built, so a tiny
    file cannot declare an id of 10^12."""
    path = require_regular_file(path, "vocabulary file")
    if path.stat().st_size > MAX_VOCAB_BYTES:
        raise InputError(
            f"--vocab {display_path(path)} is {describe_bytes(path.stat().st_size)}; a vocabulary file is at most "
            f"{describe_bytes(MAX_VOCAB_BYTES)}"
        )
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"--vocab {display_path(path)} is not JSON ({exc})") from exc
    if isinstance(content, list) and all(isinstance(t, str) for t in content):
        if len(content) > rows:
            raise InputError(f"--vocab names {len(content)} tokens but the model's embedding table has {rows} rows")
        return content
    if isinstance(content, dict) and isinstance(content.get("model"), dict):
        return _tokenizer_json_vocab(content, path, rows)
    raise InputError(
        f"--vocab {display_path(path)} must be a JSON list of strings (index = token id) or a tokenizer.json"
    )


def _tokenizer_json_vocab(content: dict, path, rows: int) -> list[str]:
    """The vocabulary by id; every id an integer in [0, rows), checked before the list is allocated."""
    vocab = content["model"].get("vocab")
    if isinstance(vocab, list):  # Unigram: [[token, score], ...] in id order
        pairs = [(entry[0] if isinstance(entry, list) and entry else entry, i) for i, entry in enumerate(vocab)]
    elif isinstance(vocab, dict):
        pairs = list(vocab.items())
    else:
        raise InputError(f"--vocab {display_path(path)}: tokenizer.json has no model.vocab")
    added = content.get("added_tokens") or []
    pairs += [(a.get("content"), a.get("id")) if isinstance(a, dict) else (a, None) for a in added]
    for token, i in pairs:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < rows:
            raise InputError(
                f"--vocab {display_path(path)} gives token {str(token)[:40]!r} the id {str(i)[:40]}; ids must be "
                f"integers from 0 to {rows - 1} (the model's embedding table has {rows} rows)"
            )
    by_id = {i: str(token) for token, i in pairs}
    return [by_id.get(i, f"<{i}>") for i in range(max(by_id, default=-1) + 1)]


@dataclass
class MaskSlot:
    """The attention mask a cut model's calls run with: `row` [T] (None: all ones), fed as `dtype`."""

    dtype: torch.dtype
    row: torch.Tensor | None = None

    def batch(self, n: int, length: int, device) -> torch.Tensor:
        """The bound row as the model's mask input for n samples of `length` positions."""
        row = self.row if self.row is not None else torch.ones(length, dtype=torch.bool)
        return row.to(device, self.dtype).expand(n, -1)


def load_token_data(path, tokens: TokenSpace) -> Dataset:
    """An .npz whose `x` holds token ids [N, T] as a Dataset of their embeddings [N, T, D] with
    the ids kept in `token_ids` and its attention `mask` (if any) in `mask`; ids outside the
    table, or a mask that is not 0/1 of x's shape with a real token in every row, are refused."""
    data = load_dataset(path)
    ids = data.x
    if ids.dim() != 2 or not bool((ids == ids.round()).all()):
        raise InputError(f"{data.source}: with --vocab, 'x' must hold integer token ids of shape [N, T]")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= tokens.size:
        raise InputError(
            f"{data.source}: token ids must lie in [0, {tokens.size}) (the model's embedding table), "
            f"found {int(ids.min())}..{int(ids.max())}"
        )
    mask = _load_mask(path, tuple(ids.shape), data.source)
    if mask is not None and tokens.masked is None:
        if not bool(mask.all()):
            raise InputError(
                f"{data.source}: its 'mask' pads some positions but the model has no attention-mask input "
                "(it takes the ids only); export the bottom with forward(input_ids, attention_mask)"
            )
        mask = None  # an all-ones mask pads nothing: the single-input model sees the same sentences
    return replace(data, x=tokens.embed(ids).cpu(), token_ids=ids, mask=mask)


def _load_mask(path, shape: tuple[int, ...], source: str) -> torch.Tensor | None:
    """The npz's (or the Python API's) `mask` as bool [N, T] (True = real token), or None;
    InputError when it is not 0/1 (bool or integer) of x's shape with at least one real token per row."""
    mask = _given_mask(path)
    if mask is None:
        return None
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
        raise InputError(f"{source}: 'mask' must be bool or integer 0/1, found dtype {mask.dtype}")
    if mask.shape != shape:
        raise InputError(f"{source}: 'mask' has shape {list(mask.shape)}, 'x' has {list(shape)}; they must match")
    if not np.isin(mask, (0, 1)).all():
        raise InputError(f"{source}: 'mask' must hold 0 (padding) and 1 (real token) only")
    empty = np.flatnonzero(~mask.astype(bool).any(axis=1))
    if len(empty):
        raise InputError(
            f"{source}: {len(empty)} rows of 'mask' have no real token (first: row {int(empty[0])}); "
            "every sentence needs at least one position with mask 1"
        )
    return torch.from_numpy(mask.astype(bool))


def _given_mask(path) -> np.ndarray | None:
    """The mask an npz file or an in-memory Dataset (the Python API) holds; CSV files hold none."""
    if isinstance(path, Dataset):
        return None if path.mask is None else path.mask.cpu().numpy()
    if not isinstance(path, (str, Path)) or Path(path).suffix.lower() != ".npz":
        return None
    with np.load(Path(path), allow_pickle=False) as npz:
        return npz["mask"] if "mask" in npz.files else None


def mask_groups(mask: torch.Tensor | None, n: int) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """(mask row [T], sample positions) for each distinct mask pattern of n samples; one group of
    every sample with row None (all ones) when there is no mask."""
    if mask is None:
        return [(None, torch.arange(n))]
    patterns, which = torch.unique(mask.cpu(), dim=0, return_inverse=True)
    return [(row, (which == k).nonzero().flatten()) for k, row in enumerate(patterns)]


@contextmanager
def bound_mask(tokens: TokenSpace | None, row: torch.Tensor | None) -> Iterator[None]:
    """Every call of the cut model in this block runs with attention mask `row` [T] (all ones for None)."""
    slot = tokens.masked if tokens is not None else None
    if slot is None:
        yield
        return
    previous, slot.row = slot.row, row
    try:
        yield
    finally:
        slot.row = previous


def per_mask_pattern(
    tokens: TokenSpace | None, mask: torch.Tensor | None, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """fn(x) computed group by group of samples sharing a mask pattern, each under its mask, in x's order."""
    if mask is None or tokens is None or tokens.masked is None:
        return fn(x)
    out = None
    for row, positions in mask_groups(mask, len(x)):
        positions = positions.to(x.device)
        with bound_mask(tokens, row):
            part = fn(x[positions])
        out = part.new_empty((len(x), *part.shape[1:])) if out is None else out
        out[positions] = part
    return out


def require_mask_name(name: str, path) -> None:
    """A second input not named as a mask (token types, positions) is refused: feeding it the
    attention mask would audit a different function without any error."""
    if "mask" not in name.lower():
        raise InputError(
            f"{display_path(path)}: the model's second input {name!r} is not an attention mask; splitaudit "
            "passes the data's 'mask' to a second input whose name contains 'mask' (export others fixed)"
        )
