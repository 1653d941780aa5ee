"""A whole model saved as a torch.export program (.pt2), written as the ONNX graph that cuts are made in.

The archive is opened as `run` opens a .pt2 bottom (its bytes checked before torch reads them, the
program before anything runs it: splitaudit.inputs.exported_archive), then written by
torch.onnx.export, which names the graph's tensors after the FX nodes of the program as it
decomposes it (relu, relu_2, add_45: a torch user's names, not paths like /layer1/Relu_output_0). The ONNX graph is checked
against the program itself on the data before any cut is made.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import torch

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path
from splitaudit.inputs.exported_archive import check_exported_archive, check_program
from splitaudit.inputs.raw_model import first_line
from splitaudit.inputs.torch_archives import read_archive

CONVERSION_RTOL = 1e-4  # of the program's largest output: float32 kernels may order sums differently


def exported_as_onnx(path: Path, folder: Path):
    """(the ONNX file written in `folder`, the loaded program) for the .pt2 at `path`."""
    label = display_path(path)
    out = folder / "whole.onnx"
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            data = read_archive(path)
            check_exported_archive(data, label)  # before torch reads it
            program = torch.export.load(io.BytesIO(data))
            check_program(program, label)  # before anything runs it
            torch.onnx.export(program, (), str(out), dynamo=True, external_data=False, verbose=False)
    except InputError:
        raise
    except Exception as exc:  # torch raises anything from RuntimeError to KeyError on a bad archive or graph
        raise InputError(
            f"{label}: cannot write the torch.export program as an ONNX graph to cut ({first_line(exc)}); export "
            "the whole model with torch.onnx.export instead"
        ) from exc
    return out, program


def check_conversion(program, onnx_output: np.ndarray, x: np.ndarray) -> float:
    """The largest |ONNX graph - program| on x; InputError past CONVERSION_RTOL of the program's largest output."""
    with torch.no_grad():
        expected = program.module()(torch.from_numpy(x))
    expected = (expected[0] if isinstance(expected, (tuple, list)) else expected).double().numpy()
    error = float(np.max(np.abs(onnx_output - expected))) if expected.size else 0.0
    tolerance = CONVERSION_RTOL * max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1.0)
    if onnx_output.shape != expected.shape or not error <= tolerance:
        raise InputError(
            f"the torch.export program written as ONNX differs from the program by {error:.3g} (tolerance "
            f"{tolerance:.3g}): its graph cannot be cut faithfully; export the whole model with torch.onnx.export"
        )
    return error
