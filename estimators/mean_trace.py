"""E[||J_f(x)||_F^2] over a set of samples with the standard error of the mean, at any input size.

The bounds and the calibration of dFIL (Maeng et al., NeurIPS 2023, Eq. 4-6) need the mean trace
over the target samples with its uncertainty; per-sample values feed the histogram and the
leakiest samples. "auto" chooses by cost:
- exact (the cheapest of forward, reverse and structured, estimators/jacobian.py) on every sample
  when that costs at most EXACT_PREFERENCE times the randomised estimate (or EXACT_PRODUCTS
  products per sample);
- otherwise Hutchinson probes (Hutchinson, Commun. Stat. 1989): t_i, the mean of ||J v||^2 over
  k_i Rademacher probes, is unbiased for ||J(x_i)||_F^2. Over n samples taken in a seeded random
  order, Var(mean) = V_between / n + E[V_probe] / (n k); the sample variance of the t_i across
  samples estimates both terms at once, so the stopping rule (stderr <= rtol * mean) needs no model
  of either. A pilot estimates the two terms and sets k = sqrt(V_probe / V_between), the
  two-stage-sampling optimum when a sample's overhead costs about one product, and the number of
  samples; then probes are added where they reduce the variance (more samples while some are
  left, then more probes on all), and the leakiest samples get probes until their own relative
  error is rtol.
Every estimate is cross-checked on a few samples against independent Jacobian products of the
other AD mode (unbiased random probes), a black-box one against central differences on fresh
probes at another step; a disagreement beyond the statistical tolerance (plus the measured
finite-difference error) raises TraceCheckError, an internal error that must stop an audit.
Black-box estimates carry their finite-difference error (MeanTrace.fd_error), which widens the
interval. Pure tensor code, no I/O.

The products come in shards of samples (ProbeJob, ExactJob), each with its own seed drawn in
order from the estimate's generator, so they can run anywhere that holds f (MeanOptions.runner:
an executor's workers) and give the same numbers as here. The cross-check always runs here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Union

import torch
from torch import Tensor

from splitaudit.core.draws import seeded_draws
from splitaudit.estimators.jacobian import (
    DEFAULT_MEMORY_BYTES,
    MIN_DIRECTIONS_PER_CHUNK,
    BatchFn,
    Plan,
    StepChoice,
    TraceEstimate,
    TraceOptions,
    _fd_products,
    _squared_norms,
    choose_fd_step,
    concatenated,
    fd_error_bounded,
    forward_mode_works,
    is_stochastic,
    measure_plan,
    product_fn,
    rademacher,
)
from splitaudit.estimators.methods import cheapest_exact, differentiates, exact_choice, jacobian_trace, method_named

EXACT_PRODUCTS = 128  # exact whenever it needs at most this many products per sample
ASKED = {"finite-difference": "central finite differences: the model runs black-box, without gradients"}
EXACT_PREFERENCE = 2.0  # ... or at most this many times the randomised estimate's products
PILOT_SAMPLES, PILOT_PROBES = 16, 4
MIN_PROBES = 2  # per sample: the least that gives a per-sample standard error
LEAKIEST = 5  # samples refined to their own rtol, and listed in the report
CHECK_SAMPLES, CHECK_PROBES, CHECK_MAX_PROBES = 4, 16, 256
CHECK_RTOL = 0.05  # the cross-check adds probes until its relative standard error is this
CHECK_Z = 5.0  # disagreement beyond this many standard errors fails (false alarm ~ 1e-6)
CHECK_ROUNDING = 1e-3  # relative slack for float rounding when both sides are exact
CHECK_FD_STEP_FACTOR = 2.0  # black-box check: step between the run's h and FD_STEP_RATIO * h
Z_95 = 1.959964
PROBE_SHARD = 32  # samples per shard of random probes (at most what the memory budget allows)
EXACT_SHARD = 128  # samples per shard of an exact method
STOCHASTIC_DRAWS = 4  # an exact method's repetitions per sample over a stochastic encoder's draws
RANDOMISED_PROBES = 2 * PILOT_PROBES  # planned_products: a typical central-difference run's probes per sample


class TraceCheckError(RuntimeError):
    """The runtime cross-check of the Jacobian trace failed: an internal error, never a report."""


class TraceOverflow(ArithmeticError):
    """||J||_F^2 is not finite in float32 on some samples: the model's derivatives are too large
    (beyond about 1e19), a property of the model, not of this code; no bound can be computed."""


@dataclass(frozen=True)
class MeanOptions:
    """rtol: target stderr(mean) / mean of the randomised estimate; min_samples: the randomised
    estimate covers at least this many samples (or all), for the histogram."""

    rtol: float = 0.02
    min_samples: int = 256
    max_probes: int = 256
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    generator: torch.Generator | None = None
    runner: "JobRunner | None" = None  # where the shards run (None: here, one after the other)


@dataclass(frozen=True)
class Shard:
    """The samples a job works on; a job travels to a worker's device with them."""

    x: Tensor

    def to(self, device):
        return dataclasses.replace(self, x=self.x.to(device))


