"""Token models cut at their embedding lookup: the audited function maps the input embeddings
E (T x D) to the hidden states. The lookup is located in the graph (TorchScript: the
`aten::embedding` on the ids input; ONNX: the Gather of a weight table by the ids input, possibly
after a Cast) and the model is cut there; a model that also takes an attention mask runs with the
mask bound for a call in its `MaskSlot` (audit/inputs/tokens.py). `open_audited_model` and
`load_audited_data` are where the audit chooses between a token model and any other.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path, require_regular_file
from splitaudit.inputs.checkpoint_folder import is_checkpoint_folder
from splitaudit.inputs.data import Dataset, load_dataset
from splitaudit.inputs.hf_checkpoints import open_checkpoint
from splitaudit.inputs.models import detect_format, open_model
from splitaudit.inputs.raw_model import RawModel, audit_layout, select_output
from splitaudit.inputs.text_data import is_text_file, load_text_data, text_note
from splitaudit.inputs.tokens import ALL_ONES_NOTE, MASK_NOTE, MaskSlot, TokenSpace, load_token_data, load_vocab
from splitaudit.inputs.torchscript_loading import returned_outputs

ONNX_INTEGER_TYPES = {2, 3, 4, 5, 6, 7, 12, 13}  # uint8, int8, uint16, int16, int32, int64, uint32, uint64


def open_audited_model(
    model,
    device: torch.device,
    output_name: str | None,
    vocab,
    mode: str = "saved",
    input_shape=None,
    split_layer: int | None = None,
) -> RawModel:
    """The model as the audit sees it (in --model-mode `mode`, on inputs of --input-shape or its
    declared shape, channels first: audit_layout): a Hugging Face checkpoint folder cut after block
    --split-layer; cut after its token-embedding lookup when --vocab declares token inputs; as it is
    otherwise."""
    if is_checkpoint_folder(model):
        return open_checkpoint(model, device, split_layer, vocab)
    if split_layer is not None:
        raise InputError("--split-layer cuts a Hugging Face checkpoint folder (config.json + *.safetensors)")
    if vocab is None:
        return audit_layout(open_model(model, device, output_name, mode), input_shape)
    if isinstance(model, nn.Module):
        raise InputError("--vocab (token inputs) needs a model file (TorchScript or ONNX), not a torch module")
    return open_token_model(model, device, vocab, output_name, mode)


def load_audited_data(
    path, input_shape, raw: RawModel, label_column=None, attr_column=None, vocab=None, max_length: int = 128
) -> Dataset:
    """The data in the audited model's input space: token ids as their embeddings for a token model,
    raw text (.txt/.jsonl) tokenised first (to input_shape's length when given: the aux data's, for a target)."""
    if is_text_file(path) or raw.tokens is not None:
        text = is_text_file(path)  # unpadded text needs no all-ones note: its own note says nothing was padded
        data = (
            _text_data(path, input_shape, raw, label_column, attr_column, vocab, max_length)
            if text
            else load_token_data(path, raw.tokens)
        )
        unmasked = ALL_ONES_NOTE if raw.tokens.masked is not None and not text else None
        note = MASK_NOTE if data.mask is not None else unmasked
        if note is not None and note not in raw.notes:
            raw.notes.append(note)
        return data
    if isinstance(path, Dataset) and path.mask is not None:
        raise InputError(
            f"{path.source}: 'mask' is an attention mask over token ids; pass vocab= with token ids in 'x'"
        )
    data = load_dataset(path, input_shape, label_column=label_column, attr_column=attr_column)
    raw.notes.extend(note for note in data.notes if note not in raw.notes)
    return data


def _text_data(path, input_shape, raw: RawModel, label_column, attr_column, vocab, max_length: int) -> Dataset:
    """A .txt/.jsonl file tokenised for a token model (InputError for any other model), its note in raw.notes."""
    if raw.tokens is None:
        raise InputError(
            f"{display_path(path)} is raw text, and this model does not take tokens: give a Hugging Face checkpoint "
            "folder with --split-layer, or a token model with --vocab tokenizer.json"
        )
    length = input_shape[0] if input_shape else None
    data = load_text_data(path, raw.tokens, vocab, max_length, length, label_column, attr_column)
    raw.notes.append(text_note(data.text, "target" if length else "auxiliary", data.source))
    return data


def open_token_model(
    path, device: torch.device, vocab_path, output_name: str | None = None, mode: str = "saved"
) -> RawModel:
    """The model cut after its token-embedding lookup, as a RawModel on embeddings [T, D] whose
    `tokens` holds the table and vocabulary; InputError naming what was looked for when the lookup
    cannot be located."""
    path = require_regular_file(path, "model file")
    kind = detect_format(path)
    if kind == "exported":
        raise InputError(
            "--vocab (token inputs) needs a TorchScript or ONNX model; a torch.export program is not cut yet"
        )
    if kind == "torchscript":
        raw = open_model(path, device, output_name, mode, mask_input=True)
        module, table = _torchscript_from_embeddings(raw.scripted, path)
        returns = returned_outputs(raw.scripted.forward.schema.returns[0].type)  # open_model noted which is audited
        raw = replace(raw, torch_module=select_output(module, returns, output_name, path)[0], notes=list(raw.notes))
        slot = module.slot
    else:
        raw, table, slot = _onnx_from_embeddings(path, device, output_name)
    vocab = load_vocab(vocab_path, len(table))
    return replace(raw, tokens=TokenSpace(table.float().to(device), vocab, slot))


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
    outputs = [output_name] if output_name else [o.name for o in proto.graph.output][:1]
    cut_inputs = [lookup.output[0], *(i.name for i in inputs[1:])]
    with tempfile.TemporaryDirectory(prefix="splitaudit-tokens-") as scratch:  # read once by open_model
        cut = _cut_after_lookup(proto, path, Path(scratch), inputs[0].name, lookup, cut_inputs, outputs)
        raw = open_model(cut, device, output_name, mask_input=slot is not None)
    raw = replace(raw, path=path, declared_input_shape=None)
    if slot is not None:
        raw = replace(
            raw,
            saved_batch=None,  # a static batch stays in chunks: the check's sessions would need the mask too
            session=MaskFeedingSession(raw.session, slot),
            torch_module=None if raw.torch_module is None else WithBoundMask(raw.torch_module, slot),
            pending_conversions=(
                replace(c, module=None if c.module is None else WithBoundMask(c.module, slot))
                for c in raw.pending_conversions
            ),
        )
    return raw, table, slot


def _cut_after_lookup(
    proto, path: Path, folder: Path, ids: str, lookup, cut_inputs: list[str], outputs: list[str]
) -> Path:
    """The graph from the lookup's output (and the mask) to `outputs`, written in `folder`: the ids
    input `ids` and the lookup are cut away."""
    import onnx

    cut, source = folder / "from_embeddings.onnx", path
    if _shapes_read_from_embeddings(proto, ids, lookup.output[0]):
        source = folder / "shapes_from_embeddings.onnx"
        onnx.save(proto, str(source))
    try:
        onnx.utils.extract_model(str(source), str(cut), cut_inputs, outputs, check_model=True)
    except Exception as exc:
        raise InputError(
            f"{display_path(path)}: cannot cut the graph after its embedding lookup {lookup.name!r} "
            f"({str(exc).splitlines()[0][:200]}); the ids may be used beyond the lookup"
        ) from exc
    return cut


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
