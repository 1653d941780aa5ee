"""Where a whole ONNX model can be split, and its two halves at a split.

A cut is a tensor that every path from the model's input to its output passes through (a dominator
of the output in the graph of tensors): the block boundaries of a ResNet, the residual stream
between transformer blocks, each layer of an MLP. A tensor inside a residual block is not one (the
skip path goes around it). Paths through Shape or Size carry the input's shape, never its values,
so they do not count (a dynamic-batch export reads the batch size off the input to reshape far
downstream); in the top half such a Shape is rewritten as the cut's batch size and the tensor's
static shape, which is what it computes.

At a cut the bottom is the graph from the input to the cut and the top the graph from the cut to
the output, both with the initializers they read; what the client pays is counted from the graph:
parameters, multiply-accumulates of Conv, ConvTranspose, MatMul and Gemm from the shapes of a
single-sample inference (onnx.shape_inference), and the bytes of the embedding it sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitaudit.core.errors import InputError
from splitaudit.core.safety import display_path

SHAPE_ONLY_OPS = {"Shape", "Size"}  # outputs that depend on the input's shape, never its values
COUNTED_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")  # the operators whose multiply-accumulates are counted
FLOAT_TYPES = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16: an embedding noise can be added to
BYTES_PER_VALUE = 4  # the embedding is sent as float32
ACTIVATION_BUDGET = 256 * 1024**2  # bytes of activations a batched run of the whole model may hold
MAX_BATCH = 256  # samples a batched run takes at most (small models: fewer, larger calls)


@dataclass(frozen=True)
class CutPoint:
    """A candidate cut: the tensor, the node that writes it, its place in the graph's order and
    per-sample shape, and what the client pays at it (bottom = input -> cut)."""

    name: str
    op: str
    depth: int  # index of the producing node in the graph's (topological) node order
    shape: list[int]
    params: int
    flops: int  # 2 x multiply-accumulates of the counted operators in the bottom
    bytes_sent: int


@dataclass
class WholeModel:
    """A whole model's graph with its single data input and the output audited."""

    proto: object  # onnx.ModelProto, external data loaded
    path: Path
    input_name: str
    output_name: str
    shapes: dict[str, list[int]]  # every tensor's per-sample shape (batch 1), where inference gives it
    elem_types: dict[str, int]
    macs: list[int]  # per node, in graph order
    format: str = "onnx"  # "exported": a torch.export program written as this graph


def load_whole_proto(path: Path, external_data: bool = True):
    """The ONNX graph of a whole model file (its external weights too unless `external_data` is False),
    checked; InputError for any other file (a TorchScript archive keeps no graph to cut) or one the ONNX
    checker refuses."""
    import onnx

    if path.suffix.lower() != ".onnx":
        raise InputError(
            f"{display_path(path)}: splitaudit cuts takes a whole model as ONNX (.onnx) or a torch.export program "
            "(.pt2): its graph is what is cut (export a torch model with torch.onnx.export)"
        )
    try:
        proto = onnx.load(str(path), load_external_data=external_data)
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise InputError(f"{display_path(path)} is not a valid ONNX model: {str(exc).splitlines()[0]}") from exc
    return proto


def open_whole_model(path: str | Path, sample_shape: tuple[int, ...], output_name: str | None = None) -> WholeModel:
    """The whole model at `path`, checked, with its tensors' shapes for one sample of `sample_shape`."""
    import onnx

    path = Path(path)
    proto = load_whole_proto(path)
    weights = {i.name for i in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in weights]
    if len(inputs) != 1:
        raise InputError(f"{display_path(path)} has {len(inputs)} data inputs ({', '.join(inputs)}); cuts takes one")
    outputs = [o.name for o in proto.graph.output]
    if output_name is not None and output_name not in outputs:
        raise InputError(f"--output-name {output_name!r} is not an output of the model: {', '.join(outputs)}")
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in proto.graph.node for a in n.attribute
    ):
        raise InputError(f"{display_path(path)} has If/Loop/Scan subgraphs: cuts of such graphs are not supported")
    shapes, types = _single_sample_shapes(proto, inputs[0], sample_shape)
    _probe_missing_shapes(proto, inputs[0], sample_shape, shapes, types)
    model = WholeModel(proto, path, inputs[0], output_name or outputs[0], shapes, types, [])
    model.macs = [_node_macs(node, shapes) for node in proto.graph.node]
    return model


