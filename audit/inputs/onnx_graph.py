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
nor onnxruntime reads them as a fixed size. A batch declared as a fixed number (most exporters
write [1, C, H, W] unless told otherwise) is made a symbol on a copy (symbolic_batch): whether the
graph computes the same at other batch sizes is then checked on real data
(splitaudit.inputs.model_checks.settle_static_batch).
"""

from __future__ import annotations

import contextlib
import io

import numpy as np

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


def symbolic_batch(proto, batch: int):
    """A copy of proto whose inputs and outputs declare their first dimension, where it is `batch`,
    as the symbol "batch", without the shapes declared for intermediate tensors (value_info: they
    carry the saved batch too, and shape inference recomputes them); None when no dimension was
    `batch`. The operators are left as they are: a Reshape to [1, -1] still makes one sample."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    weights = {init.name for init in copy.graph.initializer}
    changed = False
    for info in (*(i for i in copy.graph.input if i.name not in weights), *copy.graph.output):
        dims = info.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value == batch:
            dims[0].Clear()
            dims[0].dim_param = DYNAMIC_SYMBOLS[0]
            changed = True
    del copy.graph.value_info[:]
    return copy if changed else None


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


SHAPE_ONLY_OPS = {"Shape", "Size"}  # outputs that depend on their input's shape, not its values


def value_op_types(proto) -> set[str]:
    """The operator types that compute on the values of the graph's inputs: a node one of whose
    inputs does, except Shape and Size, whose outputs depend on the inputs' shapes only (so the
    Floor, Max or Clip of a size computed at run time is left out: it is no kink of the map from
    inputs to outputs). A node with subgraphs (If/Loop bodies) is taken with every operator in
    them, whatever its inputs: its bodies may read the inputs' values from the outer scope."""
    graph = proto.graph
    weights = {init.name for init in graph.initializer}
    dependent = {i.name for i in graph.input if i.name not in weights}
    found: set[str] = set()
    for node in graph.node:  # topologically sorted (ONNX requires it)
        bodies = _subgraphs(node)
        if bodies or (node.op_type not in SHAPE_ONLY_OPS and dependent.intersection(node.input)):
            found.add(node.op_type)
            found |= _every_op_type(bodies)
            dependent.update(node.output)
    return found


def _subgraphs(node) -> list:
    return [attr.g for attr in node.attribute if attr.HasField("g")] + [
        g for attr in node.attribute for g in attr.graphs
    ]


def _every_op_type(graphs: list) -> set[str]:
    found, pending = set(), list(graphs)
    while pending:
        for node in pending.pop().node:
            found.add(node.op_type)
            pending.extend(_subgraphs(node))
    return found


ML_DOMAIN = "ai.onnx.ml"


def standard_scalers(proto) -> None:
    """Rewrite ai.onnx.ml Scaler nodes, which skl2onnx writes for StandardScaler and MinMaxScaler
    and which no converter supports (the model then ran black-box), as Cast -> Sub -> Mul:
    Y = (float(X) - offset) * scale over the last axis. The converted module is still checked
    against onnxruntime's run of the original graph."""
    from onnx import TensorProto, helper, numpy_helper

    graph, nodes = proto.graph, []
    for node in graph.node:
        if node.op_type != "Scaler" or node.domain != ML_DOMAIN:
            nodes.append(node)
            continue
        attributes = {a.name: list(a.floats) for a in node.attribute}
        stem = f"{node.name or node.output[0]}_standard"
        for suffix, values in (("offset", attributes.get("offset", [0.0])), ("scale", attributes.get("scale", [1.0]))):
            graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.float32), f"{stem}_{suffix}"))
        nodes += [
            helper.make_node("Cast", [node.input[0]], [f"{stem}_x"], to=TensorProto.FLOAT),
            helper.make_node("Sub", [f"{stem}_x", f"{stem}_offset"], [f"{stem}_centred"]),
            helper.make_node("Mul", [f"{stem}_centred", f"{stem}_scale"], list(node.output)),
        ]
    if len(nodes) == len(graph.node):  # no Scaler
        return
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(n.domain == ML_DOMAIN for n in graph.node):
        kept = [o for o in proto.opset_import if o.domain != ML_DOMAIN]
        del proto.opset_import[:]
        proto.opset_import.extend(kept)


def straight_through(proto) -> bool:
    """Rewrite a quantized (QDQ) graph in place as the float model it quantizes: weights stored as
    integers behind a DequantizeLinear become float initializers ((q - zero_point) * scale, per
    tensor or per channel), and each QuantizeLinear -> DequantizeLinear pair on an activation is
    removed (the straight-through estimator). A quantized model's exact Jacobian is zero almost
    everywhere (its activations are rounded), which no Fisher information bound can use; the
    audit differentiates this function instead and reports how far it is from the quantized one.
    True when the graph had any pair or integer weight."""
    from onnx import numpy_helper

    graph = proto.graph
    weights = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    renamed: dict[str, str] = {}
    kept, folded = [], []
    for node in graph.node:
        attributes = {a.name: a for a in node.attribute}
        if node.op_type != "DequantizeLinear" or "block_size" in attributes:
            kept.append(node)
            continue
        source = producers.get(node.input[0])
        if node.input[0] in weights and all(name in weights for name in node.input[1:]):
            axis = attributes["axis"].i if "axis" in attributes else 1
            folded.append(numpy_helper.from_array(_dequantized(node, weights, axis), node.output[0]))
        elif source is not None and source.op_type == "QuantizeLinear":
            renamed[node.output[0]] = source.input[0]
        else:
            kept.append(node)
    if not folded and not renamed:
        return False
    for node in kept:
        for index, name in enumerate(node.input):
            node.input[index] = renamed.get(name, name)
    for output in graph.output:
        if output.name in renamed:  # a graph output that was a DequantizeLinear's: keep its name
            kept.append(_identity(renamed[output.name], output.name))
    used = {name for node in kept for name in node.input}
    kept = [n for n in kept if n.op_type != "QuantizeLinear" or any(o in used for o in n.output)]
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(folded)
    return True


def _dequantized(node, weights: dict, axis: int) -> np.ndarray:
    from onnx import numpy_helper

    values = numpy_helper.to_array(weights[node.input[0]]).astype(np.float32)
    scale = numpy_helper.to_array(weights[node.input[1]]).astype(np.float32)
    zero = numpy_helper.to_array(weights[node.input[2]]).astype(np.float32) if len(node.input) > 2 else np.zeros(1)
    if scale.ndim == 1 and scale.size > 1:  # per channel, along `axis`
        shape = [1] * values.ndim
        shape[axis] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape) if zero.size > 1 else zero
    return ((values - zero) * scale).astype(np.float32)


def _identity(source: str, target: str):
    from onnx import helper

    return helper.make_node("Identity", [source], [target])
