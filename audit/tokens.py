"""Token inputs (split LLMs): a bottom model over token ids, audited on its token embeddings.

`--vocab` declares that the data holds token ids (nothing infers it from shapes or values). The
model's token-embedding lookup is located (TorchScript: the `aten::embedding` on the ids input;
ONNX: the Gather of a weight table by the ids input, possibly after a Cast) and the model is cut
there: the audited function maps the input embeddings E (T x D) to the hidden states, and the
data's `x` becomes E = table[ids]. dFIL, the prior, the bounds and the reconstruction attacks
then work in that continuous space; the table lets attacks decode embeddings to the nearest
tokens and the vocabulary turns ids into text.

Padding: the data may hold an attention `mask` [N, T] (1 = real token, 0 = padding) and a
TorchScript or ONNX model a second (mask) input. The mask is not part of the private input being
bounded: it is held fixed per sample, so the audited function is f(E; mask) and its Jacobian is
over E only. The cut model (its torch module and, for ONNX, its onnxruntime session) takes the
mask bound for a call in its `MaskSlot` (`bound_mask`); samples are run in
groups that share one mask pattern (right-padding gives at most T + 1 of them), so every batch,
shard and probe the estimators make of a group sees that group's mask.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from splitaudit.data import Dataset, load_dataset
from splitaudit.errors import InputError
from splitaudit.estimators.jacobian import concatenated
from splitaudit.estimators.mean_trace import MeanTrace, summarised
from splitaudit.estimators.prior import PriorEstimate
from splitaudit.models import detect_format, open_model
from splitaudit.raw_model import RawModel
from splitaudit.safety import display_path, require_regular_file
from splitaudit.token_information import (
    ceilings,
    information_upper,
    informative_sigma,
    position_blind_guess,
    sentence_blind_guess,
    variance_upper,
)

ALL_ONES_NOTE = (
    "the model takes an attention mask but the data has none ('mask' in the npz): it ran with an all-ones "
    "mask (every position a real token)"
)
MASK_NOTE = (
    "attention mask: held fixed per sample and not part of the private input being bounded; dFIL, the "
    "bounds and the attacks concern the token embeddings under each sample's own mask, and the token "
    "metrics count real (unpadded) positions only"
)
ONNX_INTEGER_TYPES = {2, 3, 4, 5, 6, 7, 12, 13}  # uint8, int8, uint16, int16, int32, int64, uint32, uint64
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

    def unsmoothed_prior(self, method: str) -> PriorEstimate:
        """The prior term at tau = 0: infinite, so the van Trees bound is 0 (only Cramér-Rao remains)."""
        return PriorEstimate(
            method=method,
            smoothing=0.0,
            j_over_d=math.inf,
            stderr=0.0,
            gaussian_floor=math.nan,
            stam_limit=None,
            valid=False,
            j_over_d_used=math.inf,
            notes=[
                "token embeddings take finitely many values (rows of the embedding table): their prior has "
                "infinite Fisher information, so without smoothing (--smoothing > 0) the van Trees bound is 0"
            ],
        )

    def smoothed_prior(self, method: str, tau: float, x: torch.Tensor) -> PriorEstimate:
        """The prior term at tau > 0: Stam's limit 1/tau^2, not an estimate. The smoothed prior of
        token embeddings is a mixture of N(row, tau^2 I) over the table's rows; where rows lie more
        than a few tau apart its J/d is about 1/tau^2, the most any prior smoothed with tau can have.
        Score matching underestimates such peaked mixtures and a Gaussian fit (the floor) is far
        below them, which would make the bound too optimistic; the limit is valid for every prior."""
        limit = 1.0 / tau**2
        variance = float(x.flatten(1).var(dim=0).mean())
        return PriorEstimate(
            method=method,
            smoothing=tau,
            j_over_d=limit,
            stderr=0.0,
            gaussian_floor=1.0 / (variance + tau**2),
            stam_limit=limit,
            j_over_d_used=limit,
            notes=[
                f"token inputs: J/d is Stam's limit 1/tau^2 = {limit:.4g} (valid for every prior smoothed with "
                f"tau = {tau:.4g}), not a {method} estimate: the smoothed prior of a finite vocabulary is a "
                "mixture of narrow Gaussians whose J/d approaches that limit, which score matching and a "
                "Gaussian fit underestimate (both would overstate the bound)"
            ],
        )

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


def load_vocab(path: str | Path) -> list[str]:
    """A JSON list of strings (index = id), or a `tokenizers` tokenizer.json (model.vocab as
    {token: id} or Unigram's [[token, score], ...], plus added_tokens)."""
    path = require_regular_file(path, "vocabulary file")
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"--vocab {display_path(path)} is not JSON ({exc})") from exc
    if isinstance(content, list) and all(isinstance(t, str) for t in content):
        return content
    if isinstance(content, dict) and isinstance(content.get("model"), dict):
        return _tokenizer_json_vocab(content, path)
    raise InputError(
        f"--vocab {display_path(path)} must be a JSON list of strings (index = token id) or a tokenizer.json"
    )