def _single_sample_shapes(proto, input_name: str, sample_shape: tuple[int, ...]) -> tuple[dict, dict]:
    """Every tensor's shape and element type by onnx shape inference on a copy whose input is one sample."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    del copy.graph.value_info[:]
    for info in copy.graph.input:
        if info.name == input_name:
            dims = info.type.tensor_type.shape.dim
            if len(dims) != 1 + len(sample_shape):
                raise InputError(
                    f"the model's input {input_name!r} has {len(dims)} dimensions; the data's samples have shape "
                    f"{tuple(sample_shape)} (plus the batch)"
                )
            for dim, size in zip(dims, (1, *sample_shape)):
                dim.Clear()
                dim.dim_value = int(size)
    inferred = onnx.shape_inference.infer_shapes(copy, data_prop=True)
    shapes, types = {}, {}
    for info in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tensor = info.type.tensor_type
        types[info.name] = tensor.elem_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if tensor.HasField("shape") and all(d is not None for d in dims):
            shapes[info.name] = dims
    for init in proto.graph.initializer:
        shapes[init.name], types[init.name] = list(init.dims), init.data_type
    return shapes, types


def _probe_missing_shapes(proto, input_name: str, sample_shape: tuple, shapes: dict, types: dict) -> None:
    """Shapes that inference leaves unknown (reshapes computed at run time, as attention heads are),
    read off one run of the model on a zero sample with those tensors as outputs."""
    import onnx

    missing = [out for node in proto.graph.node for out in node.output if out and out not in shapes]
    if not missing:
        return
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    copy.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in missing)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(types[input_name])
    try:
        values = run_onnx(copy, np.zeros((1, *sample_shape), dtype=dtype), outputs=missing)
    except Exception as exc:  # onnxruntime raises its own types; the model is checked again when it is split
        raise InputError(f"the whole model does not run on one sample of shape {tuple(sample_shape)}: {exc}") from exc
    for name, value in zip(missing, values):
        shapes[name] = list(np.shape(value))
        types.setdefault(name, onnx.helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype))


def _node_macs(node, shapes: dict[str, list[int]]) -> int:
    """Multiply-accumulates of one Conv/ConvTranspose/MatMul/Gemm node for one sample (0 for others
    and where a shape is unknown)."""
    if node.op_type not in COUNTED_OPS or not node.output or node.output[0] not in shapes:
        return 0
    out = shapes[node.output[0]]
    first = shapes.get(node.input[0])
    second = shapes.get(node.input[1]) if len(node.input) > 1 else None
    if first is None or second is None:
        return 0
    if node.op_type == "Conv":  # weight [Cout, Cin/groups, k...]: each output value sums Cin/groups x k... products
        return math.prod(out) * math.prod(second[1:])
    if node.op_type == "ConvTranspose":  # each input value scatters into Cout/groups x k... outputs
        return math.prod(first) * math.prod(second[1:])
    if node.op_type == "Gemm":
        trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
        return math.prod(out) * (first[0] if trans_a else first[-1])
    return math.prod(out) * first[-1]  # MatMul: each output value sums over A's last axis


# --- candidates -------------------------------------------------------------------------------


def candidate_cuts(model: WholeModel) -> list[CutPoint]:
    """Every tensor that dominates the output (float, strictly between the input and the output),
    in graph order, each with what the client pays there."""
    nodes = list(model.proto.graph.node)
    order, idom, producer = _dominator_tree(model, nodes)
    if model.output_name not in idom:
        raise InputError(f"the model's output {model.output_name!r} does not depend on its input's values")
    chain, tensor = [], idom[model.output_name]
    while tensor != model.input_name:
        chain.append(tensor)
        tensor = idom[tensor]
    cuts = []
    for name in reversed(chain):
        if model.elem_types.get(name) not in FLOAT_TYPES or name not in model.shapes:
            continue
        bottom = bottom_nodes(nodes, name, model.input_name)
        cuts.append(
            CutPoint(
                name=name,
                op=nodes[producer[name]].op_type,
                depth=producer[name],
                shape=model.shapes[name][1:],
                params=_parameters(model.proto, [nodes[i] for i in bottom]),
                flops=2 * sum(model.macs[i] for i in bottom),
                bytes_sent=BYTES_PER_VALUE * math.prod(model.shapes[name][1:]),
            )
        )
    return cuts


def _dominator_tree(model: WholeModel, nodes: list) -> tuple[dict, dict, dict]:
    """Immediate dominators of the tensors that depend on the input's values (Cooper, Harvey and
    Kennedy's intersection, one pass: the node list is topologically sorted, as ONNX requires).
    Returns each tensor's order, immediate dominator and producing node index."""
    order, idom, producer = {model.input_name: 0}, {model.input_name: model.input_name}, {}

    def intersect(a: str, b: str) -> str:
        while a != b:
            while order[a] > order[b]:
                a = idom[a]
            while order[b] > order[a]:
                b = idom[b]
        return a

    for index, node in enumerate(nodes):
        if node.op_type in SHAPE_ONLY_OPS:
            continue
        preds = [name for name in node.input if name in idom]
        if not preds:
            continue
        dominator = preds[0]
        for pred in preds[1:]:
            dominator = intersect(pred, dominator)
        for out in node.output:
            if out:
                order[out], idom[out], producer[out] = len(order), dominator, index
    return order, idom, producer


