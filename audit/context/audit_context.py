"""The shared audit context: model, data parts, noise, seeds, and the cached embeddings.

Estimators and attacks read everything they need from here; nothing in it prints or exits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
from tqdm import tqdm

from splitaudit.core.config import AuditOptions
from splitaudit.core.draws import seeded_draws
from splitaudit.core.errors import InputError
from splitaudit.core.input_space import InputSpace, decide_space
from splitaudit.inputs.data import Dataset, in_unit_range
from splitaudit.inputs.model_checks import check_magnitude, within_time_limit
from splitaudit.inputs.models import Encoder, open_model, prepare_encoder, prepare_top_model
from splitaudit.inputs.raw_model import RawModel
from splitaudit.inputs.tokens import per_mask_pattern

if TYPE_CHECKING:
    from splitaudit.core.config import AuditOptions
    from splitaudit.inputs.tokens import TokenSpace

FULL_SEEDS = 3
QUICK_SEEDS = 1
PARITY_BATCH = 64  # samples the model's conversions are checked on against the original


def silent_progress(**kwargs) -> tqdm:
    """A progress bar that shows nothing (the default outside the CLI)."""
    return tqdm(disable=True, **kwargs)


@dataclass
class AuditContext:
    """What every attack and estimator sees. `aux` is the attacker's data, `target` the victims'."""

    encoder: Encoder
    aux: Dataset
    target: Dataset
    noise_sigma: float = 0.0
    seed: int = 0
    quick: bool = False
    top_model: nn.Module | None = None  # g as a differentiable torch module, for attacks that train through it
    top_model_forward: Callable[[torch.Tensor], torch.Tensor] | None = None  # g's forward pass (also black-box ONNX)
    attack_options: dict[str, dict] = field(default_factory=dict)
    progress: Callable[..., tqdm] = silent_progress
    queries: int = 1  # sends of one input a query-access attacker averages (k-query numbers when > 1)
    top_model_role: str = "classifier"  # --top-model-role: the class scores' classifier, or U-shaped SL's body g
    tokens: TokenSpace | None = None  # token inputs: the embedding table and vocabulary (x holds embeddings)
    space: InputSpace | None = None  # the inputs' kind and value range: decided from aux and tokens when not given
    _clean: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.top_model_forward is None:
            self.top_model_forward = self.top_model
        if self.space is None:  # where the data and the encoder meet: the one place the space is decided
            self.space = decide_space(self.aux.sample_shape, in_unit_range(self.aux.x), self.tokens is not None)

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    @property
    def seeds(self) -> list[int]:
        """The seeds every attack repeats over (mean and std are reported across them)."""
        return [self.seed + i for i in range(QUICK_SEEDS if self.quick else FULL_SEEDS)]

    @property
    def num_classes(self) -> int | None:
        counts = [d.num_classes for d in (self.aux, self.target) if d.num_classes is not None]
        return max(counts) if counts else None

    def part(self, name: str) -> Dataset:
        return {"aux": self.aux, "target": self.target}[name]

    def options(self, attack: str) -> dict:
        """User options for one attack (config file [attack.NAME] or --attack-option NAME.KEY=V)."""
        return self.attack_options.get(attack, {})

    def generator(self, seed: int) -> torch.Generator:
        """A torch generator on the audit's device, for noise and sampling."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def clean_embeddings(self, part: str) -> torch.Tensor:
        """f(x) for a data part, computed once (a stochastic encoder gets a fresh draw each call);
        every embedding is checked to be finite, so NaN never reaches an attack or a bound."""
        if self.encoder.stochastic:
            return _finite_embeddings(self._embed(part), part)
        if part not in self._clean:
            self._clean[part] = _finite_embeddings(self._embed(part), part)
        return self._clean[part]

    def _embed(self, part: str) -> torch.Tensor:
        """f(x) of a data part, with a progress bar (large images take minutes on a CPU)."""
        data = self.part(part)
        with self.progress(total=len(data), desc=f"embedding {part}", unit="sample") as bar:
            return per_mask_pattern(
                self.tokens, data.mask, data.x, lambda x: self.encoder.embed(x, on_samples=bar.update)
            )

    def add_noise(self, z: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """z + N(0, sigma^2 I): what the client actually sends under --noise-sigma."""
        if self.noise_sigma == 0:
            return z
        noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
        return z + self.noise_sigma * noise

    def observed_embeddings(self, part: str, generator: torch.Generator, queries: int = 1) -> torch.Tensor:
        """The embeddings an attacker observes for a data part: f(x) plus fresh noise; for a
        stochastic encoder each call is a fresh draw of f, as a server sees (seeded from generator).
        queries > 1: the mean of that many sends of each input (each its own draw and noise), what
        an attacker who can have one input encoded repeatedly averages."""
        if not self.encoder.stochastic and queries == 1:
            return self.add_noise(self.clean_embeddings(part), generator)
        total = None
        for _ in range(queries):
            sent = self.add_noise(self._fresh_draw(part, generator), generator)
            total = sent if total is None else total + sent
        return total / queries

    def _fresh_draw(self, part: str, generator: torch.Generator) -> torch.Tensor:
        """f(x) of a data part on draws of a stochastic encoder seeded from generator (reproducible;
        the cached embeddings of a deterministic one)."""
        if not self.encoder.stochastic:
            return self.clean_embeddings(part)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        data = self.part(part)
        with seeded_draws(seed, self.device):
            return _finite_embeddings(per_mask_pattern(self.tokens, data.mask, data.x, self.encoder.embed), part)

    def with_aux(self, index: torch.Tensor | slice) -> "AuditContext":
        """A copy whose attacker holds only aux[index] (the rest held out), with those samples'
        clean embeddings taken from this context's instead of computed again (its own cache)."""
        cached = {} if self.encoder.stochastic else {"aux": self.clean_embeddings("aux")[index]}
        return replace(self, aux=self.aux.subset(index), _clean=cached)

    def at_sigma(self, noise_sigma: float, seed: int | None = None) -> "AuditContext":
        """A copy for one audit point of a sweep: its own noise sigma (and seed), the same model,
        data and clean-embedding cache (the cache dict is shared, so f(x) is computed once)."""
        return replace(self, noise_sigma=noise_sigma, seed=self.seed if seed is None else seed)


def _finite_embeddings(z: torch.Tensor, part: str) -> torch.Tensor:
    """z, or InputError naming the first sample whose embedding is NaN or infinite, or saying that
    the embeddings are too large for float32 arithmetic (model_checks.check_magnitude)."""
    bad = ~torch.isfinite(z.flatten(1)).all(dim=1)
    if bad.any():
        raise InputError(
            f"the model returns NaN or infinite embeddings for {int(bad.sum())} of {len(z)} "
            f"{part} samples (first: sample {int(bad.nonzero()[0])} of the {part} part)"
        )
    check_magnitude(z, f"the model (on the {part} part)")
    return z


@dataclass(frozen=True)
class ContextSettings:
    """The run options the audit context is built from: what a worker process receives with the model
    and the data (execution/recipe.py), rather than all of AuditOptions."""

    noise_sigma: float
    seed: int
    quick: bool
    attack_options: dict
    queries: int
    top_model_role: str
    normalize: tuple | None
    top_model: object  # a file, a torch module or None

    @classmethod
    def of(cls, options: AuditOptions) -> "ContextSettings":
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls)})