@dataclass(frozen=True)
class ProbeJob(Shard):
    """`probes` Rademacher probes of one AD side on each sample of x: [3, N] count, sum, sum of squares."""

    side: str
    probes: int
    plan: Plan
    memory_bytes: int
    seed: int

    def run(self, f: BatchFn) -> Tensor:
        with torch.no_grad(), seeded_draws(self.seed, self.x.device):
            return probe_sums(
                f, self.x, self.side, self.probes, self.plan, self.memory_bytes, _seeded(self.x, self.seed)
            )


@dataclass(frozen=True)
class ExactJob(Shard):
    """One exact (or finite-difference) method on each sample of x: a TraceEstimate. With draws > 1
    (a stochastic encoder) the method runs that many times, each on fresh draws of the encoder's
    randomness, and the per-sample mean over them carries their standard error."""

    method: str
    memory_bytes: int
    max_probes: int
    seed: int
    draws: int = 1
    fd_step: float | None = None  # finite differences: the step chosen once for every shard

    def run(self, f: BatchFn) -> TraceEstimate:
        options = TraceOptions(
            memory_bytes=self.memory_bytes,
            max_probes=self.max_probes,
            generator=_seeded(self.x, self.seed),
            fd_step=self.fd_step,
        )
        with seeded_draws(self.seed, self.x.device):
            repeats = [jacobian_trace(f, self.x, self.method, options) for _ in range(self.draws)]
        return repeats[0] if self.draws == 1 else averaged_over_draws(repeats)


def averaged_over_draws(repeats: list[TraceEstimate]) -> TraceEstimate:
    """Per-sample mean of estimates on independent draws, with its standard error (the draws'
    spread over sqrt(count), plus the estimates' own probe error): no longer exact."""
    values = torch.stack([r.values.double() for r in repeats])
    probe_var = torch.stack([r.stderr.double().pow(2) for r in repeats]).mean(0) / len(repeats)
    stderr = (values.var(0) / len(repeats) + probe_var).sqrt()
    dtype = repeats[0].values.dtype
    return dataclasses.replace(
        repeats[0], values=values.mean(0).to(dtype), stderr=stderr.to(dtype), exact=False, draws=len(repeats)
    )


Job = Union[ProbeJob, ExactJob]
# Runs the jobs (anywhere), calling on_samples(n) as a job of n samples finishes; returns their
# results in the jobs' order.
JobRunner = Callable[[list[Job], Callable[[int], None]], list]


def run_here(f: BatchFn) -> JobRunner:
    """The default runner: every job in this process, in order."""

    def run(jobs: list[Job], on_samples: Callable[[int], None]) -> list:
        results = []
        for job in jobs:
            results.append(job.run(f))
            on_samples(len(job.x))
        return results

    return run


def _seeded(like: Tensor, seed: int) -> torch.Generator:
    return torch.Generator(like.device).manual_seed(seed)


