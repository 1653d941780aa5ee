"""The contract every attack follows (one module per attack, one class each).

An attack declares what it needs from the inputs and the input kinds it is built for
(`input_kinds`: image, sequence, tabular, tokens; splitaudit.core.input_space), runs once per seed,
and returns its metrics and the matching baseline (what an attacker achieves without the bottom
model). `Attack.run` turns that into the result entry: skipped with a reason, failed with a reason, or ok with the
mean and std over seeds and the advantage over the baseline (Zheng et al., IJCAI 2024, Def. 1).
Seeds are added by their spread (`Attack.next_seed`): at least MIN_SEEDS of the context's seeds
run, and another while the mean advantage's 95% interval is wider than SEED_TOLERANCE of its
distance from the baseline; the entry's `seeds` lists those that ran.

An attack describes itself on its class: `title`, `baseline_name`, `query_access_reference` and
`series` (the report's words, copied into every result entry so that reports render from the
result alone, without importing an attack), `metrics` (the metric names every ok run fills) and `Options`, a frozen dataclass whose fields
are the keys its `[attack.NAME]` table takes, each declared with splitaudit.core.options.option
(default, help, limits or choices), as run options are. `parse_options` checks a user's table
against it, with the run options' checker, before anything runs.
An Options field named `quick_X` is X's value under --quick (`resolve_quick`): attacks read X from
`Attack.options(ctx)` and never choose a quick variant themselves.
"""

from __future__ import annotations

import math
import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np
from scipy import stats

from splitaudit.context.audit_context import AuditContext
from splitaudit.core.errors import InputError
from splitaudit.core.input_space import INPUT_KINDS
from splitaudit.core.options import checked, option_rule, option_spec
from splitaudit.core.result import default_baseline_name, outcome_of

NEEDS = {"labels", "attribute", "gradients"}
MIN_SEEDS = 2  # the fewest seeds a spread can be measured from (or all there are, under --quick)
SEED_TOLERANCE = 0.1  # enough seeds once the 95% interval's half-width is within 10% of |mean advantage|
QUICK_PREFIX = "quick_"  # an Options field quick_X holds X's value under --quick


@dataclass
class SeedOutcome:
    """One seed's result. metrics/baseline values are numbers or dicts of numbers."""

    metrics: dict[str, Any]
    baseline: dict[str, Any]
    examples: list[dict] = field(default_factory=list)  # reconstructions shown in the report
    details: dict[str, Any] = field(default_factory=dict)  # extra JSON-ready facts (first seed's)
    # Why the attack's own training signal (what the attacker can observe) did not improve; "" when it did.
    not_converged: str = ""


@dataclass(frozen=True)
class NoOptions:
    """An attack that takes no options."""


def parse_options(attack: str, options_type: type, table: dict) -> Any:
    """The user's `[attack.NAME]` table as an Options instance; InputError (exit 2) naming the
    option, the values it takes and what was given, for an unknown key or a bad value, or where an
    option that moved went (the Options class's MOVED: old key -> where it is now)."""
    specs = {f.name: f for f in fields(options_type)}
    hints = typing.get_type_hints(options_type)
    unknown = sorted(set(table) - set(specs))
    moved = getattr(options_type, "MOVED", {})
    if unknown and unknown[0] in moved:
        raise InputError(f"{attack}.{unknown[0]} is now {moved[unknown[0]]}")
    if unknown:
        takes = ", ".join(sorted(specs)) or "no options"
        raise InputError(f"attack {attack!r} has no option {unknown[0]!r}; it takes {takes}")
    return options_type(
        **{key: checked(f"attack option {attack}.{key}", specs[key], hints[key], value) for key, value in table.items()}
    )


def options_help(options_type: type) -> list[str]:
    """One line per option: name, values it takes, default, help."""
    hints = typing.get_type_hints(options_type)
    return [
        f"{f.name}: {option_spec(f).help}; {option_rule(f, hints[f.name])}{_default_words(f.default)}"
        for f in fields(options_type)
    ]


def quick_variants(options_type: type) -> dict[str, str]:
    """{X: quick_X} for each Options field quick_X whose X is also a field."""
    names = {f.name for f in fields(options_type)}
    return {
        name.removeprefix(QUICK_PREFIX): name
        for name in names
        if name.startswith(QUICK_PREFIX) and name.removeprefix(QUICK_PREFIX) in names
    }


