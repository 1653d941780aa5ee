"""Hugging Face checkpoints as token bottoms: a local folder as `save_pretrained` writes it
(config.json, *.safetensors, tokenizer files) and a split layer N; the bottom is the embedding and
the first N blocks, audited from the input token embeddings like the other token bottoms.

Families: GPT-2 (`gpt2`), Llama-style decoders (`llama`, `mistral`, `qwen2`: `model.layers` and a
final `norm`) and BERT-style encoders (`bert`, `roberta`: `encoder.layer`). The bottom returns the
hidden states after block N, the checkpoint's own `hidden_states[N]` (so the final norm applies
only when N is the last block), and is checked against the checkpoint's forward pass
(output_hidden_states=True) at load. Weights are read from safetensors only; a folder holding
pickled weights (pytorch_model.bin, *.pt, *.pkl...) and no safetensors is refused before anything
is opened. Nothing is downloaded (local_files_only, HF_HUB_OFFLINE=1), and no code from the folder
runs (trust_remote_code=False). transformers is imported here only (splitaudit.inputs.optional_imports).
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.checkpoint_folder import checkpoint_files
from splitaudit.inputs.raw_model import RawModel
from splitaudit.inputs.tokens import MaskSlot, TokenSpace, load_vocab

# model_type -> (the attribute path of its block list, its final norm or None)
FAMILIES = {
    "gpt2": ("h", "ln_f"),
    "llama": ("layers", "norm"),
    "mistral": ("layers", "norm"),
    "qwen2": ("layers", "norm"),
    "bert": ("encoder.layer", None),
    "roberta": ("encoder.layer", None),
}
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
PARITY_LENGTH = 16  # positions of the ids the bottom is checked on against the checkpoint
PARITY_RTOL = 1e-4  # of the hidden states' largest value


def require_safetensors(folder: Path) -> None:
    """InputError for a folder without safetensors weights (naming pickled ones when it has them):
    pickled weights run code when loaded and are never opened."""
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLED_SUFFIXES)
    found = f"it holds pickled weights ({', '.join(pickled[:3])}), which are never opened" if pickled else "none found"
    raise InputError(
        f"{display_path(folder)}: a Hugging Face checkpoint must hold its weights as *.safetensors ({found}); "
        "convert it with save_pretrained(..., safe_serialization=True)"
    )


def checkpoint_family(folder: Path) -> tuple[str, int]:
    """(model_type, number of blocks) from config.json, read as JSON before transformers sees it."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{display_path(folder)}/config.json is not JSON ({exc})") from exc
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in FAMILIES:
        raise InputError(
            f"{display_path(folder)}: model_type {str(kind)[:40]!r} is not supported; splitaudit cuts "
            f"{', '.join(FAMILIES)} checkpoints"
        )
    layers = config.get("n_layer", config.get("num_hidden_layers"))
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise InputError(f"{display_path(folder)}/config.json gives no number of layers (n_layer/num_hidden_layers)")
    return kind, layers