def _next_seed(generator: torch.Generator | None) -> int:
    """A job's seed, drawn in order from the estimate's generator (reproducible wherever the job runs)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device))


@dataclass
class MeanTrace:
    """Per-sample traces at x[index], their mean over samples and its standard error, the check."""

    traces: TraceEstimate
    index: Tensor
    mean: float
    stderr: float
    rtol: float
    total_products: int
    check: dict = field(default_factory=dict)
    fd_choice: StepChoice | None = None  # black-box: the pilot that chose the finite-difference step
    choice: str = ""  # which method ran and why, in words for the report

    @property
    def fd_error(self) -> float:
        """Finite-difference error of the mean (0 with autograd): the mean of the per-sample
        two-step differences, which bounds the mean's truncation error where each sample's does."""
        error = self.traces.fd_error
        return float(error.double().mean()) if error is not None else 0.0

    @property
    def fd_relative_error(self) -> float:
        """fd_error / mean; inf where the trace at the fine step is 0 but not at the coarse one."""
        if self.mean > 0:
            return self.fd_error / self.mean
        return 0.0 if self.fd_error == 0 else math.inf

    @property
    def approximate(self) -> bool:
        """Finite differences whose error could not be bounded: the pilot did not settle or the two
        steps differ too much (fd_error_bounded), or fresh probes at another step disagree beyond it
        (cross_check). No guarantee rests on such an estimate."""
        if self.traces.fd_error is None:
            return False
        return not fd_error_bounded(self.fd_choice, self.fd_relative_error) or not self.check.get("passed", True)

    def interval(self, z: float = Z_95) -> tuple[float, float]:
        """Normal confidence interval of the mean (95% by default) widened by the finite-difference
        error on both sides, clipped at 0."""
        half = z * self.stderr + self.fd_error
        return max(0.0, self.mean - half), self.mean + half


def estimate_mean_trace(
    f: BatchFn,
    x: Tensor,
    method: str = "auto",
    options: MeanOptions = MeanOptions(),
    on_samples: Callable[[int], None] = lambda n: None,
) -> MeanTrace:
    """E||J_f||_F^2 over the samples x (see the module docstring); on_samples(n) reports progress."""
    with torch.no_grad():
        plan = measure_plan(f, x, differentiable=differentiates(method))
        if method == "auto":
            return _auto(f, x, plan, options, on_samples)
        if method == "hutchinson":
            result = _randomised(f, x, plan, options, on_samples)
        else:
            result = _exact(f, x, method, options, on_samples)
        result.choice = ASKED.get(method, f"{method}, as asked for")
        return result


def default_method(differentiable: bool) -> str:
    """The method an audit asks for: auto on an autograd model, central differences on a black box."""
    return "auto" if differentiable else "finite-difference"


def exact_is_preferred(products_per_sample: int, n: int, randomised_products: float) -> bool:
    """auto's choice: exact on every one of n samples when that needs at most EXACT_PRODUCTS
    products per sample, or at most EXACT_PREFERENCE times the randomised estimate's products."""
    return products_per_sample <= EXACT_PRODUCTS or n * products_per_sample <= EXACT_PREFERENCE * randomised_products


def _call(step: Callable[[], None]) -> None:
    step()


@dataclass(frozen=True)
class AutoChoice:
    """What "auto" settles on before it runs: the cheapest exact method and its products per sample,
    and where those are too many to take without looking, the pilot's probe sampler and the
    products it predicts; `exact` says which way it went."""

    exact: bool
    method: str
    products: int
    sampler: "ProbeSampler | None" = None
    predicted: int = 0


