"""The Python API: `splitaudit.audit(model, aux, ...)` for notebooks and scripts.

It takes an in-memory torch module or a model file, and arrays, tensors or data paths, runs the
same pipeline as `splitaudit run` (the CLI calls `run` below), and returns an `AuditResult`:
the report.json content with ways to render and save it.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable

from splitaudit.attacks import check_attack_request
from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.core.options import option_spec
from splitaudit.core.registries import DEFAULT_FORMATS, check_formats


class AuditResult:
    """A finished audit: `.data` is the result (report.json's content, a splitaudit.core.result.Result)."""

    def __init__(self, data: dict) -> None:
        self.data = data

    @property
    def passed(self) -> bool:
        """Whether every gate check passed (as the gate decided it)."""
        return bool(self.data["gate"]["passed"])

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def to_json(self) -> str:
        """report.json's text: strict JSON, non-finite numbers as "inf"/"-inf"/"nan"."""
        from splitaudit.reports.files import to_strict_json

        return json.dumps(to_strict_json(self.data), indent=2, allow_nan=False)

    def to_html(self) -> str:
        """The full self-contained HTML report, as `splitaudit run` writes it."""
        from splitaudit.reports.writer import render_html

        return render_html(self.data)

    def write(self, out_dir: str | Path, formats: tuple[str, ...] | list[str] = DEFAULT_FORMATS) -> list[Path]:
        """Write report.json/.html/.md (and .sarif, .junit.xml when asked) into out_dir; returns the paths."""
        from splitaudit.reports import write_reports

        check_formats(list(formats), "report")
        return write_reports(self.data, Path(out_dir), list(formats))

    def _repr_html_(self) -> str:
        """The verdict, summary and attacks table, for Jupyter."""
        from splitaudit.reports.writer import render_summary_html

        return render_summary_html(self.data)

    def __repr__(self) -> str:
        from splitaudit.reports.view_verdict import headline

        return f"<AuditResult {self.data['model']['path']}: {headline(self.data)}>"


def audit(
    model: Any,
    aux: Any,
    target: Any = None,
    attacks: str | list[str] = "all",
    noise_sigma: float = 0.0,
    *,
    progress: bool = False,
    **options: Any,
) -> AuditResult:
    """Audit a bottom model and return the result.

    model: a torch.nn.Module (copied, left unchanged) or a .onnx / TorchScript file.
    aux, target: an array or tensor of samples, a tuple (x, y) or (x, y, attr), a dict with
    keys x, y, attr (and mask: the attention mask [N, T] of token ids, with vocab), or a path
    (.npz, .csv, image folder). Without target, aux is split 50/50.
    attacks: "all", "none", a comma string or a list of names. workers: processes for the attacks
    (None: one per CPU core); executor "ray" runs them on Ray (ray_address: an existing cluster);
    task_timeout: seconds one attack seed may run. output_name: which output of a multi-output
    ONNX model is the embedding. top_model_role: "classifier" (top_model ends in the class scores)
    or "body" (the server's part g of U-shaped split learning). dfil_rtol, dfil_samples: the dFIL
    estimate's target relative error and its sample cap. model_mode: "saved" (as the module is now),
    "eval" or "train"; queries: how many queries of one input a query-access attacker averages (stochastic models).
    vocab: a vocabulary file declaring that x holds token ids [N, T] of a model file over ids
    (split LLMs). The keywords are `splitaudit run`'s options but those that say how reports are
    written (out, formats, junit: see AuditResult.write), with the same defaults: this signature is
    made from the option table (config.AuditOptions), as the CLI's flags are.
    Bad input raises splitaudit.core.errors.InputError.
    """
    unknown = sorted(set(options) - set(API_KEYWORDS))
    if unknown:
        raise TypeError(f"audit() got unexpected keyword(s) {', '.join(unknown)}; it takes {', '.join(API_KEYWORDS)}")
    if options.get("top_model") is not None:
        options["top_model"] = _model_source(options["top_model"])
    if options.get("attack_options") is None:
        options.pop("attack_options", None)
    chosen = AuditOptions(
        model=_model_source(model),
        aux=_data_source(aux, "aux"),
        target=_data_source(target, "target"),
        attacks=_attack_names(attacks),
        noise_sigma=noise_sigma,
        **options,
    ).validate()
    check_attack_request(chosen.attacks, chosen.attack_options)
    return run(chosen, progress=_stderr_progress if progress else None)


POSITIONAL = ("model", "aux", "target", "attacks", "noise_sigma")
# audit()'s keywords: the options of the table that the API takes, with their defaults
# (attack_options: None for none).
API_KEYWORDS = {
    f.name: None if f.name == "attack_options" else (f.default_factory() if f.default is MISSING else f.default)
    for f in fields(AuditOptions)
    if option_spec(f).api and f.name not in POSITIONAL
}
TYPES = {f.name: f.type for f in fields(AuditOptions)}
_parameters = list(inspect.signature(audit).parameters.values())
audit.__signature__ = inspect.Signature(
    [
        *_parameters[: len(POSITIONAL)],
        *(
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=TYPES[n])
            for n, d in API_KEYWORDS.items()
        ),
        _parameters[len(POSITIONAL)],  # progress
    ],
    return_annotation=AuditResult,
)


