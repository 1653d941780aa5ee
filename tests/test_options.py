"""The options are declared once, in AuditOptions: `splitaudit run` and `sweep` take every field as
a flag, and splitaudit.audit() as a keyword with the same default, but for the exceptions
splitaudit.config names (a missing flag or keyword would silently fall back to a default)."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields

import pytest

from splitaudit.api import audit
from splitaudit.cli import cli
from splitaudit.config import CLI_CONTROLS, NOT_IN_API, NOT_ON_CLI, RUN_ONLY, SWEEP_ONLY, AuditOptions

FIELDS = {f.name: f for f in fields(AuditOptions)}


def _default(name: str):
    f = FIELDS[name]
    return f.default_factory() if f.default is MISSING else f.default


@pytest.mark.parametrize("command, excluded", [("run", SWEEP_ONLY), ("sweep", RUN_ONLY)])
def test_each_command_takes_every_option_it_should(command, excluded):
    params = {p.name for p in cli.commands[command].params}
    assert params - set(FIELDS) == set(CLI_CONTROLS), "a flag that sets no option"
    assert set(FIELDS) - params == set(excluded) | set(NOT_ON_CLI), "an option the command cannot set"


def test_the_api_takes_every_option_with_its_default():
    signature = inspect.signature(audit).parameters
    keywords = set(signature) - {"progress"}
    assert keywords == set(FIELDS) - set(NOT_IN_API)
    for name in keywords - {"model", "aux", "attacks", "attack_options"}:
        assert signature[name].default == _default(name), name
    assert signature["attacks"].default == "all" and _default("attacks") == ["all"]
    assert signature["attack_options"].default is None and _default("attack_options") == {}


def test_the_exceptions_name_real_options():
    for group in (SWEEP_ONLY, RUN_ONLY, NOT_ON_CLI, NOT_IN_API):
        assert set(group) <= set(FIELDS)


def test_audit_passes_each_keyword_through(monkeypatch):
    """Each keyword reaches AuditOptions under its own name (a keyword taken but not passed on
    would be ignored): every option is given a value other than its default and read back."""
    from splitaudit import api

    seen = {}
    monkeypatch.setattr(api, "run", lambda options, progress=None: seen.setdefault("options", options))
    values = {
        "target_fraction": 0.3,
        "top_model": "top.onnx",
        "prior": "dsm",
        "smoothing": 0.1,
        "input_shape": [1, 8, 8],
        "normalize": [0.5, 0.25],
        "label_column": "label",
        "attr_column": "attr",
        "vocab": "vocab.json",
        "fail_under_mse": 0.01,
        "fail_under_attack_mse": 0.02,
        "max_advantage": 0.3,
        "attack_options": {"sdar": {"ablation": True}},
        "seed": 7,
        "device": "cpu",
        "quick": True,
        "workers": 2,
        "executor": "ray",
        "ray_address": "auto",
        "task_timeout": 60.0,
        "output_name": "z",
        "dfil_rtol": 0.05,
        "dfil_samples": 128,
        "model_mode": "eval",
        "queries": 4,
    }
    audit("model.onnx", "aux.npz", "target.npz", "decoder,kmeans", 0.5, **values)
    options = seen["options"]
    assert (options.model, options.aux, options.target) == ("model.onnx", "aux.npz", "target.npz")
    assert options.attacks == ["decoder", "kmeans"] and options.noise_sigma == 0.5
    for name, value in values.items():
        assert value != _default(name), f"{name}: pick a value other than the default"
        assert getattr(options, name) == value, name
    assert set(values) | {"model", "aux", "target", "attacks", "noise_sigma"} == set(FIELDS) - set(NOT_IN_API)