def auto_choice(
    f: BatchFn, x: Tensor, plan: Plan, options: MeanOptions, run_pilot: Callable[[Callable[[], None]], object] = _call
) -> AutoChoice:
    """auto's choice on the samples x: exact when that needs at most EXACT_PRODUCTS products per
    sample (no pilot); else a pilot of random probes (run by `run_pilot`, which may time it)
    predicts the randomised run's products, and exact is kept when it costs at most
    EXACT_PREFERENCE times that."""
    cheapest, per_sample = cheapest_exact(f, x, plan)
    products = per_sample * exact_draws(f)
    if products <= EXACT_PRODUCTS:
        return AutoChoice(True, cheapest, products)
    sampler = ProbeSampler(f, x, plan, options)
    run_pilot(sampler.pilot)
    predicted = sampler.predicted_products()
    return AutoChoice(exact_is_preferred(products, len(x), predicted), cheapest, products, sampler, predicted)


@dataclass(frozen=True)
class PlannedTrace:
    """The Jacobian products estimate_mean_trace is expected to take (its cross-check included), and
    the pilot's products spent finding out (0 where no pilot ran): the time they took is one
    product's of the kind the run takes."""

    products: int
    pilot_products: int = 0


def planned_products(
    f: BatchFn, x: Tensor, method: str, options: MeanOptions, run_pilot: Callable[[Callable[[], None]], object] = _call
) -> PlannedTrace:
    """What estimate_mean_trace(f, x, method, options) is expected to take, by auto's own choice on x
    (its pilot included, where auto runs one, by `run_pilot`): exact on every sample, or the
    randomised run's products as its pilot predicts them. Central differences: a typical randomised
    run's probes, at four forward passes each. audit/stages/cost.py's up-front estimate."""
    check = CHECK_SAMPLES * CHECK_PROBES
    if not differentiates(method):
        return PlannedTrace(4 * (min(len(x), options.min_samples) * RANDOMISED_PROBES + check))
    plan = measure_plan(f, x)
    choice = auto_choice(f, x, plan, options, run_pilot)
    pilot = int(choice.sampler.sums[0].sum()) if choice.sampler is not None else 0
    return PlannedTrace((len(x) * choice.products if choice.exact else choice.predicted) + check, pilot)


def _auto(f: BatchFn, x: Tensor, plan: Plan, options: MeanOptions, on_samples) -> MeanTrace:
    choice = auto_choice(f, x, plan, options)
    why = exact_choice(f, x, plan, choice.method)
    if choice.exact:
        return _chosen(_exact(f, x, choice.method, options, on_samples), why)
    return _chosen(
        choice.sampler.finish(on_samples),
        f"random probes (Hutchinson): the cheapest exact method would take {choice.products * len(x)} products on "
        f"{len(x)} samples, more than {EXACT_PREFERENCE:g} times the probes' expected {choice.predicted:.0f}; it is "
        f"{why}",
    )


def _chosen(result: MeanTrace, why: str) -> MeanTrace:
    result.choice = why
    return result


def _randomised(f: BatchFn, x: Tensor, plan: Plan, options: MeanOptions, on_samples) -> MeanTrace:
    sampler = ProbeSampler(f, x, plan, options)
    sampler.pilot()
    return sampler.finish(on_samples)


def _exact(f: BatchFn, x: Tensor, method: str, options: MeanOptions, on_samples) -> MeanTrace:
    """One exact (or finite-difference) method on every sample, in shards (finite differences at
    one step, chosen here on a pilot)."""
    choice = None
    if method == "finite-difference":
        pilot = TraceOptions(memory_bytes=options.memory_bytes, generator=_seeded(x, _next_seed(options.generator)))
        choice = choose_fd_step(f, x, pilot, measure_plan(f, x, differentiable=False))
    chunks = x.split(EXACT_SHARD)
    draws = exact_draws(f)
    jobs = [
        ExactJob(
            chunk,
            method,
            options.memory_bytes,
            options.max_probes,
            _next_seed(options.generator),
            draws,
            fd_step=choice.step if choice else None,
        )
        for chunk in chunks
    ]
    runner = options.runner or run_here(f)
    traces = concatenated([part.to(x.device) for part in runner(jobs, on_samples)])
    index = torch.arange(len(x), device=x.device)
    result = summarised(traces, index, options.rtol, traces.products * len(x))
    result.fd_choice = choice
    result.check = cross_check(f, x, result, method_named(method).side, options)
    return result


