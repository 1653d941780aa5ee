"""Run options: one dataclass, filled from a TOML file and then from command-line flags."""

from __future__ import annotations

import sys
import typing
from dataclasses import Field, dataclass, fields
from pathlib import Path

from splitaudit.core.errors import InputError
from splitaudit.core.options import (
    CALIBRATE,
    CUTS,
    MAX_INT32,
    MEASURING,
    RUN,
    SWEEP,
    checked,
    option,
    option_spec,
)
from splitaudit.core.registries import DEFAULT_FORMATS, PRIORS, check_formats
from splitaudit.core.safety import nested_deeper_than, require_regular_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

MAX_SCALE = 1e12  # --noise-sigma/--smoothing above this overflow float32 when squared or added
MAX_THRESHOLD = 1e12  # an MSE or advantage threshold beyond this is no threshold
MAX_TIMEOUT_SECONDS = 30 * 24 * 3600.0
MAX_CONFIG_BYTES = 1024**2  # a config file is a few hundred bytes of options
MAX_CONFIG_DEPTH = 8  # [attack.NAME] tables holding lists: 4 levels; deeper is hostile
MAX_SIGMAS = 64  # points in one sweep (each runs every attack)
SIGMA_DIGITS = 12  # sigmas equal to this many significant digits are one point
MAX_SEED = 2**32 - 16  # scikit-learn takes 32-bit seeds, and attacks use seed, seed+1, ...
EXECUTORS = ("local", "ray")
DEVICES = ("auto", "cpu", "cuda")
MAX_WORKERS = 256
TOP_MODEL_ROLES = ("classifier", "body")  # --top-model-role: what the utility scores and SDAR may use it for
MODEL_MODES = ("saved", "eval", "train")  # --model-mode (audit/inputs/stochastic.py applies them)
MAX_QUERIES = 1000  # --queries: repeated queries of one input a query-access attacker averages
MAX_TEXT_TOKENS = 1_000_000  # --max-length: beyond any model's context window


# The options are declared once, here: each field of AuditOptions is a key of the TOML file, and
# its `option(...)` (splitaudit.core.options) says which values it takes, which commands take it
# as a flag (with its help), and whether splitaudit.audit() takes it as a keyword. cli.py makes
# the click options from this table and api.py the keywords of audit(); tests/test_options.py
# checks that the three accept one set. validate() checks every value against its declaration.
DEFAULT_CUTS = 6  # candidate cuts audited when --cuts is not given: enough to see the trend
CLI_CONTROLS = ("attack_option", "config_file", "debug")  # flags that are not options of the audit
# The limits several options share (OptionSpec's fields).
NOISE_SCALE = {"scale": True, "high": MAX_SCALE}  # above MAX_SCALE, float32 overflows when squared or added
THRESHOLD = {"low": 0, "high": MAX_THRESHOLD}
SHARE = {"low": 0, "high": 1}
FRACTION = {"above": 0, "below": 1}
SIZE = {"low": 1, "high": MAX_INT32}


PRIOR_HELP = "Prior-term estimator for the van Trees bound (default ssm): " + "; ".join(
    f"{p.name}, {p.description}" for p in PRIORS.values()
)
SWEEP_GATE = "Gate: fail when {} at the recommended sigma."