def _tokenizer_json_vocab(content: dict, path) -> list[str]:
    vocab = content["model"].get("vocab")
    if isinstance(vocab, list):  # Unigram: [[token, score], ...] in id order
        by_id = {i: str(entry[0]) for i, entry in enumerate(vocab)}
    elif isinstance(vocab, dict):
        by_id = {int(i): str(token) for token, i in vocab.items()}
    else:
        raise InputError(f"--vocab {display_path(path)}: tokenizer.json has no model.vocab")
    for added in content.get("added_tokens") or []:
        by_id[int(added["id"])] = str(added["content"])
    return [by_id.get(i, f"<{i}>") for i in range(max(by_id) + 1)]


def open_audited_model(model, device: torch.device, output_name: str | None, vocab, mode: str = "saved") -> RawModel:
    """The model as the audit sees it (in --model-mode `mode`): cut after its token-embedding lookup
    when --vocab declares token inputs, as it is otherwise."""
    if vocab is None:
        return open_model(model, device, output_name, mode)
    if isinstance(model, nn.Module):
        raise InputError("--vocab (token inputs) needs a model file (TorchScript or ONNX), not a torch module")
    return open_token_model(model, device, vocab, output_name, mode)


def load_audited_data(path, input_shape, raw: RawModel, label_column=None, attr_column=None) -> Dataset:
    """The data in the audited model's input space: token ids as their embeddings for a token model."""
    if raw.tokens is not None:
        data = load_token_data(path, raw.tokens)
        note = MASK_NOTE if data.mask is not None else ALL_ONES_NOTE if raw.tokens.masked is not None else None
        if note is not None and note not in raw.notes:
            raw.notes.append(note)
        return data
    if isinstance(path, Dataset) and path.mask is not None:
        raise InputError(
            f"{path.source}: 'mask' is an attention mask over token ids; pass vocab= with token ids in 'x'"
        )
    return load_dataset(path, input_shape, label_column=label_column, attr_column=attr_column)


def open_token_model(
    path, device: torch.device, vocab_path, output_name: str | None = None, mode: str = "saved"
) -> RawModel:
    """The model cut after its token-embedding lookup, as a RawModel on embeddings [T, D] whose
    `tokens` holds the table and vocabulary; InputError naming what was looked for when the lookup
    cannot be located."""
    vocab = load_vocab(vocab_path)
    path = require_regular_file(path, "model file")
    if detect_format(path) == "torchscript":
        raw = open_model(path, device, output_name, mode, mask_input=True)
        module, table = _torchscript_from_embeddings(raw.torch_module.scripted, path)
        raw = replace(raw, torch_module=module, notes=list(raw.notes))
        slot = module.slot
    else:
        raw, table, slot = _onnx_from_embeddings(path, device, output_name)
    if len(vocab) > len(table):
        raise InputError(f"--vocab names {len(vocab)} tokens but the model's embedding table has {len(table)} rows")
    return replace(raw, tokens=TokenSpace(table.float().to(device), vocab, slot))