def exact_draws(f: BatchFn) -> int:
    """Repetitions of an exact method per sample: one, or STOCHASTIC_DRAWS for a stochastic f."""
    return STOCHASTIC_DRAWS if is_stochastic(f) else 1


def summarised(traces: TraceEstimate, index: Tensor, rtol: float, total_products: int) -> MeanTrace:
    """Mean over samples; its standard error is the spread of the per-sample values / sqrt(n),
    which holds sampling spread and probe noise together."""
    values = traces.values.double()
    n = len(values)
    stderr = float(values.std()) / math.sqrt(n) if n > 1 else math.inf
    return MeanTrace(
        traces=traces, index=index, mean=float(values.mean()), stderr=stderr, rtol=rtol, total_products=total_products
    )


class ProbeSampler:
    """Running sums of ||J v||^2 over Rademacher probes, per sample, and the allocation rule."""

    def __init__(self, f: BatchFn, x: Tensor, plan: Plan, options: MeanOptions) -> None:
        self.f, self.x, self.plan, self.options = f, x, plan, options
        self.side = "inputs" if forward_mode_works(f, x) else "outputs"
        generator = options.generator
        device = generator.device if generator is not None else "cpu"
        self.order = torch.randperm(len(x), generator=generator, device=device).to(x.device)
        self.sums = torch.zeros(3, len(x), dtype=torch.float64, device=x.device)  # count, sum, sum of squares
        self.n = 0  # samples taken, in self.order
        self.k = PILOT_PROBES

    def add(self, positions: Tensor, probes: int, on_samples: Callable[[int], None] = lambda n: None) -> None:
        """`probes` more probes on each sample x[positions], in shards of at most PROBE_SHARD samples
        (fewer where the memory budget says so); on_samples(n) as each shard's n samples are done."""
        per_call = max(1, self.options.memory_bytes // (self.plan.bytes_per_product * MIN_DIRECTIONS_PER_CHUNK))
        shards = positions.split(min(per_call, PROBE_SHARD))
        memory, gen = self.options.memory_bytes, self.options.generator
        jobs = [ProbeJob(self.x[s], self.side, probes, self.plan, memory, _next_seed(gen)) for s in shards]
        runner = self.options.runner or run_here(self.f)
        for shard, sums in zip(shards, runner(jobs, on_samples)):
            self.sums[:, shard] += sums.to(self.sums.device)

    def stats(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(probe count, per-sample mean, per-sample probe variance) at positions."""
        count, total, total_sq = self.sums[:, positions]
        mean = total / count
        return count, mean, ((total_sq - count * mean.pow(2)) / (count - 1)).clamp(min=0)

    def pilot(self) -> None:
        self.n = min(len(self.x), PILOT_SAMPLES)
        self.add(self.order[: self.n], PILOT_PROBES)
        self._plan_allocation()

    def _plan_allocation(self) -> None:
        """k and the sample count that reach stderr <= rtol * mean at the fewest products."""
        count, t, v = self.stats(self.order[: self.n])
        mean = float(t.mean())
        v_probe = float(v.mean())
        spread = float(t.var()) - float((v / count).mean()) if self.n > 1 else 0.0
        v_between = max(spread, (1e-3 * mean) ** 2, 1e-30)
        target = (self.options.rtol * mean) ** 2
        cap = self.options.max_probes
        self.k = min(cap, max(MIN_PROBES, math.ceil(math.sqrt(v_probe / v_between))))
        need = math.ceil((v_between + v_probe / self.k) / target) if target > 0 else len(self.x)
        self.planned_n = min(len(self.x), max(need, self.options.min_samples, self.n))
        if self.planned_n == len(self.x) and (v_between + v_probe / self.k) / len(self.x) > target:
            room = len(self.x) * target - v_between
            self.k = cap if room <= 0 else min(cap, max(self.k, math.ceil(v_probe / room)))

    def _replan(self) -> None:
        """After a round that missed the target: more samples while some are left, else more probes."""
        k_before = self.k
        self._plan_allocation()
        if self.n < len(self.x):
            self.k = max(self.k, k_before)
            self.planned_n = max(self.planned_n, min(len(self.x), math.ceil(1.5 * self.n)))
        else:
            self.k = min(self.options.max_probes, max(self.k, 2 * k_before))

    def predicted_products(self) -> int:
        return self.planned_n * self.k + LEAKIEST * self.options.max_probes // 4

    def finish(self, on_samples: Callable[[int], None]) -> MeanTrace:
        """Take samples and probes until the mean's standard error is rtol of it, refine the leakiest."""
        on_samples(self.n)
        while True:
            self._top_up(self.order[: self.n], self.k)
            if self.planned_n > self.n:
                self.add(self.order[self.n : self.planned_n], self.k, on_samples)
                self.n = self.planned_n
            count, t, _ = self.stats(self.order[: self.n])
            if float(t.std()) / math.sqrt(self.n) <= self.options.rtol * float(t.mean()) or self.n < 2:
                break
            if self.n == len(self.x) and self.k >= self.options.max_probes:
                break
            self._replan()
        self._refine_leakiest()
        return self._result()

    def _top_up(self, positions: Tensor, k: int) -> None:
        """Bring every sample at positions to at least k probes."""
        count = self.sums[0, positions]
        for missing in torch.unique(k - count.long()).tolist():
            if missing > 0:
                self.add(positions[(k - count.long()) == missing], missing)

    def _refine_leakiest(self) -> None:
        """Probes on the LEAKIEST largest samples until their relative stderr is rtol (or max_probes)."""
        positions = self.order[: self.n]
        while True:  # re-ranked after each round: refined values can change the leakiest
            top = positions[torch.argsort(self.stats(positions)[1], descending=True)[:LEAKIEST]]
            count, t, v = self.stats(top)
            open_ = ((v / count).sqrt() > self.options.rtol * t) & (count < self.options.max_probes)
            if not bool(open_.any()):
                return
            for position, c in zip(top[open_].tolist(), count[open_].long().tolist()):
                self.add(torch.tensor([position], device=self.x.device), min(c, self.options.max_probes - c))

    def _result(self) -> MeanTrace:
        index = self.order[: self.n].sort().values
        count, t, v = self.stats(index)
        traces = TraceEstimate(
            values=t.to(self.x.dtype),
            stderr=(v / count).sqrt().to(self.x.dtype),
            method="hutchinson" if self.side == "inputs" else "hutchinson-reverse",
            exact=False,
            products=int(count.median()),
        )
        result = summarised(traces, index, self.options.rtol, int(self.sums[0].sum()))
        result.check = cross_check(self.f, self.x, result, self.side, self.options)
        return result


def probe_sums(
    f: BatchFn,
    x: Tensor,
    side: str,
    probes: int,
    plan: Plan,
    memory_bytes: int,
    generator: torch.Generator | None,
    fd_step: float | None = None,
) -> Tensor:
    """[3, N]: count, sum and sum of squares of ||J v||^2 (side "inputs") or ||J^T u||^2 (side
    "outputs") over `probes` Rademacher probes per sample; side "differences" takes J v by central
    differences at fd_step (black-box)."""
    if side == "differences":
        like, products = x, lambda v: _fd_products(f, x, v, (fd_step,))[:, :, 0]
    else:
        like, products = product_fn(f, x, side)
    chunk = plan.directions_per_chunk(len(x), memory_bytes)
    sums = torch.zeros(3, len(x), dtype=torch.float64, device=x.device)
    done = 0
    while done < probes:
        n = min(chunk, probes - done)
        sq = _squared_norms(products(rademacher((n, *like.shape), like, generator))).double()
        sums += torch.stack([torch.full_like(sq[0], n), sq.sum(0), sq.pow(2).sum(0)])
        done += n
    return sums


def cross_check(f: BatchFn, x: Tensor, result: MeanTrace, side: str, options: MeanOptions) -> dict:
    """Compare the trace on CHECK_SAMPLES samples with independent random products of the other
    AD mode (reverse when the method used forward mode, and vice versa where forward mode works);
    side "differences" (black-box) with central differences on fresh Rademacher probes at
    CHECK_FD_STEP_FACTOR times the run's step, between the run's two steps.

    E||J^T u||^2 = E||J v||^2 = ||J||_F^2 for Rademacher u, v: unbiased, so the sums over the
    samples may differ only by their combined standard error (and, for differences, the run's
    measured finite-difference error: the check's step lies between the two it came from).
    Probes are added until the check's standard error is CHECK_RTOL of its value; beyond CHECK_Z
    standard errors (plus float rounding) the trace is wrong (a zero or doubled trace is caught)
    and TraceCheckError stops the caller. A black-box disagreement is reported, not raised: it
    says the finite-difference error is not bounded (MeanTrace.approximate), a property of the
    model (a jump, internal noise) more likely than of this code.
    For a stochastic f each check probe sees its own draw, so the check's standard error holds the
    draws' spread, as the method's does (averaged_over_draws or probe noise).
    """
    infinite = int((~torch.isfinite(result.traces.values)).sum())
    if infinite:
        raise TraceOverflow(
            f"the model's squared Jacobian norm ||J||_F^2 overflows float32 on {infinite} of "
            f"{len(result.traces.values)} samples: its derivatives are too large to audit; scale its output down"
        )
    positions = torch.arange(min(CHECK_SAMPLES, len(result.index)), device=x.device)
    samples = x[result.index[positions]]
    differences = side == "differences"
    plan = measure_plan(f, samples, differentiable=not differences)
    if differences:
        other = "differences"
    else:
        other = "outputs" if side == "inputs" or not forward_mode_works(f, x) else "inputs"
    step = CHECK_FD_STEP_FACTOR * result.traces.fd_step if differences else None
    sums = torch.zeros(3, len(samples), dtype=torch.float64, device=x.device)
    probes = CHECK_PROBES
    while True:
        with seeded_draws(_next_seed(options.generator), x.device):  # a stochastic f's draws: fresh per probe
            more = probe_sums(
                f, samples, other, probes - int(sums[0, 0]), plan, options.memory_bytes, options.generator, step
            )
        sums += more
        count, total, total_sq = sums
        per_sample = total / count
        check_var = float((((total_sq - count * per_sample.pow(2)) / (count - 1)).clamp(min=0) / count).sum())
        check_sum = float(per_sample.sum())
        if math.sqrt(check_var) <= CHECK_RTOL * check_sum or probes >= CHECK_MAX_PROBES:
            break
        probes = min(CHECK_MAX_PROBES, 2 * probes)
    method_sum = float(result.traces.values[positions].double().sum())
    method_var = float(result.traces.stderr[positions].double().pow(2).sum())
    fd_error = float(result.traces.fd_error[positions].double().sum()) if differences else 0.0
    tolerance = CHECK_Z * math.sqrt(check_var + method_var) + CHECK_ROUNDING * abs(check_sum) + fd_error
    mode = {"outputs": "reverse", "inputs": "forward"}.get(other, "finite-difference")
    report = {
        "performed": True,
        "samples": len(samples),
        "probes_per_sample": probes,
        "mode": mode,
        "method_sum": method_sum,
        "check_sum": check_sum,
        "check_stderr": math.sqrt(check_var),
        "tolerance": tolerance,
        "passed": abs(method_sum - check_sum) <= tolerance,
    }
    if differences:  # a black-box disagreement is the model's (a jump, noise): the estimate is approximate
        report["fd_step"] = step
    elif not report["passed"]:
        raise TraceCheckError(
            f"Jacobian trace self-check failed: {result.traces.method} gives {method_sum:.6g} on {len(samples)} "
            f"samples, independent {mode} probes {check_sum:.6g} +- {math.sqrt(check_var):.3g} "
            f"(tolerance {tolerance:.3g}); the Jacobian products of this model are unreliable, so no bound is reported"
        )
    return report
