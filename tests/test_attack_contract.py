"""One conformance suite every registered attack passes (like scikit-learn's check_estimator):
it describes itself, declares its needs and the input kinds it is built for, runs on a tiny
context of every kind it declares and fills the metrics that fit that kind, skips the other
kinds and inputs that lack what it needs with a reason, is reproducible for a fixed seed, handles
noisy embeddings and checks its options before running. It reads the registry, so a new attack
is checked without editing this file.

The fast checks run on tiny synthetic contexts of each input kind (images 1 x 8 x 8 in [0, 1],
sequences 2 x 16, tabular rows of 8 features, sentences of 4 tokens; 3 classes, a binary
attribute, a one-layer encoder written here) with every attack's options turned down to a few
steps; the other checks run on the attack's home kind (tabular, or tokens for a token-only
attack). Only the check on a real image model is slow."""

from __future__ import annotations

import dataclasses
import json
import math
import typing

import pytest
import torch
import torch.nn as nn
from conftest import sample

from splitaudit.attacks import REGISTRY, attack_class, attack_names, get_attack
from splitaudit.attacks.base import NEEDS, Attack, SeedOutcome, orphan_quick_options, resolve_quick
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.errors import InputError
from splitaudit.core.input_space import INPUT_KINDS, KIND_METRICS
from splitaudit.core.options import option, option_rule, option_spec
from splitaudit.core.plateau import STOPPED_BY_CAP
from splitaudit.core.result import default_baseline_name
from splitaudit.inputs.data import Dataset
from splitaudit.inputs.models import prepare_encoder, wrap_module
from splitaudit.inputs.tokens import TokenSpace

# Each attack turned down to seconds on the tiny context (keys must be its declared options).
TINY_OPTIONS = {
    "fine-tune": {"k": [3], "epochs": 5},
    "decoder": {"quick_epochs": 3},
    "optimization": {"quick_steps": 5, "quick_samples": 8},
    "sdar": {"iterations": 4, "batch_size": 16},
    "token-inversion": {"quick_epochs": 3, "hidden": 16},
}


def synthetic_part(n: int, generator: torch.Generator) -> Dataset:
    """n samples of 8 features whose mean depends on the class; the attribute follows feature 0."""
    y = torch.arange(n) % 3
    x = torch.randn(n, 8, generator=generator) * 0.5 + y[:, None].float()
    return Dataset(x=x, y=y, attr=(x[:, 0] > x[:, 0].median()).long())


def shaped_part(n: int, generator: torch.Generator, shape: tuple[int, ...], unit_range: bool) -> Dataset:
    """n samples of `shape` whose level depends on the class (squashed into [0, 1] for images);
    the attribute follows the first value."""
    y = torch.arange(n) % 3
    x = torch.randn(n, *shape, generator=generator) * 0.5 + y.reshape(-1, *[1] * len(shape)).float()
    x = torch.sigmoid(x - 1) if unit_range else x
    first = x.flatten(1)[:, 0]
    return Dataset(x=x, y=y, attr=(first > first.median()).long())


def shaped_ctx(shape: tuple[int, ...], bottom: nn.Module, unit_range: bool = False) -> AuditContext:
    """A tiny context over samples of `shape` and the bottom model given."""
    generator = torch.Generator().manual_seed(0)
    aux, target = (shaped_part(48, generator, shape, unit_range) for _ in range(2))
    encoder = prepare_encoder(wrap_module(bottom, torch.device("cpu")), aux.x)
    return AuditContext(encoder=encoder, aux=aux, target=target, quick=True, attack_options=TINY_OPTIONS)


@pytest.fixture(scope="module")
def plain_ctx() -> AuditContext:
    generator = torch.Generator().manual_seed(0)
    aux, target = synthetic_part(48, generator), synthetic_part(48, generator)
    torch.manual_seed(0)
    encoder = prepare_encoder(wrap_module(nn.Sequential(nn.Linear(8, 6), nn.Tanh()), torch.device("cpu")), aux.x)
    return AuditContext(encoder=encoder, aux=aux, target=target, quick=True, attack_options=TINY_OPTIONS)


