"""Run options: one dataclass, filled from a TOML file and then from command-line flags."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from splitaudit.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PRIORS = ("ssm", "dsm", "gaussian")
FORMATS = ("html", "md", "json", "sarif")


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

    def validate(self) -> "AuditOptions":
        """Raise InputError for values that no audit can use."""
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
        return self


def load_config(path: str | Path) -> dict:
    """Read a TOML config: top-level keys are option names; [attack.NAME] tables are attack options."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InputError(f"config file not found: {path}") from exc
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
