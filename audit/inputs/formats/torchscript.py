"""TorchScript archives (torch.jit.save): the archive passes an allow-list before torch reads it and
its operators after torch compiled it, before anything runs it (audit/inputs/torchscript_loading.py).
A token model is cut after the `aten::embedding` on its ids input: its inlined graph is rewritten to
take the embeddings (and its attention mask, bound per call in a MaskSlot) instead.
"""

from __future__ import annotations

import copy
import warnings
import zipfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.model_format import ModelLoader, ModelRequest
from splitaudit.inputs.raw_model import RawModel, select_output
from splitaudit.inputs.tokens import MaskSlot, require_mask_name
from splitaudit.inputs.torchscript_loading import TORCHSCRIPT_SUFFIXES, open_torchscript, returned_outputs


class TorchScriptArchive(ModelLoader):
    def detect(self, path: Path) -> bool:
        return path.is_file() and (path.suffix.lower() in TORCHSCRIPT_SUFFIXES or zipfile.is_zipfile(path))

    def open_file(self, path: Path, device: torch.device, request: ModelRequest) -> RawModel:
        return open_torchscript(path, device, request.mode, request.mask_input, request.output_name)

    def from_embeddings(
        self, path: Path, device: torch.device, request: ModelRequest
    ) -> tuple[RawModel, torch.Tensor, MaskSlot | None]:
        raw = self.open_file(path, device, replace(request, mask_input=True))
        module, table = _torchscript_from_embeddings(raw.scripted, path)
        returns = returned_outputs(raw.scripted.forward.schema.returns[0].type)  # open_file noted which is audited
        audited = select_output(module, returns, request.output_name, path)[0]
        return replace(raw, torch_module=audited, notes=list(raw.notes)), table, module.slot


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
    require_mask_name(value.debugName().split(".")[0], path)
    dtype = getattr(value.type(), "dtype", lambda: None)()
    return dtype if dtype is not None else torch.long


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
