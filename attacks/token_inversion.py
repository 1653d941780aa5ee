"""Learned token inversion: hidden states back to the private text (split LLMs).

The learned-inversion attack on split language models (as benchmarked by VFLAIR-LLM, KDD 2025,
and the BiSR attack's learned part, CCS 2024): the attacker runs the bottom model as a black box
on its own auxiliary sentences, adds the deployed noise, and trains a network from each
position's hidden state to that position's token (per-position logits over the vocabulary,
cross-entropy). It then reads the target sentences off their observed hidden states.

SDAR (Zhu et al., NDSS 2025) is skipped on token inputs: its simulator is trained through
discriminators on continuous inputs and its decoder regresses them; for text the inputs are
discrete ids, and a query-free simulator would have to learn the bottom from the embeddings on
without ever querying it, which is not built or validated here. The decoder and optimisation
attacks cover the continuous route (embeddings decoded to the nearest tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.parts.nets import seeded
from splitaudit.attacks.parts.text_metrics import token_outcome
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.options import option
from splitaudit.core.plateau import MIN_PATIENCE_STEPS, Plateau, epochs_of_patience, restore, snapshot
from splitaudit.core.threads import threads_for

IGNORED = -100  # cross_entropy's ignore_index: the label of a padded position
MAX_BATCH_LOGITS = 2**25  # logits held at once (128 MiB): a GPT-2 vocabulary at T = 128 takes 5 sentences a batch


@dataclass(frozen=True)
class TokenInversionOptions:
    """`[attack.token-inversion]`: the inversion network and its training."""

    hidden: int = option(256, "width of the per-position network's hidden layer", low=1)
    epochs: int = option(100, "epoch cap (hold-out early stopping decides)", low=1)
    quick_epochs: int = option(15, "epoch cap under --quick", low=1)
    lr: float = option(3e-3, "Adam learning rate", above=0, high=1)
    batch_size: int = option(64, "training batch size (sentences)", low=1)
    patience: int = option(8, "epochs without a better hold-out loss before stopping", low=1)
    patience_steps: int = option(
        MIN_PATIENCE_STEPS, "optimiser steps the patience spans at least (small aux data: more epochs)", low=0
    )
    holdout_fraction: float = option(0.1, "share of the aux data held out for early stopping", above=0, below=1)


class PositionDecoder(nn.Module):
    """Hidden states [N, T, H] -> token logits [N, T, V]: a token-mixing layer across positions
    (MLP-Mixer style, so that context helps where noise hides a position's own state), one MLP
    shared by every position, and a learned bias per position and token (what the attacker knows
    of each position without the model: under heavy noise it falls back to the baseline's guess)."""

    def __init__(self, length: int, width: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(length, length)
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, vocab))
        self.position_bias = nn.Parameter(torch.zeros(length, vocab))

    @property
    def vocab(self) -> int:
        return self.position_bias.shape[1]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.norm(z)
        h = h + self.mix(h.transpose(1, 2)).transpose(1, 2)
        return self.net(h) + self.position_bias


class TokenInversionAttack(Attack):
    """Per-position token classifier trained on (f(ids_aux) + noise, ids_aux), applied to the targets.

    Options (`[attack.token-inversion]`): hidden, epochs (quick_epochs under --quick), lr,
    batch_size, patience (at least patience_steps optimiser steps), holdout_fraction.
    Example: `splitaudit run bottom.onnx --aux tokens.npz --vocab vocab.json --attacks token-inversion`.
    """

    name = "token-inversion"
    kind = "label"
    primary_metric = "token_accuracy"
    relative_cost = 5.0
    input_kinds = frozenset({"tokens"})
    other_kinds_reason = "needs token inputs (--vocab): it reconstructs token ids"
    title = "Learned token inversion"
    baseline_name = "the most frequent aux token at each position"
    metrics = ("token_accuracy", "exact_match", "rouge_l", "bleu", "rare_token_recall")
    Options = TokenInversionOptions
    assumptions = (
        "The attacker observes the target hidden states (with the deployed noise), can run the bottom "
        "model as a black box on its own auxiliary sentences from the same distribution and knows the "
        "noise level; it trains a per-position classifier from hidden states to tokens."
    )

    def missing(self, ctx: AuditContext) -> str | None:
        if ctx.space.kind == "tokens" and ctx.encoder.output_shape[:1] != ctx.aux.token_ids.shape[1:]:
            return f"needs one hidden state per position; the model outputs shape {list(ctx.encoder.output_shape)}"
        return super().missing(ctx)

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        gen = ctx.generator(seed)
        with threads_for(ctx.aux.x.numel(), ctx.device):
            net, details = train_inverter(ctx, seed, gen, self.options(ctx))
            pred = predict(net, ctx.observed_embeddings("target", gen))
        metrics, baseline, token_details = token_outcome(ctx, ctx.target.token_ids, pred)
        return SeedOutcome(metrics=metrics, baseline=baseline, details={**details, "tokens": token_details})


def sequence_states(z: torch.Tensor) -> torch.Tensor:
    """Hidden states as [N, T, H]: a bottom's output [N, T, ...] flattened after the positions."""
    return z.flatten(2) if z.dim() > 2 else z.unsqueeze(-1)


def train_inverter(
    ctx: AuditContext, seed: int, gen: torch.Generator, opts: TokenInversionOptions
) -> tuple[nn.Module, dict]:
    """Adam on the per-position cross-entropy, fresh noise every epoch, early stopping on held-out aux
    (`opts` is the run's: under --quick, epochs is already quick_epochs)."""
    ids = ctx.aux.token_ids
    if ctx.aux.mask is not None:  # padded positions carry no private token: no loss there
        ids = ids.masked_fill(~ctx.aux.mask, IGNORED)
    n = len(ids)
    order = torch.randperm(n, generator=gen, device=gen.device)
    n_holdout = max(1, math.ceil(opts.holdout_fraction * n))
    holdout, train = order[:n_holdout], order[n_holdout:]
    width = sequence_states(ctx.clean_embeddings("aux")[:1]).shape[-1]
    with seeded(seed):
        net = PositionDecoder(ids.shape[1], width, opts.hidden, ctx.tokens.size).to(ctx.device)
    optimizer = torch.optim.Adam(net.parameters(), lr=opts.lr)
    batch_size = max(1, min(opts.batch_size, MAX_BATCH_LOGITS // (ids.shape[1] * ctx.tokens.size)))
    holdout_positions = int((ids[holdout] != IGNORED).sum())
    patience = epochs_of_patience(opts.patience, math.ceil(len(train) / batch_size), opts.patience_steps)
    plateau = Plateau(patience)
    for epoch in range(1, opts.epochs + 1):
        z = sequence_states(ctx.observed_embeddings("aux", gen))
        net.train()
        for batch in train[torch.randperm(len(train), generator=gen, device=gen.device)].split(batch_size):
            optimizer.zero_grad()
            F.cross_entropy(net(z[batch]).flatten(0, 1), ids[batch].flatten()).backward()
            optimizer.step()
        with torch.no_grad():
            loss = (
                sum(
                    float(F.cross_entropy(net.eval()(z[part]).flatten(0, 1), ids[part].flatten(), reduction="sum"))
                    for part in holdout.split(batch_size)
                )
                / holdout_positions
            )
        if plateau.update(epoch, loss, snapshot(net)):
            break
    restore(plateau.best_state, net)
    details = {**plateau.details("epochs"), "patience_epochs": patience}
    return net, {**details, "holdout_loss": plateau.best, "n_train": len(train)}


@torch.no_grad()
def predict(net: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """The most likely token at every position of every sentence [N, T]."""
    net.eval()
    states = sequence_states(z)
    chunk = max(1, MAX_BATCH_LOGITS // (states.shape[1] * net.vocab))
    return torch.cat([net(part).argmax(dim=-1) for part in states.split(chunk)])
