"""The options are declared once, in the option table (config.AuditOptions, each field with its
OptionSpec): the click options of `run`, `sweep` and `calibrate` and the keywords of
splitaudit.audit() are made from it. These tests check what the generation must give: the CLI,
the API and the config file accept the same set of options (but as the table says), with the
same defaults, and each value reaches AuditOptions under its own name. Run options and attack
options are one system (splitaudit.core.options): one declaration, one check, one rule in words."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from splitaudit.api import audit
from splitaudit.cli import cli, main
from splitaudit.core.config import CALIBRATE, CLI_CONTROLS, CUTS, HINTS, RUN, SWEEP, AuditOptions, load_config
from splitaudit.core.errors import InputError
from splitaudit.core.options import checked, option, option_rule, option_spec

FIELDS = {f.name: f for f in fields(AuditOptions)}
COMMAND_OWN = {RUN: set(), SWEEP: set(), CALIBRATE: {"as_json"}, CUTS: set()}  # flags a command adds for itself


def _default(name: str):
    f = FIELDS[name]
    return f.default_factory() if f.default is MISSING else f.default


def _taken_by(command: str) -> set[str]:
    return {name for name, f in FIELDS.items() if command in option_spec(f).commands}


@pytest.mark.parametrize("command", [RUN, SWEEP, CALIBRATE, CUTS])
def test_each_command_takes_the_options_the_table_gives_it(command):
    params = {p.name for p in cli.commands[command].params} - {"model"}
    controls = set(CLI_CONTROLS) if command != CALIBRATE else set(CLI_CONTROLS) - {"attack_option"}
    assert params == _taken_by(command) | controls | COMMAND_OWN[command]
    # run, sweep and cuts together take every option but the model (an argument) and the file's own
    taken = _taken_by(RUN) | _taken_by(SWEEP) | _taken_by(CUTS)
    assert set(FIELDS) - taken == {"model", "target_fraction", "attack_options"}


def test_the_api_takes_the_table_s_keywords_with_their_defaults():
    signature = inspect.signature(audit).parameters
    keywords = set(signature) - {"progress"}
    assert keywords == {name for name, f in FIELDS.items() if option_spec(f).api}
    for name in keywords - {"model", "aux", "attacks", "attack_options"}:
        assert signature[name].default == _default(name), name
    assert signature["attacks"].default == "all" and _default("attacks") == ["all"]
    assert signature["attack_options"].default is None and _default("attack_options") == {}
    with pytest.raises(TypeError, match="unexpected keyword.*formats"):
        audit("model.onnx", "aux.npz", formats=["html"])


def test_the_config_file_takes_every_option_and_nothing_else(tmp_path):
    """Each field of the table is a key of the TOML file (attack options as [attack.NAME])."""
    values = {name: _default(name) for name in FIELDS if _default(name) is not None}
    values["model"], values["aux"] = "m.onnx", "a.npz"
    values["attack_options"] = {}
    lines = [f"{k} = {_toml(v)}" for k, v in values.items() if k != "attack_options"]
    path = tmp_path / "c.toml"
    path.write_text("\n".join(lines) + "\n[attack.sdar]\nablation = true\n")
    loaded = load_config(path)
    assert set(loaded) == (set(values) - {"attack_options"}) | {"attack_options"}
    path.write_text("nosie_sigma = 0.1\n")
    with pytest.raises(Exception, match="unknown keys: nosie_sigma"):
        load_config(path)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def test_every_flag_reaches_its_option(tmp_path, monkeypatch, capsys):
    """Each generated flag of `run` sets the option of its own name: a value other than the default
    for every flag, read back from the AuditOptions that the audit is given."""
    from splitaudit import api

    seen = {}

    def stop(options, **_):
        seen["options"] = options  # what the audit would run, then no audit
        raise SystemExit(0)

    monkeypatch.setattr(api, "run", stop)
    monkeypatch.setattr("splitaudit.reports.mlflow_log.require_mlflow", lambda uri: None)  # no store is opened here
    shutil.copy(Path(__file__).parent / "fixtures" / "image_audit.json", tmp_path / "old.json")  # --baseline reads it
    flags = {
        "aux": "a.npz",
        "target": "t.npz",
        "attacks": "decoder",
        "noise_sigma": "0.5",
        "prior": "dsm",
        "smoothing": "0.1",
        "top_model": "top.onnx",
        "top_model_role": "body",
        "input_shape": "1,8,8",
        "normalize": "0.5,0.25",
        "label_column": "label",
        "attr_column": "attr",
        "out": str(tmp_path / "o"),
        "formats": "html",
        "fail_under_mse": "0.01",
        "fail_under_attack_mse": "0.02",
        "max_advantage": "0.3",
        "junit": str(tmp_path / "j.xml"),
        "baseline": str(tmp_path / "old.json"),
        "mlflow": None,
        "mlflow_uri": "file:///mlruns",
        "strict": None,
        "seed": "7",
        "device": "cpu",
        "quick": None,
        "vocab": "v.json",
        "split_layer": "2",
        "max_length": "64",
        "output_name": "z",
        "executor": "ray",
        "ray_address": "auto",
        "task_timeout": "60",
        "dfil_rtol": "0.05",
        "dfil_samples": "128",
        "model_mode": "eval",
        "queries": "4",
    }
    assert set(flags) | {"workers"} == _taken_by(RUN)  # workers: ray takes none (checked by validate)
    argv = ["run", "m.onnx"]
    for name, value in flags.items():
        flag = option_spec(FIELDS[name]).flag or f"--{name.replace('_', '-')}"
        argv += [flag] if value is None else [flag, value]
    with pytest.raises(SystemExit):
        main(argv)
    options = seen["options"]
    assert options.model == "m.onnx" and options.quick is True
    for name in flags:
        assert getattr(options, name) != _default(name), name


def test_audit_passes_each_keyword_through(monkeypatch):
    """Each keyword reaches AuditOptions under its own name (a keyword taken but not passed on
    would be ignored): every option is given a value other than its default and read back. audit()
    validates its options, which refuses workers with the Ray executor: workers goes in a call of
    its own."""
    from splitaudit import api

    seen = {}
    monkeypatch.setattr(api, "run", lambda options, progress=None: seen.update(options=options))
    values = {
        "target_fraction": 0.3,
        "top_model": "top.onnx",
        "top_model_role": "body",
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
        "strict": True,
        "attack_options": {"sdar": {"ablation": True}},
        "seed": 7,
        "device": "cpu",
        "quick": True,
        "executor": "ray",
        "ray_address": "auto",
        "task_timeout": 60.0,
        "output_name": "z",
        "split_layer": 2,
        "max_length": 64,
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
    audit("model.onnx", "aux.npz", workers=2)
    assert seen["options"].workers == 2 != _default("workers")
    api_options = {name for name, f in FIELDS.items() if option_spec(f).api}
    assert set(values) | {"model", "aux", "target", "attacks", "noise_sigma", "workers"} == api_options


@dataclasses.dataclass
class Toy:
    """Options of both kinds declared with the one option(...): a run-option-style field (a flag of
    `run`, an API keyword) and an attack-option-style one (its table only)."""

    scale: float = option(0.0, "a noise scale", commands=frozenset({RUN}), scale=True, high=10)
    steps: tuple[int, ...] | None = option(None, "step counts", low=1)


TOY = {f.name: f for f in dataclasses.fields(Toy)}
TOY_HINTS = typing.get_type_hints(Toy)


@pytest.mark.parametrize(
    "name, value, stored",
    [("scale", 0, 0.0), ("scale", 2, 2.0), ("steps", [3, 4], (3, 4)), ("steps", 5, (5,)), ("steps", None, None)],
)
def test_the_one_checker_keeps_a_fitting_value_as_the_option_stores_it(name, value, stored):
    kept = checked(name, TOY[name], TOY_HINTS[name], value)
    assert kept == stored and type(kept) is type(stored)


@pytest.mark.parametrize(
    "name, value, shown",
    [
        ("scale", 1e-20, "1e-20"),  # below MIN_SCALE but not 0: underflows float32 when squared
        ("scale", float("nan"), "nan"),
        ("scale", True, "True"),  # a bool is never a number
        ("scale", "1", "'1'"),
        ("scale", None, "None"),  # not declared X | None
        ("steps", [2, 0], "0"),  # the offending item of a list
        ("steps", [2.0], "2.0"),
    ],
)
def test_the_one_checker_refuses_in_the_rule_s_words_whichever_kind_of_option(name, value, shown):
    """A run option and an attack option are refused with the same rule (option_rule), each
    family naming the option its own way: the flag, or `attack option NAME.KEY`."""
    rule = option_rule(TOY[name], TOY_HINTS[name])
    for label in (f"--{name}", f"attack option toy.{name}"):
        with pytest.raises(InputError) as refused:
            checked(label, TOY[name], TOY_HINTS[name], value)
        assert str(refused.value) == f"{label} must be {rule}, got {shown}"


def test_the_rule_in_words_states_the_declared_limits():
    assert option_rule(TOY["scale"], TOY_HINTS["scale"]) == "0 or a number >= 1e-12 and <= 10"
    assert option_rule(TOY["steps"], TOY_HINTS["steps"]) == "a list of integers >= 1 and <= 2147483647"


def test_run_options_and_attack_options_are_checked_by_the_one_checker():
    from splitaudit.attacks import attack_class

    with pytest.raises(InputError) as run_refusal:
        AuditOptions(model="m.onnx", aux="a.npz", queries=0).validate()
    with pytest.raises(InputError) as attack_refusal:
        attack_class("decoder").parse_options({"patience": 0})
    assert str(run_refusal.value) == "--queries must be an integer >= 1 and <= 1000, got 0"
    assert (
        str(attack_refusal.value) == "attack option decoder.patience must be an integer >= 1 and <= 2147483647, got 0"
    )


def _numeric(hint) -> bool:
    """Whether an option annotated `hint` holds numbers (int, float, X | None, list[X])."""
    return hint in (int, float) or any(_numeric(arg) for arg in typing.get_args(hint))


def test_every_numeric_option_declares_its_limits():
    """Every number a run option takes is declared with a lower and an upper limit: one added
    without them would let nan-free but absurd values (1e308, -5) reach an estimator."""
    numeric = {name for name, hint in HINTS.items() if _numeric(hint)}
    assert {"noise_sigma", "noise_sigmas", "seed", "input_shape", "workers"} <= numeric
    for name in numeric:
        spec = option_spec(FIELDS[name])
        assert spec.scale or spec.low is not None or spec.above is not None, f"{name} has no lower limit"
        assert spec.high is not None or spec.below is not None, f"{name} has no upper limit"
