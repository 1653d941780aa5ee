"""Turn ONNX graphs as exporters really write them into graphs the converters take.

Exporters other than torch's write graphs that onnxruntime runs but the torch converters refuse:
Paddle2ONNX stores every weight as a Constant node (0 initializers; onnx2pytorch then builds a
Conv2d without its weight), older exporters list initializers as graph inputs, torch's legacy
exporter reads deduplicated weights through Identity nodes, and shapes computed at run time
(Shape/Gather/Concat into Reshape) hide constant weights from converters that need them. onnxslim
(a kept graph optimiser) folds all of these into initializers and constant shapes; the converted
module is used only after it matches onnxruntime on real data (splitaudit.inputs.model_checks.check_parity), so a
clean-up that changed the function would be caught there.

Dynamic dimensions are declared in three ways: a symbol (dim_param), or the numbers -1 (Paddle2ONNX,
some tf2onnx graphs) and 0; the last two are rewritten as symbols here so that neither splitaudit
nor onnxruntime reads them as a fixed size.
"""

from __future__ import annotations

import contextlib
import io

DYNAMIC_SYMBOLS = ("batch", "dim")


def declare_dynamic_dims(proto) -> bool:
    """Rewrite input and output dimensions declared as -1 or 0 as symbols; True when any was."""
    changed = False
    for info in (*proto.graph.input, *proto.graph.output):
        for axis, dim in enumerate(info.type.tensor_type.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value <= 0:
                dim.Clear()
                dim.dim_param = DYNAMIC_SYMBOLS[0] if axis == 0 else f"{DYNAMIC_SYMBOLS[1]}{axis}"
                changed = True
    return changed


def drop_initializer_inputs(proto) -> None:
    """Remove initializers from the graph inputs (IR < 4 graphs list every weight as an input too,
    a default the caller could override; splitaudit feeds only the data input, so they are constants)."""
    weights = {init.name for init in proto.graph.initializer}
    keep = [i for i in proto.graph.input if i.name not in weights]
    del proto.graph.input[:]
    proto.graph.input.extend(keep)


def slimmed(proto, size_limit: int):
    """(onnxslim's clean copy of proto, None): initializers dropped from the inputs, Constant
    nodes and constant subgraphs folded into initializers; or (that copy without the folding, reason) when
    onnxslim fails. Constants over size_limit bytes are not folded (a hostile graph could ask for
    a huge one); onnxslim's progress output is kept off the terminal."""
    import onnx
    import onnxslim

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    drop_initializer_inputs(copy)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return onnxslim.slim(copy, size_threshold=size_limit), None
    except Exception as exc:  # onnxslim raises whatever its passes raise
        return copy, f"onnxslim could not clean the graph ({type(exc).__name__}: {str(exc)[:200]})"


def op_types(proto) -> set[str]:
    """The operator types in the graph and in its subgraphs (If/Loop bodies)."""
    found: set[str] = set()
    graphs = [proto.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            found.add(node.op_type)
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.HasField("g") else [])
                graphs.extend(attr.graphs)
    return found
