"""torch.export programs (.pt2): the archive's bytes are checked before torch reads them and the
program before anything runs it (audit/inputs/exported_archive.py); `splitaudit cuts` writes a whole
program as the ONNX graph it cuts (audit/inputs/exported_whole.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from splitaudit.inputs.exported_loading import is_exported_archive, open_exported
from splitaudit.inputs.exported_whole import check_conversion, exported_as_onnx
from splitaudit.inputs.model_format import ModelLoader, ModelRequest, WholeGraph
from splitaudit.inputs.raw_model import RawModel


class ExportedProgram(ModelLoader):
    def detect(self, path: Path) -> bool:
        return path.is_file() and is_exported_archive(path)

    def open_file(self, path: Path, device: torch.device, request: ModelRequest) -> RawModel:
        return open_exported(path, device, request.mode, request.output_name)

    def whole_graph(self, path: Path, folder: Path) -> WholeGraph:
        graph, program = exported_as_onnx(path, folder)
        return WholeGraph(graph, lambda x, graph_output: check_conversion(program, graph_output, x))
