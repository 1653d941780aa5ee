"""ONNX graphs: checked, converted to torch for gradients and run by onnxruntime
(audit/inputs/onnx_loading.py). A token model is cut after the Gather of its embedding table by the
ids input; a worker receives the graph with its external data gathered into one file of
splitaudit's naming.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.model_format import ModelLoader, ModelRequest, WholeGraph
from splitaudit.inputs.onnx_loading import open_onnx
from splitaudit.inputs.raw_model import RawModel, first_line
from splitaudit.inputs.tokens import MaskSlot, require_mask_name

ONNX_INTEGER_TYPES = {2, 3, 4, 5, 6, 7, 12, 13}  # uint8, int8, uint16, int16, int32, int64, uint32, uint64


class OnnxGraph(ModelLoader):
    def detect(self, path: Path) -> bool:
        return path.suffix.lower() == ".onnx"

    def open_file(self, path: Path, device: torch.device, request: ModelRequest) -> RawModel:
        if request.mode == "train":
            raise InputError(
                "--model-mode train applies to TorchScript and torch modules; an ONNX graph runs as exported"
            )
        return open_onnx(path, device, request.output_name, request.mask_input)

    def from_embeddings(
        self, path: Path, device: torch.device, request: ModelRequest
    ) -> tuple[RawModel, torch.Tensor, MaskSlot | None]:
        return _onnx_from_embeddings(self, path, device, request.output_name)

    def files(self, path: Path) -> dict[str, bytes]:
        return onnx_files(path)

    def external_files(self, path: Path) -> list[str]:
        return onnx_external_locations(path)

    def whole_graph(self, path: Path, folder: Path) -> WholeGraph:
        return WholeGraph(path)


def onnx_external_locations(model: Path) -> list[str]:
    """The external data files an ONNX model's tensors name (data_location EXTERNAL), relative to the
    model's folder, each once, in the order first named: the files onnx.load reads besides the model."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    proto = onnx.load(str(model), load_external_data=False)
    locations: list[str] = []
    for tensor in filter(uses_external_data, _get_all_tensors(proto)):
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if location is not None and location not in locations:
            locations.append(location)
    return locations


def onnx_files(path: Path) -> dict[str, bytes]:
    """An ONNX model as files named by splitaudit: NAME, the graph, and (when some tensor is stored
    outside it) NAME.data, every such tensor's bytes one after the other, the graph pointing at
    them. The bytes are read only for the tensors onnx reads (data_location EXTERNAL; a location
    on a tensor stored inline is never opened) and by onnx's own reader, the one onnx.load and so
    the model loader use, with its checks: a relative location inside the model's folder, no
    symlink, a regular file, offset and length within it."""
    import onnx
    from onnx.external_data_helper import (
        _get_all_tensors,
        load_external_data_for_tensor,
        set_external_data,
        uses_external_data,
    )

    proto = onnx.load(str(path), load_external_data=False)
    data_name, data = f"{path.name}.data", bytearray()
    for tensor in filter(uses_external_data, _get_all_tensors(proto)):
        try:
            load_external_data_for_tensor(tensor, str(path.parent))
        except (onnx.checker.ValidationError, ValueError, OSError) as exc:
            raise InputError(
                f"{display_path(path)}: external data of tensor {tensor.name!r}: {first_line(exc)}"
            ) from exc
        set_external_data(tensor, data_name, offset=len(data), length=len(tensor.raw_data))
        data += tensor.raw_data
        tensor.ClearField("raw_data")
    return {path.name: proto.SerializeToString(), **({data_name: bytes(data)} if data else {})}


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


def _onnx_from_embeddings(
    loader: OnnxGraph, path: Path, device: torch.device, output_name
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
        require_mask_name(inputs[1].name, path)
        elem_type = inputs[1].type.tensor_type.elem_type
        slot = MaskSlot(torch.from_numpy(np.zeros(0, dtype=helper.tensor_dtype_to_np_dtype(elem_type))).dtype)
    table = torch.from_numpy(np.array(numpy_helper.to_array(weights[lookup.input[0]]), dtype=np.float32))
    outputs = [output_name] if output_name else [o.name for o in proto.graph.output][:1]
    cut_inputs = [lookup.output[0], *(i.name for i in inputs[1:])]
    with tempfile.TemporaryDirectory(prefix="splitaudit-tokens-") as scratch:  # read once by open_model
        cut = _cut_after_lookup(proto, path, Path(scratch), inputs[0].name, lookup, cut_inputs, outputs)
        raw = loader.open_file(cut, device, ModelRequest(output_name, mask_input=slot is not None))
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