def _parameters(proto, nodes: list) -> int:
    """Values of the float initializers and Constant tensors the nodes read (weights; integer
    constants are axes and shapes)."""
    read = {name for node in nodes for name in node.input}
    weights = [init for init in proto.graph.initializer if init.name in read]
    weights += [a.t for node in nodes if node.op_type == "Constant" for a in node.attribute if a.name == "value"]
    return int(sum(math.prod(t.dims) for t in weights if t.data_type in FLOAT_TYPES))


def total_parameters(proto) -> int:
    """The whole model's weights (float initializers and Constant tensors)."""
    return _parameters(proto, list(proto.graph.node))


def select_cuts(cuts: list[CutPoint], requested: list[str], default_count: int) -> list[CutPoint]:
    """The cuts asked for: tensor names (each must be a candidate), or one number N of candidates
    spread evenly over the graph's depth (default_count when nothing is asked for)."""
    if len(requested) == 1 and requested[0].strip().isdigit():
        return spread(cuts, int(requested[0]))
    if not requested:
        return spread(cuts, default_count)
    by_name = {c.name: c for c in cuts}
    unknown = [name for name in requested if name not in by_name]
    if unknown:
        listed = ", ".join(c.name for c in cuts) or "none"
        raise InputError(
            f"--cuts names {unknown[0]!r}, which is not a tensor every input-to-output path passes through; "
            f"the candidate cuts are: {listed}"
        )
    return sorted((by_name[n] for n in dict.fromkeys(requested)), key=lambda c: c.depth)


