"""What splitaudit accepts in a .pt2 archive (torch.export.save), checked before torch.export.load
reads it, and what it accepts in the program torch then builds, checked before the program runs.

What torch.export.load (torch 2.13: torch/export/pt2_archive/_package.py and
torch/_export/serde/serialize.py) would otherwise do with a crafted archive:
- unpickle the sample inputs with weights_only=False when the safe load fails, and weights or
  constants marked use_pickle always; unpickle opaque_obj_ constants with pickle.loads;
- load AOTInductor shared libraries from data/aotinductor/ (their constructors run);
- evaluate every symbolic-shape expression (expr_str) with sympy.sympify, that is with eval;
- import any module named by a pytree spec (a defaultdict's factory, an enum in a context);
- exec the program's guards_code when .module() builds the callable;
- call whatever the graph's nodes name: any torch.* callable, aten.from_file (creates files), ...
So the archive holds exactly the members of one torch.export.save'd program, tensors as raw bytes
within their records, expressions and specs in a closed grammar, no guards code, and every node
calls an aten operator (file operators excepted) or an arithmetic builtin on sizes.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re

import torch

from splitaudit.core.errors import InputError
from splitaudit.inputs.raw_model import first_line
from splitaudit.inputs.torch_archives import FILE_OPERATORS, Archive, Layout, check_tensor_pickle

ADVICE = "save the model with torch.export.save(torch.export.export(model, (x,)), path)"
UNPICKLED = "a Python object constant, which loading would unpickle (export a model whose constants are tensors)"
PT2 = Layout(
    what="torch.export program",
    members={
        "format": r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id",
        "program": r"models/model\.json",
        "sample inputs": r"data/sample_inputs/model\.pt",
        "weights config": r"data/weights/model_weights_config\.json",
        "weight": r"data/weights/weight_\d+",
        "constants config": r"data/constants/model_constants_config\.json",
        "constant": r"data/constants/tensor_\d+",
        "extra": r"extra/[\w.-]+",  # torch.export.save(extra_files=...): read as text, never run
    },
    advice=ADVICE,
    refused=(
        (r"data/aotinductor/.*", "an AOTInductor payload (a compiled shared library, which loading would run)"),
        (r"data/constants/(custom|opaque)_obj_.*", UNPICKLED),
        (r"(data/weights|data/constants)/[^/]*\.pt", "a legacy weights file, which loading would unpickle"),
    ),
)
PAYLOADS = (  # config member, folder of its payloads, name torch gives each payload
    ("data/weights/model_weights_config.json", "data/weights/", r"weight_\d+"),
    ("data/constants/model_constants_config.json", "data/constants/", r"tensor_\d+"),
)
SIZE_FUNCTIONS = {  # what a program computes on symbolic sizes (torch's _SYM_OPS and getitem)
    operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.neg, operator.pos, operator.eq, operator.ne, operator.le, operator.ge, operator.lt, operator.gt,
    operator.and_, operator.or_, operator.not_, operator.abs, math.ceil, math.floor, math.trunc, torch.sym_int,
    torch.sym_float, torch.sym_ite, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sum,
}  # fmt: skip
SIZE_OPERATORS = {f"{function.__module__}.{function.__name__}" for function in SIZE_FUNCTIONS}  # _operator.mul
ATEN_TARGET = re.compile(r"torch\.ops\.aten\.(?!__)(\w+)\.(?!_)(\w+)")
# sympy constructors and torch's size functions an expr_str may call: no powers or left shifts (a
# tiny string could ask for a number of 10^9 digits), nothing that is not a number or a symbol.
EXPRESSION_FUNCTIONS = {
    "Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Mod", "Max", "Min", "Abs", "floor", "ceiling",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan",
    "LessThan", "GreaterThan", "And", "Or", "Not", "FloorDiv", "ModularIndexing", "Where", "PythonMod",
    "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "RShift", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat",
    "Identity",
}  # fmt: skip
EXPRESSION_NAMES = {"oo", "zoo", "nan", "true", "false"}
EXPRESSION_OPERATORS = (
    ast.Expression, ast.Call, ast.Name, ast.Load, ast.Constant, ast.keyword, ast.UnaryOp, ast.USub, ast.UAdd,
    ast.Not, ast.Invert, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.BitAnd,
    ast.BitOr, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.BoolOp, ast.And, ast.Or,
)  # fmt: skip
SYMBOL = re.compile(r"[a-z]+\d{1,6}")  # s77, u0, zuf3: torch's shape symbols
NUMBER = re.compile(r"[-+]?\d{1,30}(\.\d{0,30})?([eE][-+]?\d{1,4})?")  # Float('1.5', precision=53)
SPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict",
              "collections.namedtuple"}  # fmt: skip


def check_exported_archive(data: bytes, label: str) -> None:
    """Refuse a .pt2 that holds anything torch.export.load would run, import or unpickle (see the
    module's docstring), before torch reads it."""
    archive = Archive(data, label, PT2)
    for required in ("archive_format", "models/model.json", "data/sample_inputs/model.pt"):
        if required not in archive.kinds:
            raise InputError(f"{label} has no {required}, so it is no torch.export program; {ADVICE}")
    check_tensor_pickle(archive.read("data/sample_inputs/model.pt"), f"{label}: data/sample_inputs/model.pt")
    for config, folder, payload in PAYLOADS:
        if config in archive.kinds:
            _check_payloads(archive, config, folder, payload)
    check_program_document(_json(archive, "models/model.json"), label)


def check_program_document(document: dict, label: str) -> None:
    """Refuse a serialized program (models/model.json) with guards code, an expression outside the
    grammar, a pytree spec that imports, a symbol counter beyond reason, or a node that calls
    anything but an aten operator or a size builtin."""
    if not isinstance(document, dict):
        raise InputError(f"{label}: models/model.json is no serialized program; {ADVICE}")
    if document.get("guards_code"):
        raise InputError(f"{label}: the program carries guards code, which building its module would exec; {ADVICE}")
    for symbol in document.get("range_constraints") or {}:
        if not SYMBOL.fullmatch(str(symbol)):
            raise InputError(f"{label}: the program constrains '{symbol}', which is no shape symbol torch writes")
    for key, value in _json_items(document):
        if key == "target" and isinstance(value, str):
            _check_target_name(value, label)
        elif key == "as_operator":
            _check_target_name(str(value), label)
        elif key == "expr_str":
            check_expression(str(value), label)
        elif key in ("in_spec", "out_spec") and value is not None:
            _check_spec(str(value), label)


def check_program(program, label: str) -> None:
    """Refuse a loaded program any of whose graphs (nested ones included) calls anything but an aten
    operator (file operators excepted) or a size builtin: what runs when the model runs."""
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for target in [node.target for node in module.graph.nodes if node.op == "call_function"]:
            if not _runs(target):
                raise InputError(f"{label}: the program calls {target}, which is not an aten operator splitaudit runs")


def _runs(target) -> bool:
    """Whether splitaudit runs a graph node that calls `target`."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target._schema.name not in FILE_OPERATORS
    return target in SIZE_FUNCTIONS


def check_expression(text: str, label: str) -> None:
    """Refuse a symbolic-shape expression outside a closed grammar (numbers, shape symbols, the
    sympy and torch size functions, arithmetic and comparisons): torch reads it with sympy.sympify,
    which evals the string. Strings stand only as the name of a Symbol or the digits of a Float."""
    try:
        nodes = list(ast.walk(ast.parse(text, mode="eval")))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise InputError(f"{label}: shape expression '{text[:80]}' does not parse ({first_line(exc)})") from exc
    names = {id(node.args[0]) for node in nodes if _names_itself(node)}
    for node in nodes:
        if not isinstance(node, EXPRESSION_OPERATORS) or id(node) not in names and not _expression_part_allowed(node):
            raise InputError(
                f"{label}: shape expression '{text[:80]}' holds {type(node).__name__} "
                f"{ast.unparse(node)[:60] if isinstance(node, ast.expr) else ''}, outside the expressions torch "
                "writes (torch would eval it)"
            )


def _names_itself(node: ast.AST) -> bool:
    """Symbol('s77', ...) or Float('1.5', ...): a call whose first argument is a string of its kind."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
        return False
    pattern = {"Symbol": SYMBOL, "Float": NUMBER}.get(node.func.id)
    first = node.args[0]
    return pattern is not None and isinstance(first, ast.Constant) and pattern.fullmatch(str(first.value)) is not None


def _expression_part_allowed(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return (
            isinstance(node.func, ast.Name)
            and node.func.id in EXPRESSION_FUNCTIONS
            and all(k.arg is not None and isinstance(k.value, ast.Constant) for k in node.keywords)
        )
    if isinstance(node, ast.Name):
        return node.id in EXPRESSION_NAMES or node.id in EXPRESSION_FUNCTIONS or SYMBOL.fullmatch(node.id) is not None
    if isinstance(node, ast.Constant):
        value = node.value
        return isinstance(value, (bool, float)) or isinstance(value, int) and abs(value) < 2**63
    return True


def _check_target_name(target: str, label: str) -> None:
    aten = ATEN_TARGET.fullmatch(target)
    if aten and f"aten::{aten.group(1)}" not in FILE_OPERATORS or target in SIZE_OPERATORS:
        return
    raise InputError(
        f"{label}: a node of the program calls {target}, which is not an aten operator splitaudit runs "
        "(file operators, higher-order operators and other callables are refused)"
    )


def _check_spec(text: str, label: str) -> None:
    """Refuse a pytree spec (a program's input or output structure) whose types or contexts would
    make torch import a module: a defaultdict's factory, an enum in a context."""
    try:
        _, root = json.loads(text)
        pending = [root]
        while pending:
            spec = pending.pop()
            context = json.loads(spec["context"]) if isinstance(spec["context"], str) else None
            if any(key == "__enum__" for key, _ in _json_items(context)):
                raise InputError(f"{label}: a pytree context of the program names an enum, which loading would import")
            if spec["type"] not in SPEC_TYPES:
                raise InputError(
                    f"{label}: the program's inputs or outputs are a {spec['type']}, which splitaudit does not read"
                )
            pending.extend(spec["children_spec"])
    except InputError:
        raise
    except Exception as exc:  # malformed JSON or a spec without its keys
        raise InputError(f"{label}: the program's input or output structure is unreadable ({first_line(exc)})") from exc


def _check_payloads(archive: Archive, config: str, folder: str, payload: str) -> None:
    """Each weight or constant the config lists: a raw tensor record that holds all the bytes its
    sizes and strides reach (torch would allocate the declared size of an empty record), or a
    pickled tensor that passes check_tensor_pickle; anything else is refused."""
    document = _json(archive, config)
    entries = document.get("config") if isinstance(document, dict) else None
    if not isinstance(entries, dict):
        raise InputError(f"{archive.label}: {config} lists no tensors")
    for fqn, meta in entries.items():
        path_name = str(meta.get("path_name")) if isinstance(meta, dict) else ""
        member = folder + path_name
        if re.match(r"(custom|opaque)_obj_", path_name, re.IGNORECASE):
            raise InputError(f"{archive.label}: {fqn} is {UNPICKLED}")
        if not re.fullmatch(payload, path_name) or member not in archive.kinds:
            raise InputError(
                f"{archive.label}: {config} names '{path_name}' for {fqn}, which is no tensor in the archive"
            )
        if meta.get("use_pickle"):
            check_tensor_pickle(archive.read(member), f"{archive.label}: {member}")
        else:
            _check_extent(meta.get("tensor_meta"), archive.sizes[member], f"{archive.label}: {member}")


def _check_extent(meta, record_bytes: int, label: str) -> None:
    """Refuse tensor metadata that reaches past its record (or that is not plain integers)."""
    from torch._export.serde.serialize import deserialize_scalar_type

    try:
        sizes, strides = ([d["as_int"] for d in meta[key]] for key in ("sizes", "strides"))
        offset = meta["storage_offset"]["as_int"]
        itemsize = deserialize_scalar_type(meta["dtype"]).itemsize
        numbers = [*sizes, *strides, offset]
        if not all(isinstance(n, int) and 0 <= n < 2**62 for n in numbers) or len(sizes) != len(strides):
            raise ValueError("sizes, strides and offset must be non-negative integers")
    except Exception as exc:
        raise InputError(f"{label}: its tensor metadata is unreadable ({first_line(exc)})") from exc
    extent = 0 if 0 in sizes else offset + 1 + sum((s - 1) * t for s, t in zip(sizes, strides))
    if extent * itemsize > record_bytes:
        raise InputError(
            f"{label}: its tensor needs {extent * itemsize} bytes but the record holds {record_bytes}; {ADVICE}"
        )


def _json(archive: Archive, name: str):
    try:
        return json.loads(archive.read(name))
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{archive.label}: {name} is not JSON ({first_line(exc)})") from exc


def _json_items(document):
    """Every (key, value) of every object in a JSON document, without recursion."""
    pending = [document]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.values())
            yield from value.items()
        elif isinstance(value, list):
            pending.extend(value)
