"""Sequential exact inversion: a causal bottom's hidden states back to the text, position by position.

SIPIT (Nikolaou et al., ICLR 2026): in a causal language model the hidden state at position t
depends on tokens 1..t only, and the map from a prefix to its last state is injective, so the
sentence is found one position at a time: with the prefix 1..t-1 already recovered, run the
bottom on [prefix, v] for every vocabulary entry v and keep the v whose state at t is the observed
one. No training, no auxiliary data beyond the vocabulary: the attacker needs query access to the
bottom (forward passes) and the observed states.

Causality is checked, not assumed (`causality_violation`): on a few aux sentences, changing the
token at each position must leave every earlier state unchanged; a bidirectional bottom is
refused with the first position whose change moved an earlier state.

Under noise z = f(x) + N(0, sigma^2 I) the candidate whose clean state is nearest the observed one
is the maximum-likelihood choice at that position (the Gaussian log-likelihood is
-||f_t(prefix, v) - z_t||^2 / (2 sigma^2) plus a constant). An attacker holding aux sentences also
knows which token tends to follow which: with `prior=aux` (the default) each candidate's score adds
-log p_t(v | previous token), the aux sentences' bigrams at that position backing off (Witten-Bell)
to their bigrams anywhere and to the token frequencies at that position and overall, so the choice
is the maximum a posteriori one and, as the noise grows, falls back to what the text alone predicts
instead of to noise (`prior=none`: maximum likelihood). A beam keeps the `beam` prefixes of least summed score (the most probable prefixes),
so an early wrong choice can be undone. At sigma = 0 the prior is not used: the true prefix is the
only one at distance 0, so one hypothesis suffices, and each sentence scores its candidates in
chunks, likeliest first after its previous token in the aux sentences, and stops at the chunk
holding its token within float32 rounding (the whole vocabulary when none is): the order changes
no result, only how soon the exact match comes.

Cost: V x T (x beam) candidate evaluations per sentence at most. A Hugging Face checkpoint's bottom
computes the prefixes' keys and values once per position and scores many candidates per call as
queries over them (two pairs per position confirmed against the bottom's own forward), so a
candidate costs one position's forward pass; ONNX and TorchScript graphs run whole sequences and
keep no state between calls, so each candidate costs a forward pass of the full length.
`max_sentences` bounds it, and the up-front cost estimate times it.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.parts.text_metrics import token_outcome
from splitaudit.attacks.token_inversion import sequence_states
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.options import option
from splitaudit.core.threads import threads_for
from splitaudit.estimators.token_information import position_counts
from splitaudit.inputs.raw_model import Normalized
from splitaudit.inputs.tokens import bound_mask, mask_groups

CAUSALITY_SAMPLES = 2  # aux sentences the causality check perturbs at every position
CAUSAL_RTOL = 1e-5  # an earlier state moved by more than this share of the states' largest value: not causal
CANDIDATE_VALUES = 2**22  # values held per chunk of candidates on a CPU (16 MiB float32)
GPU_CANDIDATE_VALUES = 2**27  # the same on a GPU (512 MiB float32)
FIRST_CHUNK = 16  # candidates per sentence in the first chunk at sigma 0 (doubling after each miss)
PREFIX_STATES = {
    "cached": (
        "cached: the prefixes' keys and values are computed once per position and the candidates are scored "
        "as queries over them, many per call (confirmed against the bottom's own forward at every position)"
    ),
    "recomputed": (
        "recomputed: the bottom runs whole sequences and keeps no state between calls, so each candidate "
        "scored costs a forward pass of the full length"
    ),
}
# Causality verdicts by encoder (the check runs forward passes; missing() is asked at every stage).
_CAUSALITY: dict[int, tuple[weakref.ref, str | None]] = {}


@runtime_checkable
class PrefixCached(Protocol):
    """A causal bottom that computes prefixes' keys and values once and then scores many candidate
    tokens at the next position per call (audit/inputs/hf_checkpoints.py's CheckpointBottom)."""

    def prefix_cache(self, prefix: torch.Tensor, mask: torch.Tensor | None): ...

    def extend(self, cache, steps: torch.Tensor, mask: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor: ...

    def candidates_per_call(self, cache, budget: int) -> int: ...


@dataclass(frozen=True)
class SequentialInversionOptions:
    """`[attack.sequential-inversion]`: the search's width and its cost bound."""

    beam: int = option(4, "prefixes kept per sentence under noise (one at sigma 0, where only the truth fits)", low=1)
    max_sentences: int = option(64, "target sentences inverted (each costs vocabulary x length passes)", low=1)
    quick_max_sentences: int = option(16, "target sentences inverted under --quick", low=1)
    candidates: int | None = option(
        None, "vocabulary entries scored per position: all when unset, else the most frequent aux tokens", low=1
    )
    prior: str = option(
        "aux",
        "under noise, add the aux bigram prior (maximum a posteriori) or none (maximum likelihood)",
        choices=("aux", "none"),
    )


class SequentialInversionAttack(Attack):
    """Exact sequential inversion of a causal bottom (SIPIT, Nikolaou et al., ICLR 2026).

    Each position's token is the vocabulary entry whose state after the recovered prefix is nearest
    the observed state (maximum likelihood under the deployed Gaussian noise), with a beam of the
    most likely prefixes. Refused on a bottom whose states depend on later tokens.
    Options (`[attack.sequential-inversion]`): beam, max_sentences (quick_max_sentences under --quick),
    candidates, prior.
    Example: `splitaudit run bottom.onnx --aux tokens.npz --vocab vocab.json --attacks sequential-inversion`.
    """

    name = "sequential-inversion"
    kind = "label"
    primary_metric = "token_accuracy"
    relative_cost = 5.0
    input_kinds = frozenset({"tokens"})
    other_kinds_reason = "needs token inputs (--vocab): it reconstructs token ids"
    title = "Sequential exact inversion (SIPIT)"
    baseline_name = "the most frequent aux token at each position"
    metrics = ("token_accuracy", "exact_match", "rouge_l", "bleu", "rare_token_recall")
    Options = SequentialInversionOptions
    assumptions = (
        "The attacker observes the target hidden states (with the deployed noise), knows the noise level and "
        "can run the bottom model on token sequences of its choice (query access, no gradients, no training); "
        "the bottom must be causal (each state depends on the tokens up to its position only), which the audit "
        "checks. It searches the vocabulary position by position for the most likely sentence."
    )

    def missing(self, ctx: AuditContext) -> str | None:
        reason = super().missing(ctx)
        if reason or ctx.space.kind != "tokens":
            return reason
        if ctx.encoder.output_shape[:1] != ctx.aux.token_ids.shape[1:]:
            return f"needs one hidden state per position; the model outputs shape {list(ctx.encoder.output_shape)}"
        if ctx.encoder.stochastic:
            return (
                "the bottom draws randomness inside forward: a candidate's state cannot be compared exactly with "
                "the observed one"
            )
        return cached_causality(ctx)

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        opts = self.options(ctx)
        index = torch.arange(min(opts.max_sentences, len(ctx.target)), device=ctx.device)
        observed = sequence_states(ctx.observed_embeddings("target", ctx.generator(seed)))[index]
        candidates = candidate_ids(ctx, opts.candidates)
        width = search_width(ctx, opts)
        mask = None if ctx.target.mask is None else ctx.target.mask[index]
        start = time.perf_counter()
        with threads_for(ctx.aux.x.numel(), ctx.device):
            pred, residual, passes = invert(ctx, observed, mask, candidates, width, opts.prior)
        seconds = time.perf_counter() - start
        if ctx.noise_sigma == 0 and residual > exact_tolerance(observed):
            raise RuntimeError(
                f"at sigma 0 a recovered sentence's states are {math.sqrt(residual):.3g} from the observed ones, "
                f"more than rounding leaves ({math.sqrt(exact_tolerance(observed)):.3g}): the bottom did not "
                "reproduce its own states"
            )
        metrics, baseline, token_details = token_outcome(ctx, ctx.target.token_ids[index], pred, index)
        details = {
            "tokens": token_details,
            "sentences_inverted": len(index),
            "target_sentences": len(ctx.target),
            "candidates": len(candidates),
            "vocab_size": ctx.tokens.size,
            "beam": width,
            "forward_passes": passes,
            "seconds_per_sentence": seconds / len(index),
            "prefix_states": PREFIX_STATES["cached" if prefix_cached_bottom(ctx) else "recomputed"],
            "prior": opts.prior if ctx.noise_sigma > 0 else "none (sigma 0)",
        }
        if ctx.noise_sigma == 0:
            details["largest_squared_distance"] = residual
        return SeedOutcome(metrics=metrics, baseline=baseline, details=details)

    def estimated_seconds(self, ctx: AuditContext, pass_seconds: float, timed) -> float:
        """Every seed: (candidates x beam) pairs at each real position of each inverted sentence, a
        pair's cost timed midway through the first target sentence on the path that runs."""
        opts = self.options(ctx)
        n = min(opts.max_sentences, len(ctx.target))
        positions = n * ctx.target.token_ids.shape[1] if ctx.target.mask is None else int(ctx.target.mask[:n].sum())
        candidates = candidate_ids(ctx, opts.candidates)
        per_pair = pair_seconds(ctx, candidates, timed)
        return len(ctx.seeds) * positions * len(candidates) * search_width(ctx, opts) * per_pair


def search_width(ctx: AuditContext, opts: SequentialInversionOptions) -> int:
    """The beam: one hypothesis at sigma 0, where the true prefix is the only one at distance 0."""
    return 1 if ctx.noise_sigma == 0 else opts.beam


def candidate_ids(ctx: AuditContext, limit: int | None) -> torch.Tensor:
    """The token ids scored at each position, the most frequent in aux first (ties by id): the whole
    vocabulary, or its `limit` most frequent aux tokens."""
    counts = position_counts(ctx.aux.token_ids, ctx.tokens.size, ctx.aux.mask).sum(dim=0)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: limit or ctx.tokens.size].to(ctx.device)


def exact_tolerance(observed: torch.Tensor) -> float:
    """The summed squared distance over a sentence [T, H] that float32 rounding may leave between its
    states and their recomputation: CAUSAL_RTOL of the states' largest value in every coordinate."""
    return position_tolerance(observed) * observed.shape[-2]


def position_tolerance(observed: torch.Tensor) -> float:
    """The squared distance float32 rounding may leave between one position's state [H] and its
    recomputation: CAUSAL_RTOL of the states' largest value in every coordinate."""
    scale = float(observed.abs().max()) if observed.numel() else 0.0
    return (CAUSAL_RTOL * max(scale, 1.0)) ** 2 * observed.shape[-1]


def cached_causality(ctx: AuditContext) -> str | None:
    """causality_violation(ctx), computed once per encoder."""
    key = id(ctx.encoder)
    known = _CAUSALITY.get(key)
    if known is not None and known[0]() is ctx.encoder:
        return known[1]
    verdict = causality_violation(ctx)
    _CAUSALITY[key] = (weakref.ref(ctx.encoder), verdict)
    return verdict


@torch.no_grad()
def causality_violation(ctx: AuditContext, samples: int = CAUSALITY_SAMPLES) -> str | None:
    """None when, on the first `samples` aux sentences, changing the token at each position p leaves
    the states at every real position before p unchanged (within CAUSAL_RTOL of the states' scale);
    else why not, naming the first position whose change moved an earlier state."""
    ids = ctx.aux.token_ids[:samples]
    mask = None if ctx.aux.mask is None else ctx.aux.mask[:samples]
    length = ids.shape[1]
    for i, sentence in enumerate(ids):
        variants = sentence.repeat(length + 1, 1)  # row 0 the sentence, row p + 1 with token p changed
        positions = torch.arange(length, device=ids.device)
        variants[positions + 1, positions] = (sentence + 1) % ctx.tokens.size
        row = None if mask is None else mask[i]
        with bound_mask(ctx.tokens, row):
            states = sequence_states(ctx.encoder.embed(ctx.tokens.embed(variants)))
        moved = (states[1:] - states[0]).abs().amax(dim=-1)  # [changed position, state position]
        tolerance = CAUSAL_RTOL * max(float(states.abs().max()), 1e-12)
        earlier = torch.ones(length, length, dtype=torch.bool, device=moved.device).tril(-1)  # state q < changed p
        if row is not None:
            earlier &= row.to(moved.device)[None, :]
        bad = (moved > tolerance) & earlier
        if bad.any():
            p, q = (int(v) for v in bad.nonzero()[0])
            return (
                f"the bottom is not causal: changing the token at position {p + 1} moved the hidden state at "
                f"position {q + 1} by {float(moved[p, q]):.3g} (positions counted from 1); the sequential "
                "inversion needs states that depend on the tokens up to their position only"
            )
    return None


@torch.no_grad()
def invert(
    ctx: AuditContext,
    observed: torch.Tensor,
    mask: torch.Tensor | None,
    candidates: torch.Tensor,
    width: int,
    prior: str = "none",
) -> tuple[torch.Tensor, float, int]:
    """(recovered ids [N, T], the largest summed score of a kept sentence, forward passes) for
    observed states [N, T, H], sentence by sentence group of one mask pattern, each under its mask.
    The score is the squared distance at sigma 0, the negative log posterior (up to a constant) else."""
    pred = torch.empty(observed.shape[:2], dtype=torch.long, device=observed.device)
    residual, passes = 0.0, 0
    for row, positions in mask_groups(mask, len(observed)):
        positions = positions.to(observed.device)
        with bound_mask(ctx.tokens, row):
            ids, scores, used = beam_search(ctx, observed[positions], row, candidates, width, prior)
        pred[positions] = ids
        residual, passes = max(residual, float(scores.max())), passes + used
    return pred, residual, passes


def beam_search(
    ctx: AuditContext,
    observed: torch.Tensor,
    row: torch.Tensor | None,
    candidates: torch.Tensor,
    width: int,
    prior: str = "none",
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The most probable sentence of each observed state sequence [S, T, H] (positions where `row` is
    False are padding, left as the first candidate), its summed score, and the passes run."""
    n, length = observed.shape[:2]
    hyps = candidates[:1].expand(n, 1, length).clone()  # [S, B, T]
    scores = torch.zeros(n, 1, device=observed.device)
    passes = 0
    for t in range(length):
        if row is not None and not bool(row[t]):
            continue
        stop_at = order = None
        if ctx.noise_sigma == 0:  # the likeliest next tokens first, so the exact match comes early
            stop_at = position_tolerance(observed)
            order = search_order(ctx, hyps, t, candidates)
        distances, scored = candidate_distances(ctx, hyps, t, candidates, observed[:, t], row, stop_at, order)
        passes += scored
        step = distances
        if ctx.noise_sigma > 0:
            step = distances / (2 * ctx.noise_sigma**2)
            if prior == "aux":
                step = step - aux_log_prior(ctx, hyps, t, candidates)
        total = (scores[:, :, None] + step).flatten(1)
        scores, best = total.topk(min(width, total.shape[1]), dim=1, largest=False)
        hyps = hyps.gather(1, (best // len(candidates))[:, :, None].expand(-1, -1, length)).clone()
        hyps[:, :, t] = candidates[best % len(candidates)]
    return hyps[:, 0], scores[:, 0], passes


def candidate_distances(
    ctx: AuditContext,
    hyps: torch.Tensor,
    t: int,
    candidates: torch.Tensor,
    target: torch.Tensor,
    row: torch.Tensor | None = None,
    stop_at: float | None = None,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """(||f_t(hyp with token t = v) - target||^2 for every hypothesis [S, B, T] and candidate v [K]: [S, B, K],
    the (hypothesis, candidate) pairs scored). Each hypothesis scores its candidates in chunks, in its
    `order` [S * B, K] (default: the candidates' own); with `stop_at` (sigma 0) a hypothesis stops at the
    chunk holding a candidate within it (the rest left at +inf) while the others go on."""
    n, width, length = hyps.shape
    prefixes = hyps.reshape(n * width, length)
    goal = target.repeat_interleave(width, dim=0)  # [S * B, H]
    if order is None:
        order = torch.arange(len(candidates), device=hyps.device).expand(len(prefixes), -1)
    bottom = prefix_cached_bottom(ctx)
    if bottom is None:
        score, per_call = whole_sequence_scorer(ctx, prefixes, t, goal)
    else:
        score, per_call = cached_scorer(ctx, bottom, prefixes, t, goal, row, candidates[order[:, [0, -1]]])
    out = torch.full(order.shape, math.inf, device=hyps.device)
    active, pairs = torch.arange(len(prefixes), device=hyps.device), 0
    for columns in column_ranges(len(candidates), per_call, FIRST_CHUNK if stop_at is not None else per_call):
        places = order[active][:, columns]
        out[active[:, None], places] = score(active, candidates[places])
        pairs += places.numel()
        if stop_at is not None:
            active = active[out[active].amin(dim=1) > stop_at]
            if len(active) == 0:
                break
    return out.reshape(n, width, len(candidates)), pairs


def whole_sequence_scorer(ctx: AuditContext, prefixes: torch.Tensor, t: int, goal: torch.Tensor):
    """(score(rows [R], tokens [R, Kc]) -> [R, Kc] distances with every sequence run whole, as a bottom that
    keeps no state between calls needs; candidates per call within candidate_values(device) input values)."""
    per_call = whole_sequences_per_call(ctx, len(prefixes), prefixes.shape[1], prefixes.device)

    def score(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        states = whole_sequence_states(ctx, prefixes, t, rows.repeat_interleave(tokens.shape[1]), tokens.reshape(-1))
        return (states.reshape(*tokens.shape, -1) - goal[rows, None]).pow(2).sum(dim=-1)

    return score, per_call


def whole_sequences_per_call(ctx: AuditContext, prefixes: int, length: int, device: torch.device) -> int:
    """Candidates per call when every sequence runs whole: within candidate_values(device) input values."""
    return max(1, candidate_values(device) // (prefixes * length * ctx.tokens.table.shape[1]))


def cached_scorer(
    ctx: AuditContext,
    bottom: PrefixCached,
    prefixes: torch.Tensor,
    t: int,
    goal: torch.Tensor,
    row: torch.Tensor | None,
    ends: torch.Tensor,
):
    """(score(rows [R], tokens [R, Kc]) -> [R, Kc] distances from the prefixes' cached keys and values,
    candidates per call within what the memory budget allows), the cache first confirmed on `ends`
    [P, 2] (each prefix's first and last candidates) against the bottom's own forward."""
    cache = bottom.prefix_cache(ctx.tokens.embed(prefixes[:, :t]), row)
    confirm_cached_states(ctx, bottom, cache, prefixes, t, ends, row)

    def score(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        states = bottom.extend(cache, ctx.tokens.table[tokens], row, rows)
        return (states - goal[rows, None]).pow(2).sum(dim=-1)

    return score, bottom.candidates_per_call(cache, candidate_values(prefixes.device))


def column_ranges(k: int, per_call: int, first: int) -> Iterator[slice]:
    """Column ranges over [0, k): `first` columns, then twice as many each time, at most `per_call`: small
    first chunks when the search may stop early, full ones when it scores every column."""
    start, size = 0, max(1, min(first, per_call))
    while start < k:
        yield slice(start, start + size)
        start, size = start + size, min(2 * size, per_call)


def whole_sequence_states(
    ctx: AuditContext, prefixes: torch.Tensor, t: int, p: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """The states [M, H] at position t of the sequences prefixes[p] with `tokens` [M] at t, run whole."""
    ids = prefixes[p].clone()
    ids[:, t] = tokens
    return sequence_states(ctx.encoder.embed(ctx.tokens.embed(ids)))[:, t]


def confirm_cached_states(
    ctx: AuditContext,
    bottom: PrefixCached,
    cache,
    prefixes: torch.Tensor,
    t: int,
    ends: torch.Tensor,
    row: torch.Tensor | None,
) -> None:
    """RuntimeError when the cached states of two (prefix, candidate) pairs (the first prefix with the first
    of its candidates `ends` [P, 2], the last with its last) differ from running their sequences up to t
    through the bottom's own forward by more than CAUSAL_RTOL of the states' scale: a cache that does not
    reproduce the bottom would make every distance, and the text, wrong. Up to t suffices: the bottom
    was found causal."""
    pair = torch.tensor([0, len(prefixes) - 1], device=ends.device)
    got = bottom.extend(cache, ctx.tokens.table[ends[pair]], row, pair)[[0, 1], [0, 1]]
    with bound_mask(ctx.tokens, None if row is None else row[: t + 1]):
        expected = whole_sequence_states(ctx, prefixes[:, : t + 1], t, pair, ends[pair, [0, 1]])
    error = float((got - expected).abs().max())
    scale = max(float(expected.abs().max()), 1.0)
    if not error <= CAUSAL_RTOL * scale:
        raise RuntimeError(
            f"the bottom's cached prefix states at position {t + 1} differ from running the whole sequence by "
            f"{error:.3g} (states up to {scale:.3g}): the prefix cache does not reproduce the bottom"
        )


@torch.no_grad()
def pair_seconds(ctx: AuditContext, candidates: torch.Tensor, timed) -> float:
    """Seconds per (prefix, candidate) pair at the middle position of the first target sentence, timed on
    a call as full as the search's own (after the cached prefix, or whole sequences): a GPU's time per
    pair falls many times over until its calls are full, so a small call would overstate it."""
    prefixes = ctx.target.token_ids[:1].to(ctx.device)
    t, row = prefixes.shape[1] // 2, None if ctx.target.mask is None else ctx.target.mask[0]
    bottom = prefix_cached_bottom(ctx)
    with bound_mask(ctx.tokens, row):
        if bottom is None:
            chunk = candidates[: whole_sequences_per_call(ctx, 1, prefixes.shape[1], ctx.device)]
            pairs = torch.zeros(len(chunk), dtype=torch.long, device=ctx.device)
            return timed(lambda: whole_sequence_states(ctx, prefixes, t, pairs, chunk)) / len(chunk)
        cache = bottom.prefix_cache(ctx.tokens.embed(prefixes[:, :t]), row)
        chunk = candidates[: bottom.candidates_per_call(cache, candidate_values(ctx.device))]
        first = torch.zeros(1, dtype=torch.long, device=ctx.device)
        return timed(lambda: bottom.extend(cache, ctx.tokens.table[chunk][None], row, first)) / len(chunk)


def prefix_cached_bottom(ctx: AuditContext) -> PrefixCached | None:
    """The audited module when it runs one position after cached prefix states (a Hugging Face
    checkpoint's bottom), else None."""
    fn = ctx.encoder.torch_fn
    fn = fn.unwrapped() if isinstance(fn, Normalized) else fn
    return fn if isinstance(fn, PrefixCached) else None


def candidate_values(device: torch.device) -> int:
    """Values held per chunk of (prefix, candidate) pairs: 16 MiB float32 on a CPU, 512 MiB on a GPU."""
    return CANDIDATE_VALUES if device.type == "cpu" else GPU_CANDIDATE_VALUES


def search_order(ctx: AuditContext, hyps: torch.Tensor, t: int, candidates: torch.Tensor) -> torch.Tensor:
    """Each hypothesis's candidates (indices into `candidates`, [S * B, K]) likeliest first: by how often
    they follow its token at t - 1 anywhere in the aux sentences, ties by their overall aux frequency.
    Position-free counts, as the aux sentences are too few to rank a whole vocabulary at each position."""
    ids = ctx.aux.token_ids
    valid = torch.ones_like(ids, dtype=torch.bool) if ctx.aux.mask is None else ctx.aux.mask
    frequency = torch.bincount(ids[valid], minlength=ctx.tokens.size).float()
    rank = (frequency / (frequency.max() + 1)).expand(hyps.shape[0] * hyps.shape[1], -1).clone()  # < 1: ties only
    if t > 0:
        both = valid[:, :-1] & valid[:, 1:]
        before, after = ids[:, :-1][both], ids[:, 1:][both]
        rows, pairs = (hyps[:, :, t - 1].reshape(-1, 1) == before[None, :]).nonzero(as_tuple=True)
        rank.index_put_((rows, after[pairs]), torch.ones(()), accumulate=True)
    return rank[:, candidates].argsort(dim=1, descending=True, stable=True)


def aux_log_prior(ctx: AuditContext, hyps: torch.Tensor, t: int, candidates: torch.Tensor) -> torch.Tensor:
    """log p_t(v | the hypothesis's token at t - 1) for every hypothesis [S, B, T] and candidate v:
    [S, B, K]. Witten-Bell interpolation (Witten & Bell, IEEE Trans. Inf. Theory 1991), most specific
    first: the aux bigrams at position t back off to the aux bigrams anywhere, those to the tokens at
    position t, those to the tokens anywhere in aux, those to uniform, each level keeping the weight of
    the distinct tokens it has seen. Add-one smoothing over a large vocabulary would leave almost all of
    the mass to tokens aux never showed (over 99% with 50,257 entries and 200 sentences): a prior so
    flat that under heavy noise the search would follow the noise rather than the text."""
    ids = ctx.aux.token_ids
    valid = torch.ones_like(ids, dtype=torch.bool) if ctx.aux.mask is None else ctx.aux.mask
    size = ctx.tokens.size
    uniform = torch.full((size,), 1.0 / size, device=ids.device)
    anywhere = witten_bell(torch.bincount(ids[valid], minlength=size).float(), uniform)
    here = witten_bell(torch.bincount(ids[valid[:, t], t], minlength=size).float(), anywhere)
    n, width = hyps.shape[:2]
    if t == 0:
        return here[candidates].log().expand(n, width, -1)
    previous = hyps[:, :, t - 1].reshape(-1)
    both = valid[:, :-1] & valid[:, 1:]
    following = witten_bell(follower_counts(previous, ids[:, :-1][both], ids[:, 1:][both], size), here)
    at_t = both[:, t - 1]
    following_here = witten_bell(follower_counts(previous, ids[at_t, t - 1], ids[at_t, t], size), following)
    return following_here[:, candidates].log().reshape(n, width, -1)


def follower_counts(previous: torch.Tensor, before: torch.Tensor, after: torch.Tensor, size: int) -> torch.Tensor:
    """[len(previous), size]: how often each token follows each of `previous` among the pairs (before, after)."""
    rows, pairs = (previous[:, None] == before[None, :]).nonzero(as_tuple=True)
    counts = torch.zeros(len(previous), size, device=previous.device)
    counts.index_put_((rows, after[pairs]), torch.ones(()), accumulate=True)
    return counts


def witten_bell(counts: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """(counts + U * base) / (n + U) along the last axis, n the counts' total and U the entries counted at
    least once: the counts' distribution, backing off to `base` by how often a new entry appeared."""
    total = counts.sum(dim=-1, keepdim=True)
    seen = (counts > 0).sum(dim=-1, keepdim=True).float()
    return (counts + seen * base) / (total + seen).clamp_min(1.0) + (total == 0) * base