@dataclass
class MaskSlot:
    """The attention mask a cut model's calls run with: `row` [T] (None: all ones), fed as `dtype`."""

    dtype: torch.dtype
    row: torch.Tensor | None = None

    def batch(self, n: int, length: int, device) -> torch.Tensor:
        """The bound row as the model's mask input for n samples of `length` positions."""
        row = self.row if self.row is not None else torch.ones(length, dtype=torch.bool)
        return row.to(device, self.dtype).expand(n, -1)


class FromEmbeddings(nn.Module):
    """A TorchScript bottom model run from its input embeddings: its inlined graph with the
    `aten::embedding` output replaced by a graph input (and the mask in `slot`, if it takes one)."""

    def __init__(self, scripted: torch.jit.ScriptModule, graph, slot: MaskSlot | None = None) -> None:
        super().__init__()
        self.scripted = scripted
        self.graph = graph
        self.slot = slot
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.function = torch._C._create_function_from_graph("from_embeddings", graph)

    def __deepcopy__(self, memo) -> "FromEmbeddings":
        """A copy with its own weights (attacks re-initialise copies); the graph and the mask slot
        are shared, as the graph takes the module as its first input and the mask is bound per call."""
        return FromEmbeddings(copy.deepcopy(self.scripted, memo), self.graph, self.slot)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        inputs = [embeddings]
        if self.slot is not None:
            inputs.append(self.slot.batch(len(embeddings), embeddings.shape[-2], embeddings.device))
        with torch.jit.optimized_execution(False):  # see torchscript_loading.Unoptimized
            return self.function(self.scripted._c, *inputs)


class WithBoundMask(nn.Module):
    """A converted ONNX module over (embeddings, mask) called on the embeddings alone."""

    def __init__(self, inner: nn.Module, slot: MaskSlot) -> None:
        super().__init__()
        self.inner = inner
        self.slot = slot

    def __deepcopy__(self, memo) -> "WithBoundMask":
        return WithBoundMask(copy.deepcopy(self.inner, memo), self.slot)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.inner(embeddings, self.slot.batch(len(embeddings), embeddings.shape[-2], embeddings.device))


class MaskFeedingSession:
    """An onnxruntime session over (embeddings, mask) seen as taking the embeddings alone: each run
    feeds the mask bound in the slot (what the black-box path of models.py and the checks of
    onnx_loading.py and model_checks.py use of a session)."""

    def __init__(self, session, slot: MaskSlot) -> None:
        self.session = session
        self.slot = slot
        self.mask_name = session.get_inputs()[1].name

    def get_inputs(self) -> list:
        return self.session.get_inputs()[:1]

    def get_outputs(self) -> list:
        return self.session.get_outputs()

    def get_providers(self) -> list[str]:
        return self.session.get_providers()

    def run(self, output_names, feed: dict) -> list:
        (embeddings,) = feed.values()
        mask = self.slot.batch(len(embeddings), embeddings.shape[-2], "cpu").numpy()
        return self.session.run(output_names, {**feed, self.mask_name: mask})


def _torchscript_from_embeddings(scripted, path) -> tuple[FromEmbeddings, torch.Tensor]:
    graph = scripted.inlined_graph.copy()
    inputs = list(graph.inputs())[1:]
    lookups = [n for n in graph.nodes() if n.kind() == "aten::embedding" and n.inputsAt(1) is inputs[0]]
    if len(inputs) not in (1, 2) or len(lookups) != 1:
        raise InputError(
            f"{display_path(path)}: no token-embedding lookup found (looked for one aten::embedding on the "
            f"model's ids input, its first of at most two with an attention mask; found {len(lookups)} on "
            f"{len(inputs)} inputs)"
        )
    ids = inputs[:1]
    slot = MaskSlot(_mask_dtype(inputs[1], path)) if len(inputs) == 2 else None
    lookup = lookups[0]
    table = _graph_constant(scripted, lookup.inputsAt(0), path)
    embeddings = graph.addInput("embeddings")
    embeddings.setType(lookup.output().type())
    lookup.output().replaceAllUsesWith(embeddings)
    lookup.destroy()
    if ids[0].uses():
        raise InputError(
            f"{display_path(path)}: the model uses its token ids beyond the embedding lookup (e.g. for "
            "positions or a padding mask); splitaudit audits models whose ids enter only through it"
        )
    graph.eraseInput(1)
    if slot is not None:  # the function's inputs: (self, embeddings, mask)
        graph.addInput("mask").setType(list(graph.inputs())[1].type())
        list(graph.inputs())[1].replaceAllUsesWith(list(graph.inputs())[-1])
        graph.eraseInput(1)
    torch._C._jit_pass_dce(graph)
    return FromEmbeddings(scripted, graph, slot), table