def run(
    options: AuditOptions,
    progress: Callable | None = None,
    on_cost: Callable | None = None,
    invocation=None,
    baseline: dict | None = None,
    on_notice: Callable | None = None,
) -> AuditResult:
    """Run the audit that validated `options` describe (the CLI's and audit()'s one code path); invocation
    (splitaudit.engine.provenance.Invocation) says how the CLI was called, baseline is the earlier
    report run --baseline compares with (splitaudit.reports.compare.read_baseline); on_notice gets
    the line that says why the model runs slower than it could, if it does."""
    from splitaudit.context.audit_context import silent_progress
    from splitaudit.engine.pipeline import run_audit

    progress = progress or silent_progress
    return AuditResult(
        run_audit(options, progress, on_cost=on_cost, invocation=invocation, baseline=baseline, on_notice=on_notice)
    )


def _stderr_progress(**kwargs):
    from tqdm import tqdm

    return tqdm(leave=False, **kwargs)


def _model_source(model: Any) -> Any:
    """A path as a string; a torch module as it is (opened by splitaudit.inputs.models.open_model)."""
    if isinstance(model, (str, Path)):
        return str(model)
    import torch.nn as nn

    if isinstance(model, nn.Module):
        return model
    raise InputError(
        f"model must be a torch.nn.Module or a path to a .onnx/TorchScript file, got {type(model).__name__}"
    )


def _attack_names(attacks: Any) -> list:
    """ "all", "none", a comma string or a list of names (each checked by attacks.check_attack_request)."""
    if isinstance(attacks, str):
        return attacks.split(",")
    if not isinstance(attacks, (list, tuple)):
        raise InputError(f'attacks must be "all", "none", a comma string or a list of names, got {attacks!r:.60}')
    return list(attacks)


def _data_source(data: Any, name: str) -> Any:
    """A path as a string; arrays, tensors, (x, y[, attr]) or {x, y, attr, mask} as an in-memory Dataset."""
    if data is None or isinstance(data, (str, Path)):
        return None if data is None else str(data)
    if isinstance(data, dict):
        unknown = set(data) - {"x", "y", "attr", "mask"}
        if "x" not in data or unknown:
            raise InputError(f"{name} as a dict takes keys x, y, attr, mask (x required); got {sorted(data)}")
        return _in_memory(name, data["x"], data.get("y"), data.get("attr"), data.get("mask"))
    if isinstance(data, tuple):
        if not 1 <= len(data) <= 3:
            raise InputError(f"{name} as a tuple is (x,), (x, y) or (x, y, attr); got {len(data)} items")
        return _in_memory(name, *data)
    return _in_memory(name, data)


def _in_memory(name: str, x: Any, y: Any = None, attr: Any = None, mask: Any = None) -> Any:
    """The arrays as a Dataset; InputError for a tensor without readable data (on the meta device,
    sparse) or a nested list that is no array (ragged rows)."""
    import torch

    from splitaudit.inputs.data import dataset_from_arrays

    for part, value in (("x", x), ("y", y), ("attr", attr), ("mask", mask)):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise InputError(f"{name} {part} is a tensor on the meta device: it holds no data to audit")
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            raise InputError(f"{name} {part} is a {value.layout} tensor; pass a dense one (.to_dense())")
    try:
        return dataset_from_arrays(x, y, attr, source=f"<in-memory {name}>", mask=mask)
    except (ValueError, TypeError) as exc:  # numpy's words for a ragged or non-numeric nesting
        raise InputError(f"{name} is not an array of samples: {exc}") from exc