@pytest.fixture(scope="module")
def image_ctx() -> AuditContext:
    """Grey 8 x 8 images in [0, 1] through a strided conv to a 2 x 4 x 4 map."""
    torch.manual_seed(0)
    return shaped_ctx((1, 8, 8), nn.Sequential(nn.Conv2d(1, 2, 3, stride=2, padding=1), nn.Tanh()), unit_range=True)


@pytest.fixture(scope="module")
def sequence_ctx() -> AuditContext:
    """Two channels over 16 steps through a strided 1-D conv to a 3 x 8 map."""
    torch.manual_seed(0)
    return shaped_ctx((2, 16), nn.Sequential(nn.Conv1d(2, 3, 3, stride=2, padding=1), nn.Tanh()))


def token_part(n: int, table: torch.Tensor, generator: torch.Generator, vocab: int) -> Dataset:
    """n sentences of 4 token ids below vocab, as embeddings with their ids; labels follow the first token."""
    ids = torch.randint(0, vocab, (n, 4), generator=generator)
    return Dataset(x=table[ids], y=ids[:, 0] % 3, attr=(ids[:, 1] >= 6).long(), token_ids=ids)


@pytest.fixture(scope="module")
def token_ctx() -> AuditContext:
    """Token inputs: 12 tokens of dimension 3, a per-position encoder from embeddings [4, 3]."""
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(12, 3, generator=generator)
    # token 11 never occurs in the aux part: a rare token (in < 1% of aux sentences) of the targets
    aux, target = token_part(48, table, generator, 11), token_part(48, table, generator, 12)
    torch.manual_seed(0)
    encoder = prepare_encoder(wrap_module(nn.Sequential(nn.Linear(3, 5), nn.Tanh()), torch.device("cpu")), aux.x)
    tokens = TokenSpace(table, [f"t{i}" for i in range(12)])
    return AuditContext(encoder=encoder, aux=aux, target=target, quick=True, attack_options=TINY_OPTIONS, tokens=tokens)


@pytest.fixture(scope="module")
def kind_ctx(image_ctx, sequence_ctx, plain_ctx, token_ctx) -> dict[str, AuditContext]:
    """The tiny context of each input kind."""
    contexts = {"image": image_ctx, "sequence": sequence_ctx, "tabular": plain_ctx, "tokens": token_ctx}
    assert {kind: ctx.space.kind for kind, ctx in contexts.items()} == {kind: kind for kind in INPUT_KINDS}
    return contexts


def home_kind(name: str) -> str:
    """The kind the checks that need one context run an attack on: tabular, else its first kind."""
    kinds = attack_class(name).input_kinds
    return "tabular" if "tabular" in kinds else next(k for k in INPUT_KINDS if k in kinds)


DECLARED = [(name, kind) for name in attack_names() for kind in INPUT_KINDS if kind in attack_class(name).input_kinds]
UNDECLARED = [
    (name, kind) for name in attack_names() for kind in INPUT_KINDS if kind not in attack_class(name).input_kinds
]


@pytest.fixture
def tiny_ctx(request, kind_ctx) -> AuditContext:
    """The tiny context of the test's attack's home kind."""
    return kind_ctx[home_kind(request.node.callspec.params["name"])]


@pytest.fixture(scope="module")
def kind_runs(kind_ctx) -> dict[tuple[str, str], dict]:
    """Every attack's result entry on every kind it declares (each run once per module)."""
    return {(name, kind): get_attack(name).run(kind_ctx[kind]) for name, kind in DECLARED}


@pytest.fixture(scope="module")
def first_runs(kind_runs) -> dict[str, dict]:
    return {name: kind_runs[name, home_kind(name)] for name in attack_names()}