class CheckpointBottom(nn.Module):
    """The checkpoint cut after block N, run from input embeddings [N, T, D] with the mask in `slot`."""

    def __init__(self, model: nn.Module, slot: MaskSlot) -> None:
        super().__init__()
        self.model = model
        self.slot = slot
        # transformers renamed forward's past_key_values to cache (5.2x); both are met in the wild.
        self.cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        mask = self.slot.batch(len(embeddings), embeddings.shape[-2], embeddings.device)
        return self.model(inputs_embeds=embeddings, attention_mask=mask).last_hidden_state

    # The prefix-cache protocol of the sequential inversion (attacks/sequential_inversion.py): a causal
    # checkpoint's state at position t needs the prefix's keys and values, computed once, and then every
    # candidate token at t is one more query over them: all candidates of a call go in as one sequence
    # after the prefix, each at position t, attending to the prefix and to itself only.

    def prefix_cache(self, prefix: torch.Tensor, mask: torch.Tensor | None) -> PrefixKeys:
        """The keys and values of the kept blocks for prefixes [P, t, D] under the mask row (None: all real)."""
        count, length = prefix.shape[:2]
        if length == 0:
            return PrefixKeys([], count, 0, None)
        rows = self._mask(mask, count, length, prefix.device)
        cache = self.model(inputs_embeds=prefix, attention_mask=rows, use_cache=True)[self.cache_keyword]
        kept = [(layer.keys, layer.values) for layer in cache.layers if layer.keys is not None]
        return PrefixKeys(kept, count, length, type(cache))

    def extend(
        self, prefix: PrefixKeys, steps: torch.Tensor, mask: torch.Tensor | None, rows: torch.Tensor
    ) -> torch.Tensor:
        """The states [R, K, H] at position t of prefixes `rows` [R], each followed by each of its candidates'
        input embeddings steps[r] [K, D]; `mask` is the row of at least t + 1 positions (None: all real)."""
        count, t, k = len(rows), prefix.length, steps.shape[1]
        if t == 0:  # no prefix: a candidate's state is its own
            alone = self._mask(mask, count * k, 1, steps.device)
            return self.model(
                inputs_embeds=steps.reshape(count * k, 1, -1), attention_mask=alone
            ).last_hidden_state.reshape(count, k, -1)
        seen = self._mask(mask, k, t, steps.device).bool()  # [K, t]: the prefix's real positions
        allowed = torch.cat([seen, torch.eye(k, dtype=torch.bool, device=steps.device)], dim=1)
        blocked = torch.zeros(allowed.shape, dtype=steps.dtype, device=steps.device)
        blocked.masked_fill_(~allowed, torch.finfo(steps.dtype).min)
        # a fresh cache of the rows' keys and values: the call appends to it, not to the prefix's
        cache = prefix.cache_type(ddp_cache_data=[(keys[rows], values[rows]) for keys, values in prefix.keys])
        out = self.model(
            inputs_embeds=steps,
            attention_mask=blocked[None, None].expand(count, -1, -1, -1),
            position_ids=torch.full((count, k), t, device=steps.device),
            use_cache=True,
            **{self.cache_keyword: cache},
        )
        return out.last_hidden_state

    def candidates_per_call(self, prefix: PrefixKeys, budget: int) -> int:
        """Candidates one extend call takes within `budget` values: each (prefix, candidate) pair holds its
        activations (about 8 x width) and a row of attention scores per head over the prefix and the call."""
        config = self.model.config
        heads, width = config.num_attention_heads, config.hidden_size
        by_rows = budget // (prefix.count * (8 * width + heads * prefix.length))
        by_scores = math.isqrt(budget // (prefix.count * heads))
        return max(1, min(by_rows, by_scores))

    def _mask(self, row: torch.Tensor | None, n: int, length: int, device) -> torch.Tensor:
        """The attention mask [n, length] of the first `length` positions of `row` (None: all real)."""
        return MaskSlot(self.slot.dtype, None if row is None else row[:length]).batch(n, length, device)


@dataclass
class PrefixKeys:
    """What CheckpointBottom.prefix_cache computed: each kept block's (keys, values) for `count`
    prefixes of `length` positions, and the transformers cache class that held them."""

    keys: list[tuple[torch.Tensor, torch.Tensor]]
    count: int
    length: int
    cache_type: type | None


def open_checkpoint(folder, device: torch.device, split_layer: int | None, vocab_path=None) -> RawModel:
    """The checkpoint in `folder` cut after block `split_layer`, as a token RawModel whose tokens
    carry the checkpoint's tokenizer (or --vocab's); checked against the checkpoint's own forward pass."""
    folder = Path(folder)
    checkpoint_files(folder)  # a file linked from outside the folder is refused before anything reads it
    require_safetensors(folder)
    kind, layers = checkpoint_family(folder)
    if split_layer is None or not 1 <= split_layer <= layers:
        raise InputError(
            f"{display_path(folder)} is a {kind} checkpoint of {layers} blocks: give --split-layer N, "
            f"1 <= N <= {layers} (the client keeps the embedding and the first N blocks)"
        )
    transformers = _transformers()
    model = transformers.AutoModel.from_pretrained(
        str(folder),
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=False,
        attn_implementation="eager",
        dtype=torch.float32,
    ).eval()
    model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    table = model.get_input_embeddings().weight.detach().float()
    check_ids = torch.randint(0, len(table), (2, min(PARITY_LENGTH, _max_positions(model))), generator=_seeded())
    with torch.no_grad():
        expected = model(check_ids.to(device), output_hidden_states=True).hidden_states[split_layer]
    _cut(model, kind, split_layer, layers)
    slot = MaskSlot(torch.long)
    bottom = CheckpointBottom(model, slot)
    with torch.no_grad():
        got = bottom(table[check_ids.to(device)])
    error = float((got - expected).abs().max())
    scale = float(expected.abs().max())
    if not error <= PARITY_RTOL * max(scale, 1.0):
        raise InputError(
            f"{display_path(folder)}: the bottom cut after block {split_layer} differs from the checkpoint's "
            f"hidden_states[{split_layer}] by {error:.3g} (states up to {scale:.3g})"
        )
    tokenizer = _tokenizer(transformers, folder) if vocab_path is None else None
    vocab = load_vocab(vocab_path, len(table)) if vocab_path is not None else _tokenizer_vocab(tokenizer, len(table))
    notes = [
        f"Hugging Face {kind} checkpoint: the embedding and blocks 1..{split_layer} of {layers} (--split-layer "
        f"{split_layer}); checked against the checkpoint's hidden_states[{split_layer}] (max abs difference "
        f"{error:.3g})"
    ]
    return RawModel(
        path=folder,
        format="huggingface",
        declared_input_shape=None,
        fixed_batch=None,
        torch_module=bottom,
        notes=notes,
        tokens=TokenSpace(table, vocab, slot, tokenizer, _context_window(model)),
    )


def _transformers():
    from splitaudit.inputs.optional_imports import import_transformers

    try:
        return import_transformers()
    except ImportError as exc:
        raise InputError(str(exc)) from exc


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _max_positions(model: nn.Module) -> int:
    config = model.config
    return int(getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", PARITY_LENGTH))


def _context_window(model: nn.Module) -> int | None:
    """The positions the checkpoint's config declares (raw text is truncated to them), or None."""
    config = model.config
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def _cut(model: nn.Module, kind: str, split_layer: int, layers: int) -> None:
    """Keep blocks 1..split_layer; drop the final norm unless the last block is kept (hidden_states[N]
    carries it only then) and BERT's pooler (the bottom returns the per-position states)."""
    blocks_path, norm = FAMILIES[kind]
    owner = model
    *parents, name = blocks_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    setattr(owner, name, getattr(owner, name)[:split_layer])
    if norm is not None and split_layer < layers:
        setattr(model, norm, nn.Identity())
    if getattr(model, "pooler", None) is not None:
        model.pooler = None


def _tokenizer(transformers, folder: Path):
    """The folder's tokenizer (fast, from tokenizer.json where there is one), or InputError."""
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise InputError(
            f"{display_path(folder)}: no tokenizer could be read from the checkpoint ({str(exc).splitlines()[0][:200]}); "
            "save it with tokenizer.save_pretrained into the folder, or give --vocab"
        ) from exc


def _tokenizer_vocab(tokenizer, rows: int) -> list[str]:
    """The tokenizer's tokens by id for the embedding table's rows (ids it does not name as <id>)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(rows, len(tokenizer)))))
    return [t if isinstance(t, str) else f"<{i}>" for i, t in enumerate(tokens)] + [
        f"<{i}>" for i in range(len(tokens), rows)
    ]
