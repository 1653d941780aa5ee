"""What splitaudit accepts in a TorchScript archive (torch.jit.save), checked before torch.jit.load
reads it, and which operators the loaded module may call, checked before it runs.

torch.jit.load unpickles data.pkl and constants.pkl with torch's C++ unpickler (torch 2.13:
torch/csrc/jit/serialization/unpickler.cpp, Unpickler::readGlobal). It imports no Python: the
globals it can reach are a fixed set (torch._utils._rebuild_tensor_v2/_rebuild_qtensor/
_rebuild_sparse_tensor, torch._tensor._rebuild_from_type_v2, torch.jit._pickle.build_*/
restore_type_tag, collections.OrderedDict, builtins.complex, torch.device, torch.*Storage, torch's
qschemes, torch.distributed.rpc.rref), and any other name is resolved as a TorchScript class
compiled from the archive's code/ folder (os.system, builtins.eval: "unknown type"). But a class
with __setstate__ has that method run while it is unpickled, and TorchScript code may call any
registered operator: aten::save writes a file anywhere, aten::from_file creates or reads one. So:
the archive holds only torch.jit.save's members, spelled as torch writes them; its pickles refer
only to the names above that torch.jit.save writes and to the archive's own __torch__ classes; no
class defines __setstate__; and once loaded, no method or hook calls anything but aten, prim and
quantized operators, file operators excepted.
"""

from __future__ import annotations

import ast

import torch

from splitaudit.core.errors import InputError
from splitaudit.inputs.raw_model import first_line
from splitaudit.inputs.torch_archives import FILE_OPERATORS, STORAGE_GLOBAL, Archive, Layout, check_pickle

ADVICE = "save the model with torch.jit.trace(...).save() or torch.jit.script(...).save()"
TORCHSCRIPT = Layout(
    what="TorchScript model",
    members={
        "format": r"version|byteorder|\.data/version|\.data/serialization_id",
        "pickle": r"data\.pkl|constants\.pkl|traced_inputs\.pkl",
        "tensor": r"(data|constants|traced_inputs)/\d+",
        "code": r"code/[\w/]+\.py",
        "debug info": r"code/[\w/]+\.py\.debug_pkl",  # source ranges: pickles, read by the same unpickler
        "extra": r"extra/[\w.-]+",  # torch.jit.save(_extra_files=...): read only when asked for
    },
    advice=ADVICE,
)
# The names torch.jit.save writes, which the C++ unpickler rebuilds itself.
SCRIPT_GLOBALS = {
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "collections.OrderedDict",
    "builtins.complex",
    "torch.device",
    "torch.jit._pickle.restore_type_tag",
    "torch.jit._pickle.build_intlist",
    "torch.jit._pickle.build_tensorlist",
    "torch.jit._pickle.build_doublelist",
    "torch.jit._pickle.build_boollist",
    "torch.jit._pickle.build_tensor_from_id",
    *(f"torch.{scheme}" for scheme in ("per_tensor_affine", "per_channel_affine", "per_tensor_symmetric",
                                       "per_channel_symmetric", "per_channel_affine_float_qparams")),
}  # fmt: skip
OPERATOR_NAMESPACES = {"aten", "prim", "quantized"}
UNSEEN_CALLS = {"prim::CallFunction", "prim::CallMethod"}  # left after inlining: a callee no check saw


def is_script_global(name: str) -> bool:
    """A name the archive's pickles may refer to: one torch.jit.save writes for tensors and
    containers, or a TorchScript class of the archive itself (__torch__.*), torch's own bound C++
    classes only for quantized packed weights."""
    module = name.rsplit(".", 1)[0]
    if module.startswith("__torch__.torch.classes."):
        return module == "__torch__.torch.classes.quantized"
    return name in SCRIPT_GLOBALS or STORAGE_GLOBAL.fullmatch(name) is not None or module.split(".")[0] == "__torch__"


def check_torchscript_archive(data: bytes, label: str) -> None:
    """Refuse a TorchScript archive with members torch.jit.save does not write, pickles that refer
    to other names than is_script_global's, or TorchScript that runs while the archive is loaded."""
    archive = Archive(data, label, TORCHSCRIPT)
    for name in [*archive.named("pickle"), *archive.named("debug info")]:
        check_pickle(archive, name, is_script_global, "torch.jit.load")
    for name in archive.named("code"):
        _check_no_setstate(archive.read(name), f"{label}: {name}")


def _check_no_setstate(source: bytes, label: str) -> None:
    """Refuse TorchScript source that defines __setstate__: torch.jit.load runs it as it unpickles
    the object, before splitaudit could look at what it calls."""
    try:
        tree = ast.parse(source.decode("utf-8"))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise InputError(
            f"{label} is not TorchScript source splitaudit can read ({first_line(exc)}); {ADVICE}"
        ) from exc
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__setstate__":
            raise InputError(
                f"{label} defines __setstate__, TorchScript that torch.jit.load would run while loading the model "
                "(it could write or read files); splitaudit loads models without one"
            )


def check_operators(module: torch.jit.ScriptModule, label: str) -> None:
    """Refuse a loaded TorchScript module any of whose methods or hooks (every submodule's, inlined)
    calls an operator outside aten, prim and quantized, a file operator, or a callee left un-inlined."""
    for graph in _method_graphs(module):
        for node in graph_nodes(graph):
            kind = node.kind()
            if kind.split("::")[0] not in OPERATOR_NAMESPACES or kind in FILE_OPERATORS | UNSEEN_CALLS:
                raise InputError(f"{label} calls {kind}, which is not an operator splitaudit runs; {ADVICE}")


def _method_graphs(module: torch.jit.ScriptModule):
    for submodule in module.modules():
        methods = [submodule._c._get_method(name) for name in submodule._c._method_names()]
        hooks = [*submodule._c._get_forward_hooks(), *submodule._c._get_forward_pre_hooks()]
        for function in methods + hooks:
            graph = function.graph.copy()
            torch._C._jit_pass_inline(graph)
            yield graph


def graph_nodes(graph):
    """Every node of a TorchScript graph, those inside control-flow blocks (prim::If, prim::Loop) included."""
    pending = [graph]
    while pending:
        for node in pending.pop().nodes():
            yield node
            pending.extend(node.blocks())