@pytest.mark.parametrize("name", attack_names())
def test_attack_describes_itself(name):
    attack = attack_class(name)
    assert attack.name == name and REGISTRY[name][1] == attack.__name__
    assert attack.kind in {"label", "reconstruction"}
    label_metric = "token_accuracy" if attack.input_kinds == {"tokens"} else "accuracy"
    assert attack.primary_metric == ("mse" if attack.kind == "reconstruction" else label_metric)
    assert attack.primary_metric in attack.metrics
    assert set(attack.needs) <= NEEDS
    assert attack.input_kinds and set(attack.input_kinds) <= set(INPUT_KINDS)
    assert len(attack.title) > 5 and len(attack.assumptions) > 20, "the report shows both"
    assert attack.kind == "reconstruction" or attack.baseline_name, "a label attack names its baseline"
    assert attack.__doc__, "the class says what the attack does"
    # The report renders from the result alone: the words travel in every entry, skipped ones too.
    entry = attack().skipped("not asked for")
    assert entry["title"] == attack.title and entry["baseline_name"] == (
        attack.baseline_name or default_baseline_name(attack.kind)
    )
    assert entry.get("query_access_reference", "") in ("", *attack_names())
    assert entry.get("query_access_reference") != name, "an attack is not its own reference"
    for metric, words in attack.series.items():
        assert metric in attack.metrics and "_by_" in metric and set(words) == {"title", "key", "axis", "value"}


def test_tiny_options_name_declared_options():
    for name, table in TINY_OPTIONS.items():
        assert set(table) <= attack_class(name).option_names()


@pytest.mark.parametrize("name", attack_names())
def test_attack_runs_fills_its_metrics_and_is_reproducible(name, tiny_ctx, first_runs):
    first, second = first_runs[name], get_attack(name).run(tiny_ctx)
    assert first["status"] == "ok", first.get("reason")
    assert first["primary_metric"] in first["baseline"]
    assert math.isfinite(first["advantage"]) and first["seconds"] > 0
    json.dumps(first)  # report.json must be able to hold it
    assert flat(first["metrics"]) == pytest.approx(flat(second["metrics"]), rel=1e-5, abs=1e-6), (
        "same seed, same result"
    )


@pytest.mark.parametrize("name, kind", DECLARED)
def test_attack_runs_on_each_input_kind_it_declares_and_fills_the_metrics_that_fit(name, kind, kind_runs, kind_ctx):
    """Every declared metric but those of other kinds is filled; a reconstruction attack adds the
    metrics that fit the kind (SSIM on images, text metrics on tokens) to its metrics and baseline,
    and no metric fits a kind it was not made for (no SSIM on a sequence)."""
    entry, space = kind_runs[name, kind], kind_ctx[kind].space
    assert entry["status"] == "ok", entry.get("reason")
    attack = attack_class(name)
    assert set(attack.metrics) - space.leaves_out(attack.metrics) <= set(entry["metrics"])
    if attack.kind == "reconstruction":
        assert space.metrics <= set(entry["metrics"]) and space.metrics <= set(entry["baseline"])
    assert not set(entry["metrics"]) & space.leaves_out(KIND_METRICS["image"] | KIND_METRICS["tokens"])
    assert math.isfinite(entry["metrics"][entry["primary_metric"]]) and math.isfinite(entry["advantage"])
    json.dumps(entry)


@pytest.mark.parametrize("name, kind", UNDECLARED)
def test_attack_skips_an_input_kind_it_does_not_declare_with_a_reason(name, kind, kind_ctx):
    attack = get_attack(name)
    entry = attack.run(kind_ctx[kind])
    assert entry["status"] == "skipped"
    assert entry["reason"].startswith(attack.other_kinds_reason or f"not built for {kind} inputs")


