"""Run options: one dataclass, filled from a TOML file and then from command-line flags."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from splitaudit.errors import InputError
from splitaudit.safety import require_regular_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PRIORS = ("ssm", "dsm", "gaussian")
FORMATS = ("html", "md", "json", "sarif")
MAX_SCALE = 1e12  # --noise-sigma/--smoothing above this overflow float32 when squared or added
MAX_SEED = 2**32 - 16  # scikit-learn takes 32-bit seeds, and attacks use seed, seed+1, ...
EXECUTORS = ("local", "ray")
MAX_WORKERS = 256


@dataclass
class AuditOptions:
    """Everything `splitaudit run` can be told. Field names match the TOML keys."""

    model: str = ""  # the Python API may pass an nn.Module here, and Datasets as aux/target
    aux: str = ""
    target: str | None = None
    attacks: list[str] = field(default_factory=lambda: ["all"])
    noise_sigma: float = 0.0
    prior: str = "ssm"
    smoothing: float | None = None  # None: 0.25 for [0,1] images, 0 otherwise
    top_model: str | None = None
    input_shape: list[int] | None = None
    normalize: list[float] | None = None
    label_column: str | None = None
    attr_column: str | None = None
    target_fraction: float = 0.5
    out: str = "splitaudit-report"
    formats: list[str] = field(default_factory=lambda: ["html", "md", "json"])  # sarif on request
    fail_under_mse: float | None = None
    fail_under_attack_mse: float | None = None
    max_advantage: float | None = None
    junit: str | None = None
    seed: int = 0
    device: str = "auto"
    quick: bool = False
    attack_options: dict[str, dict] = field(default_factory=dict)
    vocab: str | None = None  # token inputs: the vocabulary file; declares that x holds token ids
    output_name: str | None = None  # which output of a multi-output ONNX model is the embedding
    executor: str = "local"  # where the attack tasks run: in this process, or on Ray
    ray_address: str | None = None  # an existing Ray cluster (default: start a local instance)
    task_timeout: float | None = None  # seconds one task may run before it is retried, then failed
    workers: int | None = 1  # local executor's worker processes; None: one per CPU core (auto)
    dfil_rtol: float = 0.02  # target relative standard error of the mean Jacobian trace
    dfil_samples: int | None = None  # at most this many target samples for dFIL (None: 2048, 256 quick)
    # splitaudit sweep
    noise_sigmas: list[float] | None = None
    auto_sigma: bool = False
    target_mse: float | None = None
    max_utility_loss: float | None = None

    def validate(self) -> "AuditOptions":
        """Raise InputError for values that no audit can use."""
        check_option_types(self)
        check_finite_options(self)
        if self.noise_sigma < 0:
            raise InputError(f"--noise-sigma must be >= 0, got {self.noise_sigma}")
        if self.smoothing is not None and self.smoothing < 0:
            raise InputError(f"--smoothing must be >= 0, got {self.smoothing}")
        if self.prior not in PRIORS:
            raise InputError(f"--prior must be one of {', '.join(PRIORS)}, got {self.prior!r}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            raise InputError(f"--format takes a comma list of {', '.join(FORMATS)}; got {','.join(self.formats)!r}")
        if not 0 < self.target_fraction < 1:
            raise InputError(f"target_fraction must lie in (0, 1), got {self.target_fraction}")
        for name in ("fail_under_mse", "fail_under_attack_mse"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if not 0 <= self.seed <= MAX_SEED:
            raise InputError(f"--seed must lie in [0, {MAX_SEED}] (32-bit seeds), got {self.seed}")
        if not str(self.out).strip():
            raise InputError("--out is empty; name an output folder")
        if self.executor not in EXECUTORS:
            raise InputError(f"--executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.task_timeout is not None and not self.task_timeout > 0:
            raise InputError(f"--task-timeout must be > 0 seconds, got {self.task_timeout}")
        if self.workers is not None and not 1 <= self.workers <= MAX_WORKERS:
            raise InputError(f"--workers must be auto or a count in [1, {MAX_WORKERS}], got {self.workers}")
        if self.executor == "ray" and self.workers != 1:
            raise InputError("--workers sets the local executor's processes; Ray's workers are its cluster's CPUs/GPUs")
        self.validate_dfil()
        self._validate_sweep()
        return self

    def validate_dfil(self) -> None:
        """--dfil-rtol in (0, 1), --dfil-samples >= 2 (a mean needs a spread)."""
        if not 0 < self.dfil_rtol < 1:
            raise InputError(f"--dfil-rtol must lie in (0, 1), got {self.dfil_rtol}")
        if self.dfil_samples is not None and self.dfil_samples < 2:
            raise InputError(f"--dfil-samples must be >= 2, got {self.dfil_samples}")

    def _validate_sweep(self) -> None:
        bad = [s for s in self.noise_sigmas or [] if not (isinstance(s, (int, float)) and 0 <= s < float("inf"))]
        if bad:
            raise InputError(f"--noise-sigma takes finite values >= 0, got {bad[0]}")
        if self.target_mse is not None and not 0 < self.target_mse < float("inf"):
            raise InputError(f"--target-mse must be a finite value > 0, got {self.target_mse}")
        if self.max_utility_loss is not None and not 0 <= self.max_utility_loss <= 1:
            raise InputError(f"--max-utility-loss is an accuracy drop in [0, 1], got {self.max_utility_loss}")


# What each option may hold, by its annotation (TOML gives any type; flags are already typed).
OPTION_TYPES = {
    "str": (str,),
    "str | None": (str, type(None)),
    "float": (int, float),
    "float | None": (int, float, type(None)),
    "int": (int,),
    "int | None": (int, type(None)),
    "bool": (bool,),
    "list[str]": (list,),
    "list[int] | None": (list, type(None)),
    "list[float] | None": (list, type(None)),
    "dict[str, dict]": (dict,),
}
ITEM_TYPES = {"list[str]": (str,), "list[int] | None": (int,), "list[float] | None": (int, float)}
SOURCE_FIELDS = {"model", "aux", "target", "top_model"}  # paths, or (Python API) a module or a Dataset
TOML_SCALARS = (bool, int, float, list, dict)


def _wrong_source(name: str, value) -> bool:
    """A model/data option is a path, or an in-memory object from the Python API; never a number or table."""
    return name in SOURCE_FIELDS and isinstance(value, TOML_SCALARS)


def check_option_types(options: AuditOptions) -> None:
    """Raise InputError for a value of the wrong type (e.g. noise_sigma = "0.1" in a config file)."""
    for f in (f for f in fields(options) if f.type in OPTION_TYPES):
        value, allowed = getattr(options, f.name), OPTION_TYPES[f.type]
        if f.name in SOURCE_FIELDS and not _wrong_source(f.name, value):
            continue
        items = value if isinstance(value, list) and f.type in ITEM_TYPES else []
        wrong_item = next((v for v in items if isinstance(v, bool) or not isinstance(v, ITEM_TYPES[f.type])), None)
        bad_bool = isinstance(value, bool) and bool not in allowed
        if not isinstance(value, allowed) or bad_bool or wrong_item is not None:
            shown = wrong_item if wrong_item is not None else value
            raise InputError(
                f"option {f.name} must be {f.type.replace(' | None', '')}, got {type(shown).__name__} {shown!r:.60}"
            )
    for attack, table in options.attack_options.items():
        if not isinstance(table, dict):
            raise InputError(f"attack options for {attack!r} must be a table of KEY = VALUE, got {table!r:.60}")


def check_finite_options(options: AuditOptions) -> None:
    """nan passes every `<` check unnoticed (a gate "bound 0 >= nan" would pass): refuse non-finite
    numbers, and magnitudes that overflow float32 arithmetic, before anything is computed."""
    numbers = {
        name: getattr(options, name)
        for name in (
            "noise_sigma",
            "smoothing",
            "target_fraction",
            "fail_under_mse",
            "fail_under_attack_mse",
            "max_advantage",
        )
    }
    numbers.update({f"normalize[{i}]": v for i, v in enumerate(options.normalize or [])})
    for name, value in numbers.items():
        if value is not None and not math.isfinite(value):
            raise InputError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name in ("noise_sigma", "smoothing"):
        value = getattr(options, name)
        if value is not None and value > MAX_SCALE:
            raise InputError(
                f"--{name.replace('_', '-')} {value:g} is above the limit {MAX_SCALE:g} "
                "(larger values overflow float32 arithmetic)"
            )


def load_config(path: str | Path) -> dict:
    """Read a TOML config: top-level keys are option names; [attack.NAME] tables are attack options."""
    path = require_regular_file(path, "config file")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"config file {path} is not valid TOML: {exc}") from exc
    known = {f.name for f in fields(AuditOptions)}
    raw = {k.replace("-", "_"): v for k, v in raw.items()}
    if "attack" in raw:
        raw["attack_options"] = raw.pop("attack")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InputError(f"config file {path} has unknown keys: {', '.join(unknown)}")
    return raw


def parse_attack_option(text: str) -> tuple[str, str, object]:
    """NAME.KEY=VALUE -> (NAME, KEY, value parsed as a TOML value, else kept as a string)."""
    try:
        dotted, value = text.split("=", 1)
        attack, key = dotted.strip().split(".", 1)
    except ValueError as exc:
        raise InputError(f"--attack-option takes NAME.KEY=VALUE (e.g. sdar.ablation=true), got {text!r}") from exc
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return attack.strip(), key.strip(), parsed