def _mask_dtype(value, path) -> torch.dtype:
    """The dtype a traced mask input was recorded with (int64 where the graph does not say)."""
    _require_mask_name(value.debugName().split(".")[0], path)
    dtype = getattr(value.type(), "dtype", lambda: None)()
    return dtype if dtype is not None else torch.long


def _require_mask_name(name: str, path) -> None:
    """A second input not named as a mask (token types, positions) is refused: feeding it the
    attention mask would audit a different function without any error."""
    if "mask" not in name.lower():
        raise InputError(
            f"{display_path(path)}: the model's second input {name!r} is not an attention mask; splitaudit "
            "passes the data's 'mask' to a second input whose name contains 'mask' (export others fixed)"
        )


def _graph_constant(scripted, value, path) -> torch.Tensor:
    """The tensor a TorchScript graph value holds: a chain of prim::GetAttr from self."""
    names = []
    node = value.node()
    while node.kind() == "prim::GetAttr":
        names.append(node.s("name"))
        node = node.inputsAt(0).node()
    if node.kind() != "prim::Param" or not names:
        raise InputError(f"{display_path(path)}: the embedding lookup's table is not a weight of the model")
    owner = scripted
    for name in reversed(names):
        owner = getattr(owner, name)
    return owner.detach()


def _onnx_from_embeddings(
    path: Path, device: torch.device, output_name
) -> tuple[RawModel, torch.Tensor, MaskSlot | None]:
    """The graph cut after its embedding Gather (inputs: the embeddings, and the mask when the model
    takes one as its second input), its table, and the slot its mask is bound in."""
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(str(path))
    inputs = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    ints = [i for i in inputs if i.type.tensor_type.elem_type in ONNX_INTEGER_TYPES]
    weights = {t.name: t for t in proto.graph.initializer}
    weights.update({n.output[0]: n.attribute[0].t for n in proto.graph.node if n.op_type == "Constant" and n.attribute})
    casts = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Cast"}
    id_names = {i.name for i in ints}
    lookups = [
        n
        for n in proto.graph.node
        if n.op_type == "Gather" and n.input[0] in weights and casts.get(n.input[1], n.input[1]) in id_names
    ]
    if (
        len(inputs) not in (1, 2)
        or len(lookups) != 1
        or casts.get(lookups[0].input[1], lookups[0].input[1]) != inputs[0].name
    ):
        raise InputError(
            f"{display_path(path)}: no token-embedding lookup found (looked for one Gather of a weight table "
            f"by the integer ids input, the first of at most two with an attention mask, possibly after a Cast; "
            f"found {len(lookups)} on {len(inputs)} inputs)"
        )
    lookup = lookups[0]
    slot = None
    if len(inputs) == 2:
        _require_mask_name(inputs[1].name, path)
        elem_type = inputs[1].type.tensor_type.elem_type
        slot = MaskSlot(torch.from_numpy(np.zeros(0, dtype=helper.tensor_dtype_to_np_dtype(elem_type))).dtype)
    table = torch.from_numpy(np.array(numpy_helper.to_array(weights[lookup.input[0]]), dtype=np.float32))
    folder = Path(tempfile.mkdtemp(prefix="splitaudit-tokens-"))
    cut = folder / "from_embeddings.onnx"
    outputs = [output_name] if output_name else [o.name for o in proto.graph.output][:1]
    source = path
    if _shapes_read_from_embeddings(proto, inputs[0].name, lookup.output[0]):
        source = folder / "shapes_from_embeddings.onnx"
        onnx.save(proto, str(source))
    try:
        cut_inputs = [lookup.output[0], *(i.name for i in inputs[1:])]
        onnx.utils.extract_model(str(source), str(cut), cut_inputs, outputs, check_model=True)
    except Exception as exc:
        raise InputError(
            f"{display_path(path)}: cannot cut the graph after its embedding lookup {lookup.name!r} "
            f"({str(exc).splitlines()[0][:200]}); the ids may be used beyond the lookup"
        ) from exc
    raw = open_model(cut, device, output_name, mask_input=slot is not None)
    raw = replace(raw, path=path, declared_input_shape=None)
    if slot is not None:
        raw = replace(
            raw,
            session=MaskFeedingSession(raw.session, slot),
            torch_module=None if raw.torch_module is None else WithBoundMask(raw.torch_module, slot),
            pending_conversions=(
                replace(c, module=None if c.module is None else WithBoundMask(c.module, slot))
                for c in raw.pending_conversions
            ),
        )
    return raw, table, slot