def flat(metrics: dict, prefix: str = "") -> dict:
    """Nested metric dicts (e.g. accuracy_by_k) as one flat dict, for approximate comparison."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("name", attack_names())
def test_attack_handles_noisy_embeddings(name, tiny_ctx):
    entry = get_attack(name).run(dataclasses.replace(tiny_ctx, noise_sigma=5.0))
    assert entry["status"] == "ok", entry.get("reason")
    assert math.isfinite(entry["metrics"][entry["primary_metric"]])


@pytest.mark.parametrize("name", attack_names())
def test_attack_skips_with_a_reason_when_inputs_lack_what_it_needs(name, tiny_ctx):
    unlabelled = dataclasses.replace(
        tiny_ctx,
        aux=dataclasses.replace(tiny_ctx.aux, y=None, attr=None),
        target=dataclasses.replace(tiny_ctx.target, y=None, attr=None),
    )
    attack = get_attack(name)
    entry = attack.run(unlabelled)
    if attack.needs & {"labels", "attribute"}:
        assert entry["status"] == "skipped" and entry["reason"]
    else:
        assert entry["status"] == "ok", entry.get("reason")


@pytest.mark.parametrize("name", attack_names())
def test_gradient_attacks_skip_black_box_models(name, tiny_ctx):
    blackbox = dataclasses.replace(tiny_ctx, encoder=dataclasses.replace(tiny_ctx.encoder, torch_fn=None))
    attack = get_attack(name)
    assert (attack.missing(blackbox) is not None) == ("gradients" in attack.needs)


def bad_value(spec: dataclasses.Field, hint) -> object:
    """A value outside what the option declares: a wrong choice, a number below its range, or a
    value of the wrong type."""
    declared = option_spec(spec)
    if declared.choices:
        return "no-such-choice"
    for key, step in (("low", -1), ("above", 0), ("below", 0), ("high", 1)):
        if getattr(declared, key) is not None:
            return getattr(declared, key) + step
    return "not-a-" + str(hint)


@pytest.mark.parametrize("name", attack_names())
def test_every_quick_option_names_the_option_it_replaces(name):
    """quick_X is X's value under --quick: a quick_X without X would silently set nothing."""
    assert orphan_quick_options(attack_class(name).Options) == []


@dataclasses.dataclass(frozen=True)
class QuickDeclared:
    epochs: int = option(200, "epoch cap", low=1)
    quick_epochs: int = option(15, "epoch cap under --quick", low=1)
    lr: float = option(0.1, "step", above=0)


@dataclasses.dataclass(frozen=True)
class QuickWithoutItsOption:
    quick_steps: int = option(5, "steps under --quick", low=1)
    quick_epochs: int = option(15, "epoch cap under --quick", low=1)
    epochs: int = option(200, "epoch cap", low=1)


def test_a_quick_option_without_its_option_is_a_declaration_error():
    assert orphan_quick_options(QuickWithoutItsOption) == ["quick_steps"]
    assert orphan_quick_options(QuickDeclared) == []


def test_quick_runs_take_the_quick_value_and_keep_the_quick_field():
    declared = QuickDeclared(epochs=50, quick_epochs=4)
    assert resolve_quick(declared, quick=False) == declared
    quick = resolve_quick(declared, quick=True)
    assert quick == QuickDeclared(epochs=4, quick_epochs=4, lr=0.1)
    assert resolve_quick(quick, quick=True) == quick, "resolving again changes nothing"
    assert declared.epochs == 50, "the user's instance is not modified"


@pytest.mark.parametrize("quick, trained", [(True, 2), (False, 3)])
def test_attack_options_resolve_quick_variants_for_the_run(quick, trained, plain_ctx):
    """The decoder trains for quick_epochs under --quick and epochs otherwise (patience beyond
    both caps, so the cap ends training), read from Attack.options alone."""
    table = {"epochs": 3, "quick_epochs": 2, "patience": 10}
    ctx = dataclasses.replace(plain_ctx, quick=quick, attack_options={"decoder": table})
    decoder = get_attack("decoder")
    opts = decoder.options(ctx)
    assert (opts.epochs, opts.quick_epochs) == (trained, 2)
    details = decoder.run_seed(ctx, 0).details
    assert details["epochs_trained"] == trained and details["stopped_by"] == STOPPED_BY_CAP