def spread(cuts: list[CutPoint], count: int) -> list[CutPoint]:
    """`count` candidates evenly spaced over the candidates' depth, always the first and the last."""
    if count < 1:
        raise InputError(f"--cuts {count}: ask for at least one cut")
    if count >= len(cuts):
        return list(cuts)
    if count == 1:
        return [cuts[len(cuts) // 2]]
    low, high = cuts[0].depth, cuts[-1].depth
    chosen: dict[str, CutPoint] = {}
    for k in range(count):
        goal = low + (high - low) * k / (count - 1)
        free = [c for c in cuts if c.name not in chosen]
        best = min(free, key=lambda c: (abs(c.depth - goal), c.depth))
        chosen[best.name] = best
    return sorted(chosen.values(), key=lambda c: c.depth)


# --- the two halves ---------------------------------------------------------------------------


def bottom_nodes(nodes: list, cut: str, input_name: str) -> list[int]:
    """Indices of the nodes the cut tensor is computed from (its ancestors), in graph order."""
    return _ancestors(nodes, [cut], stop={input_name})


def _ancestors(nodes: list, wanted: list[str], stop: set[str]) -> list[int]:
    writer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    needed, todo, seen = set(), list(wanted), set(stop)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in writer:
            needed.add(writer[name])
            todo.extend(n for n in nodes[writer[name]].input if n)
    return sorted(needed)


def split_at(model: WholeModel, cut: CutPoint) -> tuple[object, object]:
    """(bottom, top) ONNX models at the cut: input -> cut and cut -> output, each with the
    initializers it reads, the model's opsets and a symbolic batch."""
    import onnx

    nodes = list(model.proto.graph.node)
    bottom = [nodes[i] for i in bottom_nodes(nodes, cut.name, model.input_name)]
    top = [nodes[i] for i in _ancestors(nodes, [model.output_name], stop={cut.name})]
    top = _shapes_from_cut(top, model, cut)
    source_input = next(i for i in model.proto.graph.input if i.name == model.input_name)
    source_output = next(o for o in model.proto.graph.output if o.name == model.output_name)
    cut_info = onnx.helper.make_tensor_value_info(cut.name, model.elem_types[cut.name], ["batch", *cut.shape])
    return (
        _graph_model(model, bottom, source_input, cut_info, "bottom"),
        _graph_model(model, top, cut_info, source_output, "top"),
    )


def _shapes_from_cut(top: list, model: WholeModel, cut: CutPoint) -> list:
    """The top's nodes with each Shape of a tensor computed before the cut (the input's batch size, as
    dynamic-batch exports read it) replaced by the same shape: the cut's batch size and the tensor's
    static sizes. Any other tensor of the bottom half that the top reads makes the cut no cut."""
    import onnx

    computed = {cut.name} | {out for node in top for out in node.output}
    constants = {i.name for i in model.proto.graph.initializer}
    rewritten = []
    for node in top:
        outside = [n for n in node.input if n and n not in computed and n not in constants]
        if not outside:
            rewritten.append(node)
            continue
        if node.op_type != "Shape" or outside[0] not in model.shapes:
            raise InputError(
                f"cut {cut.name!r}: the top half reads {outside[0]!r} from before the cut (by {node.op_type}), so "
                "it is no cut"
            )
        rewritten += _batch_and_static_shape(node, model.shapes[outside[0]][1:], cut.name, onnx.helper)
    return rewritten


def _batch_and_static_shape(node, static: list[int], cut: str, helper) -> list:
    """Nodes computing what `node` (Shape of a tensor before the cut) computes: the cut's batch size
    followed by the tensor's static per-sample sizes, sliced by the Shape's start and end."""
    out = node.output[0]
    prefix = f"{out}__from_cut"
    made = [
        helper.make_node("Shape", [cut], [f"{prefix}_shape"]),
        helper.make_node("Constant", [], [f"{prefix}_zero"], value=helper.make_tensor("z", 7, [1], [0])),
        helper.make_node("Gather", [f"{prefix}_shape", f"{prefix}_zero"], [f"{prefix}_batch"], axis=0),
        helper.make_node("Constant", [], [f"{prefix}_rest"], value=helper.make_tensor("r", 7, [len(static)], static)),
    ]
    start = next((a.i for a in node.attribute if a.name == "start"), None)
    end = next((a.i for a in node.attribute if a.name == "end"), None)
    full = out if start is None and end is None else f"{prefix}_full"
    made.append(helper.make_node("Concat", [f"{prefix}_batch", f"{prefix}_rest"], [full], axis=0))
    if full != out:
        bounds = [start or 0, end if end is not None else 1 + len(static)]
        made += [
            helper.make_node("Constant", [], [f"{prefix}_starts"], value=helper.make_tensor("s", 7, [1], bounds[:1])),
            helper.make_node("Constant", [], [f"{prefix}_ends"], value=helper.make_tensor("e", 7, [1], bounds[1:])),
            helper.make_node("Slice", [full, f"{prefix}_starts", f"{prefix}_ends"], [out]),
        ]
    return made


def _graph_model(model: WholeModel, nodes: list, graph_input, graph_output, name: str):
    import onnx

    read = {n for node in nodes for n in node.input}
    initializers = [i for i in model.proto.graph.initializer if i.name in read]
    graph = onnx.helper.make_graph(
        nodes, f"{model.proto.graph.name or 'model'}_{name}", [graph_input], [graph_output], initializers
    )
    half = onnx.helper.make_model(graph, opset_imports=model.proto.opset_import, producer_name="splitaudit cuts")
    half.ir_version = model.proto.ir_version
    for entry in model.proto.metadata_props:
        half.metadata_props.add().CopyFrom(entry)
    return half


def run_onnx(proto, x: np.ndarray, outputs: list[str] | None = None, batch: int | None = None):
    """The model's first output on x (or the named outputs, as a list), by onnxruntime on the CPU;
    with `batch`, the first output computed `batch` samples at a time in one session, so memory
    holds one batch's activations (a 224 px ResNet's are tens of MB a sample)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    if outputs is not None:
        return session.run(outputs, {name: x})
    if batch is None or len(x) <= batch:
        return session.run(None, {name: x})[0]
    return np.concatenate([session.run(None, {name: x[i : i + batch]})[0] for i in range(0, len(x), batch)])


def samples_per_batch(model: WholeModel) -> int:
    """Samples of the whole model run at once within ACTIVATION_BUDGET: every tensor of one sample
    counted (an upper bound on what onnxruntime holds at a time), at least one sample."""
    weights = {i.name for i in model.proto.graph.initializer}
    per_sample = sum(math.prod(shape) for name, shape in model.shapes.items() if name not in weights)  # batch 1
    return max(1, min(MAX_BATCH, ACTIVATION_BUDGET // max(1, 4 * per_sample)))