@dataclass
class AuditOptions:
    """Everything `splitaudit run` and `sweep` can be told. Field names match the TOML keys."""

    # The Python API may pass an nn.Module as model and top_model, and Datasets as aux and target.
    model: str = option("", "The bottom model (.onnx or TorchScript .pt): the MODEL argument.", commands=frozenset())
    aux: str = option("", "Auxiliary data: .npz (x, y, attr), CSV, or an image folder.", commands=MEASURING)
    target: str | None = option(None, "Separate target data (default: a seeded split of --aux).", commands=MEASURING)
    attacks: list[str] = option(help="all, none, or a comma list of {attacks}.", factory=lambda: ["all"])
    noise_sigma: float = option(
        0.0,
        "Std of the Gaussian noise added to embeddings (default 0).",
        commands=frozenset({RUN, CALIBRATE}),
        **NOISE_SCALE,
    )
    prior: str = option("ssm", PRIOR_HELP + ".", commands=MEASURING, choices=tuple(PRIORS))
    smoothing: float | None = option(
        None, "Randomized-smoothing tau (default 0.25 for [0,1] images, else 0).", commands=MEASURING, **NOISE_SCALE
    )
    top_model: str | None = option(
        None,
        "The top model g (TorchScript/ONNX), for attacks that use one.",
        commands=frozenset({RUN, SWEEP}),  # cuts extracts the top from the whole model
        help_for=((SWEEP, "The top model g; utility is its accuracy under noise (else a probe's)."),),
    )
    top_model_role: str = option(
        "classifier",
        "What --top-model is: classifier (it ends in the class scores; default) or body (the server's part g "
        "of U-shaped split learning; the client keeps the head after it).",
        commands=frozenset({RUN, SWEEP}),
        choices=TOP_MODEL_ROLES,
    )
    input_shape: list[int] | None = option(None, "Per-sample input shape, e.g. 3,32,32.", commands=MEASURING, **SIZE)
    normalize: list[float] | None = option(
        None,
        "MEAN,STD (or C means then C stds) folded into the encoder; MSEs stay in data space.",
        commands=frozenset({RUN, SWEEP, CALIBRATE}),  # cuts: the whole model takes the data as it is
        low=-MAX_SCALE,
        high=MAX_SCALE,
    )
    label_column: str | None = option(None, "CSV column with class labels.", commands=MEASURING)
    attr_column: str | None = option(None, "CSV column with the sensitive attribute.", commands=MEASURING)
    target_fraction: float = option(0.5, "Share of --aux held out as the target set.", commands=frozenset(), **FRACTION)
    out: str = option("splitaudit-report", "Output folder (default ./splitaudit-report).", api=False)
    formats: list[str] = option(
        help="Comma list of {formats} (default html,md,json).",
        factory=lambda: list(DEFAULT_FORMATS),
        api=False,
        flag="--format",
    )
    fail_under_mse: float | None = option(
        None,
        "Gate: fail when the van Trees bound MSE is below T.",
        help_for=((SWEEP, "Gate: fail when the recommended sigma's bound MSE is below T."),),
        **THRESHOLD,
    )
    fail_under_attack_mse: float | None = option(
        None,
        "Gate: fail when any reconstruction attack's MSE is below T.",
        help_for=((SWEEP, SWEEP_GATE.format("an attack reconstructs with MSE below T")),),
        **THRESHOLD,
    )
    max_advantage: float | None = option(
        None,
        "Gate: fail when any attack's advantage over its baseline exceeds A.",
        help_for=((SWEEP, SWEEP_GATE.format("an attack's advantage exceeds A")),),
        low=-MAX_THRESHOLD,
        high=MAX_THRESHOLD,
    )
    strict: bool = option(
        False,
        "Gate: also fail on any attack that did not learn (inconclusive); by default only the thresholds "
        "resting on such an attack fail.",
    )
    baseline: str | None = option(
        None,
        "Gate: an earlier report.json; fail when the bound fell, or an attack's advantage grew, by more than "
        "the two audits' uncertainty allows.",
        commands=frozenset({RUN}),
        api=False,
        is_path=True,
    )
    junit: str | None = option(None, "Also write the gates as JUnit XML test cases.", api=False, is_path=True)
    mlflow: bool = option(
        False,
        "Log the audit as an MLflow run: headline numbers as metrics, options as params, reports as artifacts "
        '(pip install "splitaudit[mlflow]"); to MLflow\'s active tracking URI unless --mlflow-uri.',
        commands=frozenset({RUN}),
        api=False,
    )
    mlflow_uri: str | None = option(
        None, "The MLflow tracking URI to log to (implies --mlflow).", commands=frozenset({RUN}), api=False
    )
    seed: int = option(
        0, "Seed for splits, attacks and estimators (default 0).", commands=MEASURING, low=0, high=MAX_SEED
    )
    device: str = option("auto", "Where to compute (default auto).", commands=MEASURING, choices=DEVICES)
    quick: bool = option(False, "Smoke run: fewer seeds, epochs and probes.", commands=MEASURING)
    attack_options: dict[str, dict] = option(
        help="Attack settings by attack (the file's [attack.NAME] tables; on the CLI --attack-option).",
        factory=dict,
        commands=frozenset(),
    )
    vocab: str | None = option(
        None,
        "Token inputs: vocabulary (JSON list of strings, or tokenizer.json); x holds token ids [N, T].",
        commands=MEASURING,
    )
    split_layer: int | None = option(
        None,
        "A Hugging Face checkpoint folder as MODEL: the client keeps the embedding and the first N blocks.",
        commands=frozenset({RUN, SWEEP, CALIBRATE}),  # cuts takes a whole ONNX or .pt2 graph and finds its own cuts
        low=0,
        high=MAX_INT32,
    )
    max_length: int = option(
        128,
        "Raw text (--aux/--target .txt or .jsonl): tokens a text keeps; longer texts are truncated, shorter "
        "ones right-padded to the longest (default 128).",
        commands=MEASURING,
        low=1,
        high=MAX_TEXT_TOKENS,
    )
    output_name: str | None = option(
        None,
        "Which output is the embedding when the model has several: an ONNX output name, a TorchScript tuple's "
        "index or dict's key (default: the first).",
        commands=MEASURING,
        help_for=((CUTS, "Which output of the whole model is its answer when it has several (default: the first)."),),
    )
    executor: str = option(
        "local",
        'Run attack tasks in this process (local, default) or on Ray (ray; pip install "splitaudit[ray]").',
        choices=EXECUTORS,
        help_for=(
            (CUTS, 'Audit the cuts (one task each) locally (default) or on Ray (pip install "splitaudit[ray]").'),
        ),
    )
    ray_address: str | None = option(
        None, "An existing Ray cluster (ray start --head); default: start a local instance."
    )
    task_timeout: float | None = option(
        None,
        "Seconds one attack task (one seed at one sigma) may run before it is retried once, then failed "
        "(dFIL shards are not bound by it: without all of them there is no bound).",
        metavar="S",
        commands=frozenset({RUN, SWEEP}),  # cuts: each cut is one task, its attack seeds run inside it
        above=0,
        high=MAX_TIMEOUT_SECONDS,
    )
    workers: int | None = option(
        1,
        "Worker processes of the local executor (default 1: tasks run in this process; auto: one per CPU core).",
        metavar="N|auto",
        help_for=(
            (CUTS, "Worker processes auditing cuts side by side (default 1: one cut after another in this process)."),
        ),
        low=1,
        high=MAX_WORKERS,
    )
    dfil_rtol: float = option(
        0.02,
        "Target relative standard error of the mean dFIL when it is estimated (default 0.02).",
        commands=MEASURING,
        **FRACTION,
    )
    dfil_samples: int | None = option(
        None,
        "At most this many target samples for dFIL (default 2048, 256 with --quick).",
        commands=MEASURING,
        low=2,
        high=MAX_INT32,
    )
    model_mode: str = option(
        "saved",
        "Audit the bottom model in the mode it was saved in (default: dropout stays as saved), "
        "in eval mode (dropout off) or in training mode (dropout on).",
        commands=MEASURING,
        choices=MODEL_MODES,
    )
    queries: int = option(
        1,
        "Queries of one input a query-access attacker averages, for stochastic models (default 1; "
        "above 1 the decoder reports single-shot and k-query numbers).",
        commands=MEASURING,
        low=1,
        high=MAX_QUERIES,
    )
    # splitaudit sweep
    noise_sigmas: list[float] | None = option(
        None,
        "Comma list of noise sigmas to audit, e.g. 0,0.1,0.3,1.",
        commands=frozenset({SWEEP}),
        api=False,
        flag="--noise-sigma",
        **NOISE_SCALE,
    )
    auto_sigma: bool = option(
        False,
        "Also audit the sigma calibrated for --target-mse and points around it (log scale).",
        commands=frozenset({SWEEP}),
        api=False,
    )
    target_mse: float | None = option(
        None,
        "The bound MSE the recommended sigma must guarantee (default --fail-under-mse, else half the mean-guess MSE).",
        commands=frozenset({SWEEP, CALIBRATE, CUTS}),
        api=False,
        help_for=(
            (CALIBRATE, "The bound MSE the noise should guarantee."),
            (
                CUTS,
                "The bound MSE each cut's noise must guarantee (default --fail-under-mse, else half the mean-guess MSE).",
            ),
        ),
        required_in=frozenset({CALIBRATE}),
        above=0,
        high=MAX_THRESHOLD,
    )
    max_utility_loss: float | None = option(
        None,
        "Gate: fail when the recommended sigma costs more accuracy.",
        commands=frozenset({SWEEP}),
        api=False,
        **SHARE,
    )
    # splitaudit cuts
    cuts: list[str] = option(
        help=f"Tensor names to cut at (comma list), or a number of candidate cuts spread over the depth "
        f"(default {DEFAULT_CUTS}).",
        factory=list,
        commands=frozenset({CUTS}),
        api=False,
        metavar="NAMES|N",
    )
    cut_noise_sigma: float | None = option(
        None,
        "Audit every cut at this noise sigma (default: each cut at the sigma calibrated for --target-mse).",
        commands=frozenset({CUTS}),
        api=False,
        flag="--noise-sigma",
        **NOISE_SCALE,
    )
    max_accuracy_loss: float = option(
        0.02,
        "The task accuracy the recommended cut may lose to its noise (default 0.02).",
        commands=frozenset({CUTS}),
        api=False,
        **SHARE,
    )

    def validate(self) -> "AuditOptions":
        """Raise InputError for values that no audit can use; each value is kept as its option stores it.
        Called once, where options come in (the CLI's build_options and demo, splitaudit.audit(), a
        report's recorded options for verify); the engine takes the validated options as they are."""
        check_values(self)
        check_attack_tables(self.attack_options)
        self._normalize_sigmas()
        check_formats(self.formats, "sweep" if self.noise_sigmas is not None or self.auto_sigma else "report")
        if not str(self.out).strip():
            raise InputError("--out is empty; name an output folder")
        if self.ray_address is not None and self.executor != "ray":
            raise InputError("--ray-address names a Ray cluster for --executor ray; add --executor ray or drop it")
        if self.executor == "ray" and self.workers != 1:
            raise InputError("--workers sets the local executor's processes; Ray's workers are its cluster's CPUs/GPUs")
        return self

    def _normalize_sigmas(self) -> None:
        """-0 is 0; a sigma listed twice (to SIGMA_DIGITS digits) is refused rather than silently
        audited once; a sweep has at most MAX_SIGMAS points (each costs every attack)."""
        self.noise_sigma = abs(self.noise_sigma)
        if self.noise_sigmas is None:
            return
        self.noise_sigmas = [abs(s) for s in self.noise_sigmas]
        if len(self.noise_sigmas) > MAX_SIGMAS:
            raise InputError(
                f"--noise-sigma lists {len(self.noise_sigmas)} sigmas; a sweep audits at most {MAX_SIGMAS} "
                "(each point runs every attack)"
            )
        seen: dict[str, float] = {}
        for sigma in self.noise_sigmas:
            first = seen.get(sigma_key(sigma))
            seen[sigma_key(sigma)] = sigma
            if first is not None:
                same = "" if first == sigma else f" ({first!r} and {sigma!r} agree to {SIGMA_DIGITS} digits)"
                raise InputError(f"--noise-sigma lists {sigma:g} twice{same}; list each sigma once")


