"""SDAR: simulator decoding with adversarial regularisation (paper 003, Zhu et al., NDSS 2025).

Offline form of the vanilla-SL attack (paper 003, Sec. IV-A and Fig. 14). The attacker (the
server) never queries the bottom model f. It holds

- the embeddings the client sent for the target data (f(x) plus the client's noise),
- labelled auxiliary data from the same domain, disjoint from the target data,
- optionally the trained top model g (`--top-model`), frozen: as in the paper it is the part
  of the model that was trained together with f on the private data.

It trains a simulator f~ (f's architecture re-initialised when known, else a generic network of
the same shapes) so that g(f~(x_aux)) predicts the aux labels, regularised by a discriminator d1
that tells f~(x_aux) from the observed target embeddings (Eqs. 2-3); and a decoder
f~^-1 on (f~(x_aux), x_aux), regularised by a discriminator d2 that tells decoded target
embeddings from aux inputs (Eqs. 4-5). Decoder and discriminators are label-conditional (Sec.
IV-A "Use of labels"): in vanilla SL the server holds the labels of the client's private data,
so by default the attacker uses the target labels themselves. Option `labels = "predicted"`
models a server without them: it labels the targets with g (or with the head trained in g's
place when no top model is given); that head learned f~'s embeddings, not f's, so its labels
are poor and the label-conditional decoder suffers.

Noise: the client adds N(0, sigma^2 I) to what it sends (`--noise-sigma`) and the server sees
that sigma in the protocol, so the attacker adds the same noise to f~'s outputs. Then g is fed
what it was trained on, d1 compares like with like (otherwise it separates real from simulated
embeddings by their noise alone), and the decoder learns to decode noisy embeddings.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.nets import Decoder, bottom_architecture, mlp, seeded
from splitaudit.attacks.reconstruction import (mean_guess_baseline, reconstruction_examples,
                                               reconstruction_metrics)
from splitaudit.context import AuditContext
from splitaudit.threads import threads_for

# Paper 003, Appendix B-C "Hyperparameters" and Table VII (vanilla SL, all datasets). lambda is
# both the weight of the adversarial term in the generator's loss (Eqs. 3, 5; Fig. 14 lines 25,
# 27) and the factor of the discriminator's learning rate; the paper says so in these words:
# "we choose the learning rate of f~ and h~ the same as eta, and we always keep the learning
# rate of the decoder half of that of the simulator, i.e., 2 eta_f~^-1 = eta_f~ = eta_h~ = eta"
# and "After determining the regularization factors lambda1, lambda2, the learning rates for the
# discriminators are chosen as eta_d1 = lambda1 eta_f~ and eta_d2 = lambda2 eta_f~, to ensure
# that the step size to minimize generator loss (as a regularization term) is on par with that
# of the discriminator loss." Adam with eta = 0.001 (App. B-B), lambda1 = 0.02, lambda2 = 1e-5.
LAMBDA1 = 0.02  # weight of d1's adversarial loss in the simulator's loss (Eq. 3)
LAMBDA2 = 1e-5  # weight of d2's adversarial loss in the decoder's loss (Eq. 5)
SIMULATOR_LR = 1e-3  # = the SL task's learning rate eta
DECODER_LR = SIMULATOR_LR / 2
D1_LR = LAMBDA1 * SIMULATOR_LR  # eta_d1 = lambda1 eta_f~ (2e-5)
D2_LR = LAMBDA2 * SIMULATOR_LR  # eta_d2 = lambda2 eta_f~ (1e-8)
# Paper 003 trains with SL's batches of 128 for 20k iterations (App. B-B). Offline, the batch is
# the attacker's choice; under a CPU budget the number of steps matters more than the batch:
# on the digits CNN, 1200 steps of 32 reach the MSE of 1500 steps of 128 at a third of the cost.
BATCH_SIZE = 32
LABEL_EMBEDDING = 50  # Appendix B-C: labels -> 50-unit embedding -> dense layer
DROPOUT = 0.4  # Table IX discriminators
HEAD_WIDTH = 128  # the head trained in g's place when no top model is given
# Table IX conv stacks, (channels, stride) per 3x3 conv, and the smallest map side they are
# used at there (d1: level-7 embeddings, 8x8; d2: CIFAR images, 32x32).
D1_CONVS, D1_SIDE = ((64, 1), (128, 2), (256, 1), (256, 1), (256, 1), (256, 2)), 8
D2_CONVS, D2_SIDE = ((64, 1), (128, 2), (128, 2), (256, 2)), 32
MIN_WIDTH_SCALE = 0.25
FLAT_WIDTH = 256  # discriminator MLP width for flat samples

# The attack keeps improving long after 300 iterations (digits CNN with g, seed 0: target MSE
# 0.036 at 250, 0.016 at 1500, 0.013 at 2000, 0.010 at 5000; mean guess 0.073); 2000 take
# about 45 s per seed on one CPU core. Without g, only d1 ties f~ to f and that takes longer:
# the target MSE stays above the mean guess until ~1000-1500 iterations and reaches 0.025-0.031
# at 2500 (seeds 0-2). The paper's 20k fit a GPU (`iterations = 20000`).
DEFAULT_ITERATIONS = 2000
DEFAULT_ITERATIONS_WITHOUT_G = 3000
QUICK_ITERATIONS = 150
DECODE_BATCH = 512
TRAINING_STREAM = 1_000_003  # seed offset of the batch/noise draws, apart from the observation noise


@dataclass(frozen=True)
class Regularizers:
    """Which adversarial regularisers a run uses (the paper's ablation turns one off)."""

    d1: bool = True
    d2: bool = True


# Where the labels of the target embeddings come from (option `labels`).
LABEL_SOURCES = {
    "true": "the targets' own labels (vanilla SL: the server holds them)",
    "predicted": "predicted by the classifier (the server does not hold them)",
}
FULL = Regularizers()
ABLATIONS = {"mse_no_d1": Regularizers(d1=False), "mse_no_d2": Regularizers(d2=False)}


class SDARAttack(Attack):
    """SDAR (paper 003): simulator + decoder, each regularised by a discriminator.

    Options (`[attack.sdar]`): `iterations` (default 2000 with g, 3000 without, quick 150),
    `batch_size` (32), `labels` ("true": the server holds the targets' labels, as in vanilla
    SL; "predicted": it labels them with g or its own head); `ablation = true` also runs the
    variants without d1 and without d2 (same seed, so the same initial networks) and reports
    their MSE as `mse_no_d1` and `mse_no_d2`.

    What the ablation shows (digits CNN, test contexts, the targets' labels; paper 003 reports
    about 3x on CIFAR-10). Without g, d1 is all that ties f~ to f: the decoder fits f~'s
    embeddings within a few hundred iterations, but on the targets it does worse than the mean
    guess (0.073) until d1 has pulled f~ onto f's embeddings; seed 0, 2000 iterations: 0.028
    with d1, 0.112 without (4x). With g, g already ties f~ to f and d1 adds 10-15% (1500
    iterations: 0.0168 vs 0.0185; 4000 iterations with predicted labels: 0.011 vs 0.014).
    Neither shows at 300 iterations: d1's pull, weighted by lambda1 = 0.02, needs time.
    On small tabular data SDAR is unstable (breast_cancer, 285 aux rows, binary label, with g,
    seed 0: target MSE 0.013 at 600 iterations, 0.059 at 2000, mean guess 0.021): g barely
    constrains f~ and d1 does not keep it on f's embeddings; paper 003 evaluates images only.
    Removing d2 costs about 15% (300 iterations, predicted labels: 0.0376/0.0374/0.0453 against
    0.0318/0.0331/0.0392, seeds 0-2), but not through its adversarial term (weight 1e-5,
    learning rate 1e-8): running the decoder on target embeddings in training mode also moves
    its batch-norm running statistics towards them, and doing only that without d2 recovers
    the full MSE (0.0348/0.0318/0.0369).

    Example: `splitaudit run model.onnx --aux data.npz --top-model top.pt --attacks sdar`.
    """

    name = "sdar"
    kind = "reconstruction"
    primary_metric = "mse"
    needs = frozenset({"labels"})
    option_names = frozenset({"iterations", "batch_size", "labels", "ablation"})
    assumptions = (
        "Passive server without any query access to the bottom model: it sees only the target "
        "embeddings (with the client's noise) and, as in vanilla split learning, their labels; "
        "it holds labelled auxiliary data from the same domain, knows the bottom model's "
        "architecture (else only its input/output shapes) and the noise level, and uses the "
        "trained top model when one is given (paper 003)."
    )

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        options = ctx.options(self.name)
        iterations = int(options.get("iterations", default_iterations(ctx)))
        batch_size = int(options.get("batch_size", BATCH_SIZE))
        label_source = str(options.get("labels", "true"))
        if label_source not in LABEL_SOURCES:
            raise ValueError(f"sdar labels must be one of {', '.join(LABEL_SOURCES)}, got {label_source!r}")
        target = ctx.target
        known_labels = target.y if label_source == "true" else None
        observed = ctx.observed_embeddings("target", ctx.generator(seed))
        run = (lambda regularizers: sdar_reconstruct(ctx, observed, known_labels, seed, iterations,
                                                     batch_size, regularizers))
        x_hat, labels = run(FULL)
        metrics = reconstruction_metrics(target.x, x_hat, target.is_image)
        if options.get("ablation", False):
            for key, regularizers in ABLATIONS.items():
                metrics[key] = reconstruction_metrics(target.x, run(regularizers)[0], target.is_image)["mse"]
        details = {
            "iterations": iterations, "batch_size": batch_size,
            "lambda1": LAMBDA1, "lambda2": LAMBDA2,
            "simulator": "bottom model's architecture, re-initialised"
            if ctx.encoder.architecture() is not None else "generic network of the same shapes",
            "classifier": "top model g (frozen)" if ctx.top_model is not None else "head trained jointly",
            "target_labels": LABEL_SOURCES[label_source],
        }
        if known_labels is None:
            details["target_label_accuracy"] = float((labels == target.y).float().mean())
        return SeedOutcome(metrics=metrics,
                           baseline=mean_guess_baseline(ctx.aux.x, target.x, target.is_image),
                           examples=reconstruction_examples(target.x, x_hat), details=details)


def default_iterations(ctx: AuditContext) -> int:
    """Quick runs are a smoke test; otherwise long enough for d1 to act (see the constants)."""
    if ctx.quick:
        return QUICK_ITERATIONS
    return DEFAULT_ITERATIONS if ctx.top_model is not None else DEFAULT_ITERATIONS_WITHOUT_G


def sdar_reconstruct(ctx: AuditContext, observed: torch.Tensor, known_labels: torch.Tensor | None,
                     seed: int, iterations: int, batch_size: int, regularizers: Regularizers,
                     after_iteration: Callable[[int, "SDARNets"], None] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Train SDAR's networks for `iterations`; decode the observed target embeddings.

    `known_labels` are the targets' labels when the server holds them, else None (predicted).
    `after_iteration(i, nets)`, when given, runs after iteration i (benchmarks/sdar_curve.py
    measures the learning curve with it). Returns the reconstructions and the labels they were
    decoded with.
    """
    # Dropout draws from the global RNG (seeded: reproducible runs). The networks are small: on
    # CPU one thread avoids the threads' hand-offs that slow small ops down on busy cores.
    with seeded(seed), threads_for(ctx.aux.x.numel(), ctx.device):
        nets = SDARNets.build(ctx, seed, regularizers, known_labels)
        gen = ctx.generator(seed + TRAINING_STREAM)
        with ctx.progress(total=iterations, desc=f"sdar (seed {seed})") as bar:
            for i in range(1, iterations + 1):
                sdar_iteration(ctx, nets, observed, gen, batch_size)
                if after_iteration is not None:
                    after_iteration(i, nets)
                bar.update(1)
        return nets.decode(observed)


class SDARNets:
    """f~, the classifier (frozen g, or a head trained with f~), f~^-1, d1, d2 and their optimisers."""

    def __init__(self, simulator: nn.Module, classifier: nn.Module, decoder: Decoder,
                 d1: nn.Module | None, d2: nn.Module | None, train_classifier: bool,
                 known_labels: torch.Tensor | None = None) -> None:
        self.simulator, self.classifier, self.decoder, self.d1, self.d2 = simulator, classifier, decoder, d1, d2
        self.known_labels = known_labels
        simulated = list(simulator.parameters()) + (list(classifier.parameters()) if train_classifier else [])
        self.simulator_opt = torch.optim.Adam(simulated, lr=SIMULATOR_LR)
        self.decoder_opt = torch.optim.Adam(decoder.parameters(), lr=DECODER_LR)
        self.d1_opt = torch.optim.Adam(d1.parameters(), lr=D1_LR) if d1 is not None else None
        self.d2_opt = torch.optim.Adam(d2.parameters(), lr=D2_LR) if d2 is not None else None

    @classmethod
    def build(cls, ctx: AuditContext, seed: int, regularizers: Regularizers,
              known_labels: torch.Tensor | None = None) -> "SDARNets":
        classes = ctx.num_classes
        embedding_shape, input_shape = ctx.encoder.output_shape, ctx.encoder.input_shape
        simulator = bottom_architecture(ctx, seed)
        with seeded(seed):
            head = mlp([math.prod(embedding_shape), HEAD_WIDTH, classes]) if ctx.top_model is None else None
            decoder = Decoder(embedding_shape, input_shape, ctx.aux.in_unit_range, classes)
            d1 = discriminator(embedding_shape, classes, D1_CONVS, D1_SIDE) if regularizers.d1 else None
            d2 = discriminator(input_shape, classes, D2_CONVS, D2_SIDE) if regularizers.d2 else None
        on_device = (lambda net: None if net is None else net.to(ctx.device).train())
        classifier = on_device(head) if head is not None else ctx.top_model
        return cls(simulator, classifier, on_device(decoder), on_device(d1), on_device(d2),
                   train_classifier=head is not None, known_labels=known_labels)

    @torch.no_grad()
    def target_labels(self, observed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Labels of the target embeddings observed[index]: known, else the classifier's argmax."""
        if self.known_labels is not None:
            return self.known_labels[index]
        return torch.cat([self.classifier(z).argmax(dim=1) for z in observed[index].split(DECODE_BATCH)])

    @torch.no_grad()
    def decode(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructions of all target embeddings (decoder in eval mode) and the labels used."""
        self.decoder.eval()
        labels = self.target_labels(observed, torch.arange(len(observed), device=observed.device))
        x_hat = torch.cat([self.decoder(z, y) for z, y in
                           zip(observed.split(DECODE_BATCH), labels.split(DECODE_BATCH))])
        return x_hat, labels


def sdar_iteration(ctx: AuditContext, nets: SDARNets, observed: torch.Tensor,
                   gen: torch.Generator, batch_size: int) -> None:
    """One SDAR iteration (paper 003, Fig. 14, lines 22-33).

    All four losses come from one forward pass, then f~, d1, f~^-1 and d2 each step on the
    gradient of its own loss with respect to its own parameters:
    L_f~ = CE(g(f~(x')), y') + lambda1 BCE(d1(f~(x'), y'), 1)             (Eq. 3)
    L_d1 = BCE(d1(f~(x'), y'), 0) + BCE(d1(z, y), 1)                        (Eq. 2)
    L_f~^-1 = MSE(x', f~^-1(f~(x'), y')) + lambda2 BCE(d2(f~^-1(z, y), y), 1)  (Eq. 5)
    L_d2 = BCE(d2(f~^-1(z, y), y), 0) + BCE(d2(x', y'), 1)                  (Eq. 4)
    where (x', y') is an aux batch and z a batch of observed target embeddings with their labels
    y (known, or predicted by the classifier).
    """
    aux, device = ctx.aux, ctx.device
    pick = torch.randint(len(aux), (batch_size,), generator=gen, device=device)
    x_aux, y_aux = aux.x[pick], aux.y[pick]
    pick_target = torch.randint(len(observed), (batch_size,), generator=gen, device=device)
    z_target, y_target = observed[pick_target], nets.target_labels(observed, pick_target)

    z_aux = ctx.add_noise(nets.simulator(x_aux), gen)
    simulator_loss = F.cross_entropy(nets.classifier(z_aux), y_aux)
    updates = []
    if nets.d1 is not None:
        fake = nets.d1(z_aux, y_aux)
        simulator_loss = simulator_loss + LAMBDA1 * bce(fake, 1.0)
        updates.append((bce(fake, 0.0) + bce(nets.d1(z_target, y_target), 1.0), nets.d1_opt))
    updates.append((simulator_loss, nets.simulator_opt))

    decoder_loss = F.mse_loss(nets.decoder(z_aux.detach(), y_aux), x_aux)
    if nets.d2 is not None:
        decoded = nets.d2(nets.decoder(z_target, y_target), y_target)
        decoder_loss = decoder_loss + LAMBDA2 * bce(decoded, 1.0)
        updates.append((bce(decoded, 0.0) + bce(nets.d2(x_aux, y_aux), 1.0), nets.d2_opt))
    updates.append((decoder_loss, nets.decoder_opt))
    simultaneous_step(updates)


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    """Binary cross-entropy of discriminator logits against a constant label (1 real, 0 fake)."""
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def simultaneous_step(updates: list[tuple[torch.Tensor, torch.optim.Optimizer]]) -> None:
    """Each optimiser steps on its own loss's gradient; all gradients are taken before any step."""
    grads = [torch.autograd.grad(loss, _params(opt), retain_graph=True)
             for loss, opt in updates]
    for (_, opt), opt_grads in zip(updates, grads):
        for p, g in zip(_params(opt), opt_grads):
            p.grad = g
        opt.step()


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]




class LabelConditioned(nn.Module):
    """A discriminator body fed its input together with an embedded label (paper 003, App. B-C).

    The label goes through a 50-unit embedding and a dense layer; for (C, H, W) inputs the
    result is an extra H x W channel, for flat inputs it is concatenated as 50 more features.
    """

    def __init__(self, body: nn.Module, sample_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.body, self.sample_shape = body, tuple(sample_shape)
        spatial = math.prod(sample_shape[1:]) if len(sample_shape) == 3 else LABEL_EMBEDDING
        self.label = nn.Sequential(nn.Embedding(num_classes, LABEL_EMBEDDING), nn.Linear(LABEL_EMBEDDING, spatial))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        label = self.label(y)
        if len(self.sample_shape) == 3:
            joined = torch.cat([x, label.reshape(len(x), 1, *self.sample_shape[1:])], dim=1)
        else:
            joined = torch.cat([x.flatten(1), label], dim=1)
        return self.body(joined).squeeze(1)


def discriminator(sample_shape: tuple[int, ...], num_classes: int,
                  convs: tuple[tuple[int, int], ...], table_side: int) -> LabelConditioned:
    """A label-conditional discriminator (logit output) for samples of `sample_shape`.

    Images or image-like embeddings: Table IX's 3x3 convs with LeakyReLU, batch norm after all
    but the first, then dropout and a dense logit. On maps smaller than Table IX's
    (`table_side`) the widths shrink in proportion, at most 4x (8x8 digits get d2 widths 16-64
    instead of 64-256), so that the discriminator does not dwarf the models it regularises.
    Flat samples: a two-layer LeakyReLU MLP.
    """
    if len(sample_shape) == 3:
        channels, height, width = sample_shape
        scale = min(1.0, max(MIN_WIDTH_SCALE, min(height, width) / table_side))
        layers: list[nn.Module] = []
        cin = channels + 1
        for i, (full_width, stride) in enumerate(convs):
            cout = max(1, round(full_width * scale))
            layers.append(nn.Conv2d(cin, cout, 3, stride=stride, padding=1))
            layers += [nn.LeakyReLU(0.2)] if i == 0 else [nn.BatchNorm2d(cout), nn.LeakyReLU(0.2)]
            height, width, cin = -(-height // stride), -(-width // stride), cout
        features = cin * height * width
    else:
        layers = [nn.Linear(math.prod(sample_shape) + LABEL_EMBEDDING, FLAT_WIDTH), nn.LeakyReLU(0.2),
                  nn.Linear(FLAT_WIDTH, FLAT_WIDTH), nn.LeakyReLU(0.2)]
        features = FLAT_WIDTH
    body = nn.Sequential(*layers, nn.Flatten(), nn.Dropout(DROPOUT), nn.Linear(features, 1))
    return LabelConditioned(body, sample_shape, num_classes)