@pytest.mark.parametrize("name", attack_names())
def test_attack_checks_its_options_before_running(name, tiny_ctx):
    attack = attack_class(name)
    defaults = attack.parse_options({})
    assert defaults == attack.Options(), "an empty table gives the declared defaults"
    hints = typing.get_type_hints(attack.Options)
    for spec in dataclasses.fields(attack.Options):
        assert option_spec(spec).help, f"{name}.{spec.name} has a help line"
        wrong = bad_value(spec, hints[spec.name])
        with pytest.raises(InputError) as refused:
            attack.parse_options({spec.name: wrong})
        message = str(refused.value)
        assert f"{name}.{spec.name}" in message and option_rule(spec, hints[spec.name]) in message
        assert repr(wrong)[:20] in message
        bad_ctx = dataclasses.replace(tiny_ctx, attack_options={name: {spec.name: wrong}})
        with pytest.raises(InputError):
            get_attack(name).run(bad_ctx)  # refused, not reported as the attack's failure
    with pytest.raises(InputError, match="has no option 'no_such_option'"):
        attack.parse_options({"no_such_option": 1})


@pytest.mark.slow
def test_every_attack_runs_on_the_digits_cnn_with_ssim(digits_ctx):
    assert digits_ctx.space.kind == "image"
    for name in (n for n in attack_names() if "image" in attack_class(n).input_kinds):
        entry = get_attack(name).run(digits_ctx)
        assert entry["status"] == "ok", (name, entry.get("reason"))
        assert set(attack_class(name).metrics) <= set(entry["metrics"])
        if entry["kind"] == "reconstruction":
            assert KIND_METRICS["image"] <= set(entry["metrics"])


@pytest.mark.parametrize(
    "setting, words",
    [
        ("fine-tune.head=nonsense", "fine-tune.head must be one of 'linear', 'mlp', 'top-model', got 'nonsense'"),
        ("fine-tune.epochs=-1", "fine-tune.epochs must be an integer >= 1 and <= 2147483647, got -1"),
        ("sdar.ablation=yes", "sdar.ablation must be true or false, got 'yes'"),
    ],
)
def test_cli_refuses_a_bad_attack_option_up_front(setting, words, capsys, monkeypatch):
    from splitaudit.cli import main
    from splitaudit.engine import pipeline

    monkeypatch.setattr(pipeline, "prepare_context", lambda *a, **k: pytest.fail("ran before checking options"))
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "run",
                sample("digits_cnn.onnx"),
                "--aux",
                sample("digits.npz"),
                "--attacks",
                "fine-tune,sdar",
                "--quick",
                "--attack-option",
                setting,
                "--out",
                "unused",
            ]
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(words)


def test_attacks_on_token_inputs_report_token_metrics_or_say_why_not(kind_runs, token_ctx, plain_ctx):
    """On token inputs every attack runs or is skipped with its reason (SDAR, built for continuous
    inputs; token inversion on every other kind); the attacks that reconstruct tokens give the
    accuracy at each of the 4 positions beside their token metrics."""
    sdar = get_attack("sdar").run(token_ctx)
    assert sdar["status"] == "skipped" and sdar["reason"].startswith("not adapted to token inputs")
    inversion = get_attack("token-inversion").run(plain_ctx)
    assert inversion["status"] == "skipped" and "needs token inputs (--vocab)" in inversion["reason"]
    on_tokens = {name: entry for (name, kind), entry in kind_runs.items() if kind == "tokens"}
    assert set(on_tokens) == set(attack_names()) - {"sdar"}
    for name, entry in on_tokens.items():
        if entry["kind"] == "reconstruction" or name == "token-inversion":
            assert KIND_METRICS["tokens"] <= set(entry["metrics"]) & set(entry["baseline"]), name
            assert len(entry["details"]["tokens"]["position_accuracy"]) == 4, name