SHAPE_SLICE_OPSET = 15  # Shape takes start and end from this opset on


def _shapes_read_from_embeddings(proto, ids: str, embeddings: str) -> bool:
    """Point the graph's Shape nodes on the ids [N, T] (or on their Cast) at the embeddings [N, T, D],
    which share their leading sizes: exporters with a dynamic length read it off the ids, which
    would otherwise keep the ids in the cut graph. A negative start or end counts from the end,
    one axis more there. True when a node was changed."""
    from onnx import helper

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    id_names = {ids} | {n.output[0] for n in proto.graph.node if n.op_type == "Cast" and n.input[0] == ids}
    shapes = [n for n in proto.graph.node if n.op_type == "Shape" and n.input[0] in id_names]
    if opset < SHAPE_SLICE_OPSET or not shapes:
        return False
    for node in shapes:
        given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        start, end = given.get("start", 0), given.get("end", 2)
        del node.attribute[:]
        node.attribute.extend(
            [
                helper.make_attribute("start", start - 1 if start < 0 else start),
                helper.make_attribute("end", end - 1 if end < 0 else end),
            ]
        )
        node.input[0] = embeddings
    _sort_topologically(proto.graph)  # the Shape nodes (and what reads them) now follow the lookup
    return True


def _sort_topologically(graph) -> None:
    """Reorder the graph's nodes so that each follows the producers of its inputs, keeping the
    given order where it already does (the ONNX checker requires it)."""
    nodes = list(graph.node)
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    order, waiting = [], list(range(len(nodes)))
    while waiting:
        still = []
        for i in waiting:
            if all(name in known for name in nodes[i].input):
                order.append(i)
                known.update(nodes[i].output)
            else:
                still.append(i)
        if len(still) == len(waiting):
            return  # a cycle or an input from nowhere: left as it is, for the checker to name
        waiting = still
    ordered = [copy.deepcopy(nodes[i]) for i in order]
    del graph.node[:]
    graph.node.extend(ordered)


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


# --- what the audit means for tokens (splitaudit.token_information has the mathematics) --------


def token_statement(
    tokens: TokenSpace, hidden: torch.Tensor, noise_sigma: float, aux: Dataset, target_mask: torch.Tensor | None
) -> dict:
    """Ceilings on any attacker's token accuracy and exact-sentence match at this noise, from the
    information the noisy hidden states carry about the sentence (splitaudit.token_information):
    hidden: the clean hidden states of the audited (target) sentences; aux: the sentences whose
    most frequent token per position is the blind guess."""
    variances, uppers = variance_upper(hidden)
    information = information_upper(uppers, noise_sigma)
    length = aux.token_ids.shape[1]
    real = [1.0] * length if target_mask is None else target_mask.double().mean(dim=0).tolist()
    position_blind = position_blind_guess(aux.token_ids.cpu(), _cpu(aux.mask), tokens.size)
    sentence_blind = sentence_blind_guess(aux.token_ids.cpu()) if aux.mask is None and target_mask is None else None
    return {
        "embedding_dim": tokens.table.shape[1],
        "vocab_size": tokens.size,
        "noise_sigma": noise_sigma,
        "hidden_coordinates": len(variances),
        "samples": len(hidden),
        "information_nats": information,
        "information_nats_point": information_upper(variances, noise_sigma),
        "position_blind_guess": position_blind,
        "sentence_blind_guess": sentence_blind,
        **ceilings(information, position_blind, real, sentence_blind),
        "informative_from_sigma": informative_sigma(uppers, position_blind, real),
        "assumptions": _statement_assumptions(noise_sigma, target_mask is not None),
    }