def sigma_key(sigma: float) -> str:
    """Sigmas equal to SIGMA_DIGITS significant digits are one audit point."""
    return f"{sigma:.{SIGMA_DIGITS}g}"


HINTS = typing.get_type_hints(AuditOptions)  # each option's type, from its annotation
SOURCE_FIELDS = {"model", "aux", "target", "top_model"}  # paths, or (Python API) a module or a Dataset
TOML_VALUES = (str, bool, int, float, list, dict)  # what a config file holds (and click gives)


def check_values(options: AuditOptions) -> None:
    """Every option's value against its declaration, stored as the option holds it, before anything
    is loaded: a config file and the API pass values click never saw, nan passes every `<` check
    unnoticed (a gate "bound 0 >= nan" would pass), and values at the edges of float arithmetic
    (1e308, 1e-320) overflow or divide by zero deep inside an estimator. A model or data option
    may hold an in-memory module or Dataset from the Python API, which is not checked here."""
    for f in fields(options):
        value = getattr(options, f.name)
        if f.name in SOURCE_FIELDS and not isinstance(value, TOML_VALUES):
            continue
        setattr(options, f.name, checked(option_label(f), f, HINTS[f.name], value))


def check_attack_tables(attack_options: dict) -> None:
    """Each attack's options are a table (its keys and values are the attack's to check:
    splitaudit.attacks.check_attack_options)."""
    for attack, table in attack_options.items():
        if not isinstance(table, dict):
            raise InputError(f"attack options for {attack!r} must be a table of KEY = VALUE, got {table!r:.60}")


def option_flag(f: Field) -> str:
    """The command-line spelling of an option (its OptionSpec's flag, else --name-with-dashes)."""
    return option_spec(f).flag or f"--{f.name.replace('_', '-')}"


def option_label(f: Field) -> str:
    """How messages name an option: its flag, or `option NAME` for one that no command takes as a
    flag (set in a config file or the API only)."""
    return option_flag(f) if option_spec(f).commands else f"option {f.name}"


def load_config(path: str | Path) -> dict:
    """Read a TOML config: top-level keys are option names; [attack.NAME] tables are attack options."""
    path = require_regular_file(path, "config file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise InputError(
            f"config file {path} is {path.stat().st_size} bytes; a config file is at most {MAX_CONFIG_BYTES}"
        )
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"config file {path} is not valid TOML: {exc}") from exc
    except RecursionError as exc:  # tomllib recurses once per nesting level
        raise InputError(
            f"config file {path} nests too deeply (options nest at most {MAX_CONFIG_DEPTH} levels)"
        ) from exc
    if nested_deeper_than(raw, MAX_CONFIG_DEPTH):  # later readers (the option checks) recurse too
        raise InputError(f"config file {path} nests too deeply (options nest at most {MAX_CONFIG_DEPTH} levels)")
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