def orphan_quick_options(options_type: type) -> list[str]:
    """The quick_X fields with no X (a declaration error: under --quick they would set nothing)."""
    paired = set(quick_variants(options_type).values())
    return sorted(f.name for f in fields(options_type) if f.name.startswith(QUICK_PREFIX) and f.name not in paired)


def resolve_quick(options: Any, quick: bool) -> Any:
    """The options a run uses: under --quick each X takes its quick_X's value. The quick_X fields
    stay as they are, so the instance still says what both variants were."""
    if not quick:
        return options
    variants = quick_variants(type(options))
    return replace(options, **{name: getattr(options, quick_name) for name, quick_name in variants.items()})


def _default_words(default: Any) -> str:
    """ ", default X" in TOML spelling; nothing for None (the help says what the run decides)."""
    if default is None:
        return ""
    return f", default {str(default).lower() if isinstance(default, bool) else repr(default)}"


class Attack(ABC):
    """Base class: subclasses set the class attributes and implement `run_seed`."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "label" (accuracy, higher is better) or "reconstruction" (MSE)
    primary_metric: ClassVar[str]
    needs: ClassVar[frozenset[str]] = frozenset()
    assumptions: ClassVar[str] = ""  # what the attacker is assumed to hold, for the report
    advantage_basis: ClassVar[str] = ""  # how `advantage` is taken, when not at the headline metric
    title: ClassVar[str]  # the report's heading
    baseline_name: ClassVar[str] = ""  # what the baseline is, in the report's words ("" for the mean guess)
    # What the baseline stands for (BASELINE_ROLES): "raw-input", a rival that uses information the
    # attacker does not get from the model, so doing no better is a finding (no advantage); or "floor",
    # what the attack reaches on its own, so ending below it means it did not learn (inconclusive).
    baseline_role: ClassVar[str] = "floor"
    # The attack with query access on the same data whose result the report sets beside this one's.
    query_access_reference: ClassVar[str] = ""
    # The report's words for a dict-valued metric METRIC_by_KEY: {metric: {"title", "key", "axis", "value"}}.
    series: ClassVar[dict[str, dict[str, str]]] = {}
    # The metric names an ok run fills; those that fit one input kind only (input_space.KIND_METRICS:
    # SSIM on images) are filled on that kind.
    metrics: ClassVar[tuple[str, ...]]
    # A seed's typical run time against other attacks' (a scheduling hint: workers start the
    # heaviest tasks first, so the last ones to start are short and the workers finish together).
    relative_cost: ClassVar[float] = 1.0
    Options: ClassVar[type] = NoOptions  # a frozen dataclass of option(...) fields: its [attack.NAME] table
    # The input kinds (input_space.INPUT_KINDS) it is built for; on another kind it is skipped
    # with `other_kinds_reason` (or, when that is "", a reason naming the kinds it runs on).
    input_kinds: ClassVar[frozenset[str]] = frozenset(INPUT_KINDS)
    other_kinds_reason: ClassVar[str] = ""

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The keys its [attack.NAME] table takes."""
        return frozenset(f.name for f in fields(cls.Options))

    @classmethod
    def parse_options(cls, table: dict) -> Any:
        """A user's [attack.NAME] table, checked, with defaults (an Options instance); InputError if bad."""
        return parse_options(cls.name, cls.Options, table)

    def options(self, ctx: AuditContext) -> Any:
        """This run's options for the attack (an Options instance), the quick variants resolved:
        under --quick each X holds its quick_X's value, the quick_X fields unchanged (resolve_quick)."""
        return resolve_quick(self.parse_options(ctx.options(self.name)), ctx.quick)

    @abstractmethod
    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        """Run the attack once with this seed."""

    def estimated_seconds(self, ctx: AuditContext, pass_seconds: float, timed: Callable) -> float | None:
        """Seconds all its seeds are expected to take (splitaudit.stages.cost's up-front estimate), or None
        when the attack has no cost model. pass_seconds: one encoder forward + backward pass per
        sample; timed(step): the median seconds of a call of step over repeated calls (CPU seconds
        over its threads on a CPU: splitaudit.stages.cost.StepTimer)."""
        return None

    def estimated_range(self, ctx: AuditContext, pass_seconds: float, timed: Callable) -> tuple[float, float] | None:
        """(expected, at most) seconds of all its seeds (the cost estimate's "about X (at most Y)"), or None
        without a cost model: estimated_seconds, and its expected_share_of_cap for the expected time.
        An attack whose work depends on what it finds while running (the optimisation attack's
        warm start) gives both itself."""
        cap = self.estimated_seconds(ctx, pass_seconds, timed)
        return None if cap is None else (cap * self.expected_share_of_cap(ctx), cap)

    def expected_share_of_cap(self, ctx: AuditContext) -> float:
        """The share of estimated_seconds the attack is expected to take: where that estimate counts a
        training up to its cap and early stopping usually ends it sooner, less than 1 (the cost
        estimate's "about X", the cap being its "at most")."""
        return 1.0

    def check_inputs(self, ctx: AuditContext) -> None:
        """Raise InputError when this run's options cannot apply to the loaded data (checked once
        the data is loaded, before any attack runs); most options fit any data."""
        return None

    def missing(self, ctx: AuditContext) -> str | None:
        """Why the attack cannot run on these inputs, or None when it can."""
        if ctx.space.kind not in self.input_kinds:
            return self.other_kinds_reason or (
                f"not built for {ctx.space.kind} inputs; it runs on {', '.join(sorted(self.input_kinds))} inputs"
            )
        if "labels" in self.needs and (ctx.aux.y is None or ctx.target.y is None):
            return "the data has no labels (npz 'y', --label-column, or an image folder's class names)"
        if "labels" in self.needs and self.kind == "label" and len(ctx.aux.y.unique()) < 2:
            return "the labels hold a single class: a label attack would be trivially right, so it is not run"
        if "attribute" in self.needs and (ctx.aux.attr is None or ctx.target.attr is None):
            return "the data has no sensitive attribute (npz 'attr' or --attr-column)"
        if "attribute" in self.needs and len(ctx.aux.attr.unique()) < 2:
            return "the sensitive attribute takes a single value: inferring it would be trivially right"
        if "gradients" in self.needs and not ctx.encoder.differentiable:
            return "needs gradients of the model, and it runs black-box (see the model warnings)"
        return None

    def advantage(self, metrics: dict, baseline: dict) -> float:
        """Accuracy gain over the baseline; for MSE, the fraction of the baseline error removed."""
        attack, base = metrics[self.primary_metric], baseline[self.primary_metric]
        if self.kind == "reconstruction":
            return 1.0 - attack / base if base > 0 else 0.0
        return attack - base

    def advantage_at(self, metrics: dict, baseline: dict) -> str | None:
        """Where the advantage is taken, for attacks whose advantage_basis is a sweep (None: at the
        headline metric), so a table can show it beside the number."""
        return None

    def run(self, ctx: AuditContext) -> dict:
        """The result entry for report.json (never raises for a failure inside the attack)."""
        self.options(ctx)  # a bad option is the user's input error (exit 2), not the attack's failure
        reason = self.missing(ctx)
        if reason:
            return self.skipped(reason)
        start = time.perf_counter()
        outcomes: list[SeedOutcome] = []
        try:
            while (seed := self.next_seed(ctx.seeds, outcomes)) is not None:
                outcomes.append(self.run_seed(ctx, seed))
        except Exception as exc:  # an attack's failure is reported, not fatal to the audit
            return self.failed(f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
        return self.summarize(ctx.seeds[: len(outcomes)], outcomes, time.perf_counter() - start)

    def next_seed(self, seeds: list[int], outcomes: list[SeedOutcome]) -> int | None:
        """The next of `seeds` to run after `outcomes` (the first ones', in order), or None when
        enough ran: MIN_SEEDS always, more only while their spread leaves the mean uncertain."""
        done = len(outcomes)
        if done >= len(seeds):
            return None
        if done < len(first_seeds(seeds)):
            return seeds[done]
        advantages = [self.advantage(o.metrics, o.baseline) for o in outcomes]
        return seeds[done] if mean_is_uncertain(advantages) else None

    def header(self) -> dict[str, Any]:
        """The entry's fields that do not depend on a run."""
        entry: dict[str, Any] = {
            "kind": self.kind,
            "title": self.title,
            "baseline_name": self.baseline_words(),
            "baseline_role": self.baseline_role,
            "assumptions": self.assumptions,
            "primary_metric": self.primary_metric,
        }
        if self.advantage_basis:
            entry["advantage_basis"] = self.advantage_basis
        if self.query_access_reference:
            entry["query_access_reference"] = self.query_access_reference
        if self.series:
            entry["series"] = {metric: dict(words) for metric, words in self.series.items()}
        return entry

    def baseline_words(self) -> str:
        return self.baseline_name or default_baseline_name(self.kind)

    def skipped(self, reason: str) -> dict:
        return {**self.header(), "status": "skipped", "reason": reason}

    def failed(self, reason: str, seconds: float) -> dict:
        return {**self.header(), "status": "failed", "reason": reason[:500], "seconds": seconds}

    def summarize(self, seeds: list[int], outcomes: list[SeedOutcome], seconds: float) -> dict:
        """The ok entry from every seed's outcome (the executor runs seeds as separate tasks)."""
        metrics, metrics_std = aggregate([o.metrics for o in outcomes])
        baseline, baseline_std = aggregate([o.baseline for o in outcomes])
        advantages = [self.advantage(o.metrics, o.baseline) for o in outcomes]
        entry = {
            **self.header(),
            "status": "ok",
            "reason": "",
            "metrics": metrics,
            "metrics_std": metrics_std,
            "baseline": baseline,
            "baseline_std": baseline_std,
            "advantage": float(np.mean(advantages)),
            "advantage_std": float(np.std(advantages)),
            **({"advantage_at": at} if (at := self.advantage_at(metrics, baseline)) else {}),
            "seeds": list(seeds),
            "seconds": seconds,
            "examples": outcomes[0].examples,
            "details": outcomes[0].details,
        }
        why = self.inconclusive_reason(entry, [o.not_converged for o in outcomes])
        if why:
            entry["failed_to_train"] = why
        entry["outcome"] = outcome_of(entry["advantage"], why)
        spread = spread_warning(entry)
        if spread:
            entry["spread_warning"] = spread
        return entry

    def inconclusive_reason(self, entry: dict, not_converged: list[str]) -> str:
        """Why an ok entry's attack did not learn, or "": its own training signal did not improve, or,
        against a floor baseline (what it reaches alone: the mean guess, the majority class), it ended
        below it. Such a result measured nothing and is never evidence of privacy. Doing no better than
        a raw-input baseline is not this: it is the finding "no advantage" (Zheng et al., IJCAI 2024)."""
        reasons = [f"seed {seed}: {why}" for seed, why in zip(entry["seeds"], not_converged) if why]
        metric = self.primary_metric
        attack, base = entry["metrics"].get(metric), entry["baseline"].get(metric)
        if self.baseline_role == "floor" and entry["advantage"] < 0:
            reasons.insert(0, f"it ended worse than {self.baseline_words()} ({metric} {attack:.4g} against {base:.4g})")
        return "; ".join(reasons)


def first_seeds(seeds: list[int]) -> list[int]:
    """The seeds every attack runs whatever their spread (started side by side by the executor)."""
    return seeds[:MIN_SEEDS]


def mean_is_uncertain(values: list[float], tolerance: float = SEED_TOLERANCE) -> bool:
    """Whether the 95% Student-t interval of the values' mean is wider than `tolerance` times the
    mean's distance from zero (for advantages: from the baseline); non-finite values are uncertain."""
    arr = np.asarray(values, dtype=float)
    if len(arr) < 2 or not np.all(np.isfinite(arr)):
        return True
    half_width = stats.t.ppf(0.975, len(arr) - 1) * arr.std(ddof=1) / math.sqrt(len(arr))
    return not half_width <= tolerance * abs(arr.mean())


def spread_warning(entry: dict) -> str:
    """A note when the seeds' spread of the advantage is as wide as the mean's distance to the
    baseline (zero advantage): the runs disagree on whether the attack beats its baseline at all."""
    mean, std = entry["advantage"], entry["advantage_std"]
    if len(entry["seeds"]) < 2 or not (math.isfinite(mean) and math.isfinite(std)) or not 0 < std >= abs(mean):
        return ""
    return (
        f"the spread between seeds (advantage {mean:.3g} ± {std:.3g}) is as wide as the distance to the "
        "baseline: the seeds disagree on whether it beats its baseline"
    )


def aggregate(runs: list[dict]) -> tuple[dict, dict]:
    """Mean and std across seeds, key by key (nested dicts recurse; non-finite values kept)."""
    means, stds = {}, {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(first, dict):
            means[key], stds[key] = aggregate(values)
        else:
            arr = np.asarray(values, dtype=float)
            means[key] = float(arr.mean())
            stds[key] = float(arr.std()) if np.all(np.isfinite(arr)) else math.nan
    return means, stds