def _cpu(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.cpu()


def _statement_assumptions(noise_sigma: float, padded: bool) -> list[str]:
    notes = [
        "the noise is added on the hidden states as audited (Z = f(X) + N(0, sigma^2 I)); the ceilings hold "
        "for any attacker (any computation, auxiliary data or model access independent of the target)",
        "I(X; Z) <= 1/2 sum_j log(1 + Var(f_j)/sigma^2) over the hidden coordinates (Gaussian maximum "
        "entropy, Hadamard); each Var(f_j) is taken at its upper 95% bound on the audited sentences (normal "
        "approximation, per coordinate rather than simultaneous; for a stochastic encoder the variance over "
        "the inputs and its draws)",
        "the blind guesses (the most frequent token at each position, the most frequent sentence) come from "
        "aux at their upper 95% bounds: aux is assumed drawn like the target, with its positions as the target's",
        "the ceilings concern the expected accuracy over sentences like the audited ones; a measured accuracy "
        "carries sampling error",
    ]
    if noise_sigma <= 0:
        notes.append("no noise (sigma = 0): the hidden states may determine the sentence, so the ceilings are 1")
    if padded:
        notes.append(
            "padding: the mask counts as part of the private sentence in the information; each position's "
            "guess is a token or 'padding' and accuracy counts real positions only, so a position's ceiling is "
            "divided by its share of real tokens (at most 1)"
        )
    return notes


def checked_against_attacks(statement: dict, bounds: dict, attacks: dict) -> tuple[dict, dict]:
    """(tokens section, bounds section): the statement with the attacks it is compared with (those
    that measured token accuracy) and those whose token accuracy or exact match beats its ceilings,
    who also join the bound's violators. Neither input is changed."""
    compared = {
        name: entry["metrics"]
        for name, entry in attacks.items()
        if entry.get("status") == "ok" and "token_accuracy" in entry.get("metrics", {})
    }
    violated = [
        name
        for name, metrics in compared.items()
        if metrics["token_accuracy"] > statement["token_accuracy_ceiling"]
        or metrics.get("exact_match", -math.inf) > statement["exact_match_ceiling"]
    ]
    section = {**statement, "compared_with": list(compared), "violated_by": violated}
    if not violated:
        return section, bounds
    note = (
        f"{', '.join(violated)} recovered more tokens than the token statement allows (token accuracy "
        f"{statement['token_accuracy_ceiling']:.4g}, exact match {statement['exact_match_ceiling']:.4g}): "
        "an estimate it rests on does not hold for these inputs"
    )
    return section, {
        **bounds,
        "violated_by": bounds["violated_by"] + [name for name in violated if name not in bounds["violated_by"]],
        "notes": [*bounds.get("notes", []), note],
    }


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


def mean_trace_per_mask_pattern(
    tokens: TokenSpace | None, mask: torch.Tensor | None, x: torch.Tensor, estimate: Callable[[torch.Tensor], MeanTrace]
) -> MeanTrace:
    """estimate(x) (a mean Jacobian trace) on each group of samples sharing a mask pattern under its
    mask, merged into one over all samples: per-sample traces side by side (index into x), the
    mean and its standard error recomputed over them, products summed, the largest group's self-check."""
    groups = mask_groups(mask, len(x)) if tokens is not None and tokens.masked is not None else []
    if len(groups) <= 1:
        with bound_mask(tokens, groups[0][0] if groups else None):
            return estimate(x)
    parts = []
    for row, positions in groups:
        positions = positions.to(x.device)
        with bound_mask(tokens, row):
            parts.append((positions, estimate(x[positions])))
    merged = summarised(
        concatenated([part.traces for _, part in parts]),
        torch.cat([positions[part.index] for positions, part in parts]),
        parts[0][1].rtol,
        sum(part.total_products for _, part in parts),
    )
    largest = max(parts, key=lambda p: len(p[0]))[1]
    merged.check = largest.check
    merged.fd_choice = largest.fd_choice
    return merged
