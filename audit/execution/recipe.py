"""What a worker process needs to rebuild the audit context, and the rebuilding.

Torch modules and onnxruntime sessions do not pickle; files and tensors do. A recipe carries the
options, the model files' bytes (with an ONNX model's external data) and the data already split
into aux and target, so a worker (a local process of `--workers N`, or a Ray worker) rebuilds
the same context as the parent's: same model, same split, hence the same numbers. The names the
worker writes are splitaudit's, never a name taken from inside a model file.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from splitaudit.context.audit_context import AuditContext, ContextSettings, build_context
from splitaudit.core.config import AuditOptions
from splitaudit.inputs.data import Dataset
from splitaudit.inputs.model_format import loader_for
from splitaudit.inputs.token_models import ModelSource, open_audited_model


class Recipe(Protocol):
    """What a worker rebuilds its tasks' common state from (an audit context, the cuts' whole model)."""

    device: str  # where the parent audits (--device): a Ray worker with a GPU rebuilds there
    scratch: str | None  # the folder the parent owns (and removes) for the workers' files; None: the system's

    def rebuild(self, device: str):
        """The state the tasks run on, in this process, on `device`."""


@dataclass
class ContextRecipe:
    """What a worker rebuilds an audit context from: how the model is opened, the context's settings,
    the model files' bytes by name and the split data (not the run's options: nothing else travels)."""

    source: ModelSource
    settings: ContextSettings
    device: str
    model_files: dict[str, bytes]
    top_model_files: dict[str, bytes]
    aux: Dataset
    target: Dataset
    scratch: str | None = None  # the folder the parent owns (and removes) for the workers' files; None: the system's

    def rebuild(self, device: str) -> AuditContext:
        return rebuild_context(self, device)


def model_files(path) -> dict[str, bytes]:
    """A model's files by name, as its format's loader ships them (nothing for no model, or for an
    in-memory torch module, which travels pickled in the recipe's ModelSource)."""
    if not isinstance(path, (str, Path)):
        return {}
    return loader_for(path).files(Path(path))


def make_recipe(options: AuditOptions, ctx: AuditContext) -> ContextRecipe:
    """The recipe of a prepared context (data on the CPU, so it pickles anywhere)."""
    return ContextRecipe(
        source=ModelSource.of(options),
        settings=ContextSettings.of(options),
        device=options.device,
        model_files=model_files(options.model),
        top_model_files=model_files(options.top_model),
        aux=ctx.aux.to("cpu"),
        target=ctx.target.to("cpu"),
    )


def rebuild_context(recipe: ContextRecipe, device: str) -> AuditContext:
    """The recipe's context in this process, on `device`: the model files are written to a
    private temporary folder, opened as the parent did, and removed as soon as the context holds
    them (a model copy never outlives its opening; the parent's scratch folder catches a worker
    killed mid-way)."""
    with tempfile.TemporaryDirectory(prefix="splitaudit-worker-", dir=recipe.scratch) as folder:
        return _open_copies(recipe, device, Path(folder))


def _open_copies(recipe: ContextRecipe, device: str, folder: Path) -> AuditContext:
    """Write the recipe's model files into `folder` and build the context from those copies."""
    from splitaudit.inputs.models import resolve_device

    for files in (recipe.model_files, recipe.top_model_files):
        for name, data in files.items():
            (folder / name).parent.mkdir(exist_ok=True)
            (folder / name).write_bytes(data)
    source = replace(recipe.source, model=_local_copy(recipe.source.model, folder))
    settings = replace(recipe.settings, top_model=_local_copy(recipe.settings.top_model, folder))
    resolved = resolve_device(device)
    return build_context(settings, open_audited_model(source, resolved), recipe.aux, recipe.target, resolved)


def _local_copy(model, folder: Path):
    """Where the worker wrote a model file (a torch module or None is used as it is)."""
    return str(folder / Path(model).name) if isinstance(model, (str, Path)) else model