@pytest.mark.parametrize("name", attack_names())
def test_attack_accepts_labelled_data_in_its_input_check(name, tiny_ctx):
    """check_inputs runs on every audit before any attack (pipeline.check_attack_inputs): on the
    tiny context, labelled and of a kind the attack takes, it must pass with the default options
    (it once read a typed option as a dict and stopped every labelled audit with exit 3)."""
    assert tiny_ctx.aux.y is not None
    assert get_attack(name).check_inputs(tiny_ctx) is None


@dataclasses.dataclass(frozen=True)
class NearestOptions:
    neighbours: int = option(1, "neighbours that vote on a target's label", low=1)


class NearestAttack(Attack):
    """A toy attack for the registry test: each target embedding takes the majority label of its
    nearest aux embeddings; baseline: the same on the raw inputs."""

    name = "nearest"
    kind = "label"
    primary_metric = "accuracy"
    title = "Nearest neighbours (toy)"
    baseline_name = "nearest neighbours on the raw inputs"
    baseline_role = "raw-input"
    metrics = ("accuracy",)
    needs = frozenset({"labels"})
    Options = NearestOptions

    def run_seed(self, ctx, seed):
        from sklearn.neighbors import KNeighborsClassifier

        k = self.options(ctx).neighbours

        def accuracy(train, test) -> float:
            flat = [t.reshape(len(t), -1).cpu().numpy() for t in (train, test)]
            model = KNeighborsClassifier(k).fit(flat[0], ctx.aux.y.cpu().numpy())
            return float(model.score(flat[1], ctx.target.y.cpu().numpy()))

        aux, target = (ctx.observed_embeddings(part, ctx.generator(seed)) for part in ("aux", "target"))
        return SeedOutcome({"accuracy": accuracy(aux, target)}, {"accuracy": accuracy(ctx.aux.x, ctx.target.x)})


def test_a_new_attack_is_one_module_and_one_registry_line(monkeypatch, capsys, tmp_path):
    """An attack added by its registry line alone is listed by `splitaudit attacks` with its option,
    selected by --attacks, its options checked up front (one line, exit 2), run and written to
    report.json with its words, and described in the reference."""
    from test_cli import assert_one_line_error, run_cli

    from docs.generate import attacks_section

    monkeypatch.setitem(REGISTRY, "nearest", ("test_attack_contract", "NearestAttack"))
    code, out, _ = run_cli(["attacks"], capsys)
    assert code == 0 and "nearest: Nearest neighbours (toy); metrics accuracy" in out and "neighbours:" in out
    args = ["run", sample("breast_cancer_mlp.onnx"), "--aux", sample("breast_cancer.npz"), "--quick"]
    args += ["--workers", "1", "--format", "json", "--out", str(tmp_path)]
    code, _, err = run_cli([*args, "--attacks", "nearest", "--attack-option", "nearest.neighbours=0"], capsys)
    assert_one_line_error(code, err, "nearest.neighbours must be an integer >= 1")
    code, _, err = run_cli([*args, "--attacks", "kmeans,nearest", "--attack-option", "nearest.neighbours=3"], capsys)
    assert code == 0, err
    entry = json.loads((tmp_path / "report.json").read_text())["attacks"]["nearest"]
    assert entry["status"] == "ok" and entry["title"] == "Nearest neighbours (toy)"
    assert 0.5 < entry["metrics"]["accuracy"] <= 1 and entry["baseline"]["accuracy"] > 0.5
    assert "### `nearest`: Nearest neighbours (toy)" in "\n".join(attacks_section())