def build_context(
    options: ContextSettings,
    raw: RawModel,
    aux: Dataset,
    target: Dataset,
    device: torch.device,
    progress: Callable[..., tqdm] = silent_progress,
) -> AuditContext:
    """The context from an opened model and the split data (also how a Ray worker rebuilds it)."""
    aux, target = aux.to(device), target.to(device)
    encoder = within_time_limit(prepare_encoder, raw, aux.x[:PARITY_BATCH], options.normalize)
    top, top_forward = None, None
    if options.top_model:
        raw_top = within_time_limit(
            lambda: open_model(options.top_model, device, mode="eval"), what="loading --top-model"
        )
        embeddings = encoder.embed(aux.x[:PARITY_BATCH])
        top, top_forward, notes = within_time_limit(prepare_top_model, raw_top, embeddings, what="checking --top-model")
        encoder.warnings.extend(notes)
    ctx = AuditContext(
        encoder=encoder,
        aux=aux,
        target=target,
        noise_sigma=options.noise_sigma,
        seed=options.seed,
        quick=options.quick,
        top_model=top,
        top_model_forward=top_forward,
        attack_options=options.attack_options,
        progress=progress,
        queries=options.queries,
        top_model_role=options.top_model_role,
        tokens=raw.tokens,
    )
    for part in ("aux", "target"):  # every embedding, not just the parity batch: NaN must stop here
        ctx.clean_embeddings(part)
    return ctx
