"""SDAR's networks and training loop (Zhu et al., NDSS 2025): the simulator f~, the decoder
f~^-1, the discriminators d1 and d2 (Table IX), the classifier or simulated tail that labels the
targets, one training iteration (Fig. 14) and the loop around it with its early stopping on the
held-out aux reconstruction (core/plateau.py). The attack itself, its options, budgets and
label modes are in attacks/sdar.py; benchmarks/ drive this module directly."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from splitaudit.attacks.parts.nets import (
    LABEL_EMBEDDING,
    Decoder,
    LabelChannel,
    batch_norm_class,
    bottom_architecture,
    conv_class,
    decode_batch,
    has_spatial_axes,
    mlp,
    seeded,
)
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.plateau import Plateau, evaluating, restore, snapshot
from splitaudit.core.threads import threads_for

# Zhu et al. (NDSS 2025), Appendix B-C "Hyperparameters" and Table VII (vanilla SL, all datasets). lambda is
# both the weight of the adversarial term in the generator's loss (Eqs. 3, 5; Fig. 14 lines 25,
# 27) and the factor of the discriminator's learning rate; the paper says so in these words:
# "we choose the learning rate of f~ and h~ the same as eta, and we always keep the learning
# rate of the decoder half of that of the simulator, i.e., 2 eta_f~^-1 = eta_f~ = eta_h~ = eta"
# and "After determining the regularization factors lambda1, lambda2, the learning rates for the
# discriminators are chosen as eta_d1 = lambda1 eta_f~ and eta_d2 = lambda2 eta_f~, to ensure
# that the step size to minimize generator loss (as a regularization term) is on par with that
# of the discriminator loss." Adam with eta = 0.001 (App. B-B), lambda1 = 0.02, lambda2 = 1e-5.
# The authors' released code scales d2's rate by the rate of the network it regularises, the
# decoder (lambda2 x 5e-4 = 5e-9), as d1's is scaled by the simulator's; we follow the code.
LAMBDA1 = 0.02  # weight of d1's adversarial loss in the simulator's loss (Eq. 3)
LAMBDA2 = 1e-5  # weight of d2's adversarial loss in the decoder's loss (Eq. 5)
SIMULATOR_LR = 1e-3  # = the SL task's learning rate eta
DECODER_LR = SIMULATOR_LR / 2
D1_LR = LAMBDA1 * SIMULATOR_LR  # 2e-5
D2_LR = LAMBDA2 * DECODER_LR  # 5e-9
ADAM_EPS = 1e-7  # the paper's networks are Keras models: Keras's Adam epsilon, not torch's 1e-8
LEAKY_SLOPE = 0.3  # Table IX's LeakyReLU() is Keras's, whose default slope is 0.3
DROPOUT = 0.4  # Table IX discriminators
HEAD_WIDTH = 128  # the head trained in g's place when no top model is given
# Table IX conv stacks, (channels, stride) per 3x3 conv, and the map side they are used at
# there: d1 at split levels 4-6 (ResNet-20's 32x16x16 embeddings) and at level 7 (64x8x8), d2
# on 32x32 images. d1 also narrows with its input's channels against those 32 and 64.
D1_CONVS, D1_SIDE, D1_CHANNELS = ((64, 1), (128, 2), (256, 1), (256, 1), (256, 1), (256, 2)), 16, 32
D1_CONVS_LEVEL7, D1_SIDE_LEVEL7, D1_CHANNELS_LEVEL7 = ((128, 1), (256, 1), (256, 1), (256, 1), (256, 2)), 8, 64
D2_CONVS, D2_SIDE = ((64, 1), (128, 2), (128, 2), (256, 2)), 32
MIN_WIDTH_SCALE = 0.25
FLAT_WIDTH = 256  # discriminator MLP width for flat samples
# Early stopping on the held-out aux MSE (option early_stopping): measured every EVAL_EVERY
# iterations, stopped after PATIENCE measurements without a new best (PATIENCE_WITH_G where a top
# model g ties the simulator to f), the decoder restored to its best measurement. Chosen by
# replaying the rule on recorded curves (benchmarks/sdar_stopping.py; digits CNN with g, seeds 0-2,
# cap 1500). On an AMD EPYC, patience 6 at 50 ran to the cap on all three seeds (0.0121 restored;
# patience 4: 0.0145, 2-3: 0.017). On an Intel Xeon with AMX, whose float32 kernels round
# otherwise, the same seeds' curves part, and patience 6 stopped seeds 1 and 2 at 1300 and 850 on
# a held-out signal that moves by 10-20% between measurements, while their target MSE still fell
# (seed 2: best held out at 550, 0.0169; 0.0121 at the cap): 0.0145 +- 0.0024, where 10 runs all
# three to the cap, 0.0123 +- 0.0003 restored (8: 0.0139). With g the signal tracks the targets
# (rank correlation 0.87-0.90), so waiting for it costs nothing it would not buy; without g it does
# not (BLIND_STOPPING_LIMIT in sdar.py), so stopping is off by default there, and PATIENCE is the
# patience of a run asked to stop anyway.
EVAL_EVERY = 50
PATIENCE = 6
PATIENCE_WITH_G = 10
STALL_MIN_ITERATIONS = 20  # fewer: too few losses to tell a trend from batch noise
# The networks' 4-D weights stored channels_last on CPU: their convolutions then run and return
# channels_last, which oneDNN computes faster here (CPU seconds an iteration, 1 thread: digits CNN
# with g 1.15x, text line 1.55x, 64 px ResNet stem 1.23x; benchmarks/attack_speed.py). The sums
# are reordered, so the numbers differ from the contiguous layout's; the digits CNN's final MSE
# over seeds 0-2 stays within their spread (0.0123 against 0.0121 +- 0.0011; benchmarks/RESULTS.md).
CHANNELS_LAST = True
# The forward passes of the training steps under autocast to bfloat16 (convolutions and matmuls in
# bf16; weights, Adam's states, losses, the held-out measurement and the final decoding stay float32),
# by default on CPUs that compute bf16 natively (AVX512-BF16 or AMX) for inputs of at least
# BF16_MIN_SAMPLE_VALUES values a sample. CPU seconds an iteration, bf16 against float32
# (benchmarks/attack_speed.py, the attack's threads): 64 px ResNet stem width 64 1.72x, at 32 px
# 1.74x, width 16 1.63x, MobileNet stem 1.58x, text line 1.53x, 1-D audio (1x1024) 1.56x; the 8x8
# digits CNN 1.05x, where its small ops gain nothing and its numbers stay float32's. Other CPUs emulate
# bf16, slower than float32; on GPUs it was not measured.
BF16_MIN_SAMPLE_VALUES = 1024
PRECISIONS = ("auto", "float32", "bfloat16")
TRAINING_STREAM = 1_000_003  # seed offset of the batch/noise draws, apart from the observation noise
HOLDOUT_STREAM = 2_000_003  # seed offset of the held-out aux split and its fixed noise draw


@dataclass(frozen=True)
class Stopping:
    """Early stopping on what the attacker observes: the reconstruction MSE of a held-out slice
    of its aux data through f~ and the decoder (never the targets), every `every` iterations;
    training ends after `patience` evaluations without a new best (the iterations stay a cap)."""

    every: int
    patience: int
    holdout_fraction: float


@dataclass(frozen=True)
class Regularizers:
    """Which adversarial regularisers a run uses (the paper's ablation turns one off)."""

    d1: bool = True
    d2: bool = True


FULL = Regularizers()
ABLATIONS = {"mse_no_d1": Regularizers(d1=False), "mse_no_d2": Regularizers(d2=False)}


class BatchStream:
    """Batches of indices drawn in epochs: each a fresh permutation, every sample once per epoch
    (as Keras's shuffled datasets feed the authors' training loop), not with replacement."""

    def __init__(self, n: int, batch_size: int, gen: torch.Generator, pool: torch.Tensor | None = None) -> None:
        """Indices 0..n-1, or the entries of `pool` (n of them) when given: the samples it trains on."""
        self.n, self.batch_size, self.gen, self.pool = n, batch_size, gen, pool
        self.pending = torch.empty(0, dtype=torch.long, device=gen.device)

    def next(self) -> torch.Tensor:
        while len(self.pending) < self.batch_size:
            fresh = torch.randperm(self.n, generator=self.gen, device=self.gen.device)
            self.pending = torch.cat([self.pending, fresh if self.pool is None else self.pool[fresh]])
        batch, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
        return batch


def sdar_reconstruct(
    ctx: AuditContext,
    observed: torch.Tensor,
    known_labels: torch.Tensor | None,
    seed: int,
    iterations: int,
    batch_size: int,
    regularizers: Regularizers,
    after_iteration: Callable[[int, "SDARNets"], None] | None = None,
    conditional: bool = True,
    label_flip: float = 0.0,
    simulator_init: str = "kaiming",
    lr_scale: float = 1.0,
    server_part: str | None = None,
    stopping: Stopping | None = None,
    precision: str = "float32",
) -> tuple[torch.Tensor, torch.Tensor, str, Plateau | None, str]:
    """Train SDAR's networks for `iterations` (a cap when `stopping` is given); decode the observed
    target embeddings.

    `known_labels` are the targets' labels when the server holds them, else None (the
    classifier's). `conditional=False` is the U-shaped attack: label-free decoder and
    discriminators, and the classifier trained on aux labels flipped with probability
    `label_flip`. `lr_scale` multiplies every learning rate (the cpu preset's 4).
    `after_iteration(i, nets)`, when given, runs after iteration i (benchmarks/sdar_curve.py
    measures the learning curve with it). `stopping`: early stopping on the held-out aux MSE, whose
    slice then never trains; measured every `stopping.every` iterations and at the last, and the
    decoder (and the classifier that labels the targets, when their labels are not known) are
    restored to their state at the best measurement. `precision`: "float32" or "bfloat16" (the
    training steps under autocast, `sdar_training`). Returns the reconstructions, the target
    labels the classifier gives (or the known ones), why the training signal stalled ("" if it
    did not), the held-out signal's Plateau (None without `stopping`) and the precision the steps
    ran in (with the reason where bfloat16 fell back to float32).
    """
    with sdar_training(
        ctx,
        observed,
        known_labels,
        seed,
        batch_size,
        regularizers,
        conditional,
        label_flip,
        simulator_init,
        lr_scale,
        server_part,
        stopping.holdout_fraction if stopping else 0.0,
        precision,
    ) as (nets, iteration, holdout_mse):
        plateau = Plateau(stopping.patience) if stopping else None
        decoding = [nets.decoder] + ([nets.classifier] if nets.known_labels is None else [])
        with ctx.progress(total=iterations, desc=f"sdar (seed {seed})") as bar:
            for i in range(1, iterations + 1):
                iteration()
                if after_iteration is not None:
                    after_iteration(i, nets)
                bar.update(1)
                measured = plateau is not None and (i % stopping.every == 0 or i == iterations)
                if measured and plateau.update(i, holdout_mse(), snapshot(*decoding)):
                    break
        if plateau is not None:  # the networks that decode, as they were at the best held-out MSE
            restore(plateau.best_state, *decoding)
        return (*nets.decode(observed), nets.stalled(), plateau, nets.precision_detail())


@contextmanager
def sdar_training(
    ctx: AuditContext,
    observed: torch.Tensor,
    known_labels: torch.Tensor | None,
    seed: int,
    batch_size: int,
    regularizers: Regularizers,
    conditional: bool = True,
    label_flip: float = 0.0,
    simulator_init: str = "kaiming",
    lr_scale: float = 1.0,
    server_part: str | None = None,
    holdout_fraction: float = 0.0,
    precision: str = "float32",
) -> Iterator[tuple["SDARNets", Callable[[], None], Callable[[], float]]]:
    """SDAR's freshly built networks, a function that runs one training iteration and one that
    measures the held-out aux MSE, inside the attack's seeded, thread-limited scope
    (sdar_reconstruct trains with it, the cost estimate times it). A `holdout_fraction` of the
    aux data is held out of training (at least one sample when positive). Dropout draws from the
    global RNG (seeded: reproducible runs). The networks are small: on CPU one thread avoids the
    threads' hand-offs that slow small ops down on busy cores. With `precision` "bfloat16" the
    iterations run under autocast, unless one iteration on copies of the networks fails or leaves a
    weight non-finite (`bfloat16_failure`): then they run in float32 and nets.bfloat16_failure says why."""
    with seeded(seed), threads_for(ctx.aux.x.numel(), ctx.device):
        nets = SDARNets.build(
            ctx, seed, regularizers, known_labels, conditional, label_flip, simulator_init, lr_scale, server_part
        )
        held = ctx.generator(seed + HOLDOUT_STREAM)
        order = torch.randperm(len(ctx.aux), generator=held, device=held.device)
        n_holdout = math.ceil(holdout_fraction * len(order))
        holdout, train = order[:n_holdout], order[n_holdout:]
        gen = ctx.generator(seed + TRAINING_STREAM)
        pool = train if n_holdout else None
        streams = (BatchStream(len(train), batch_size, gen, pool), BatchStream(len(observed), batch_size, gen))
        if precision == "bfloat16":
            nets.bfloat16_failure = bfloat16_failure(ctx, nets, observed, batch_size)
            nets.precision = "float32" if nets.bfloat16_failure else "bfloat16"
        yield (
            nets,
            lambda: sdar_iteration(ctx, nets, observed, gen, streams),
            lambda: holdout_mse(ctx, nets, holdout, seed),
        )


def training_precision(requested: str, device: torch.device | str, sample_values: int) -> str:
    """The precision of the training steps: the requested one, or for "auto" bfloat16 on a CPU that
    computes it natively when an input sample has BF16_MIN_SAMPLE_VALUES values or more, float32 elsewhere."""
    if requested != "auto":
        return requested
    native = torch.device(device).type == "cpu" and native_bfloat16_cpu()
    return "bfloat16" if native and sample_values >= BF16_MIN_SAMPLE_VALUES else "float32"


def native_bfloat16_cpu() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX tiles), which oneDNN's bf16
    convolutions use; without them bf16 is emulated, slower than float32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def bfloat16_failure(ctx: AuditContext, nets: "SDARNets", observed: torch.Tensor, batch_size: int) -> str:
    """Why one training iteration under bf16 autocast fails on copies of the networks, or "": a
    converted bottom's op may not take bf16 inputs, and a step that overflows leaves non-finite
    weights. The copies, their batches and the global RNG are the probe's own, so the run's
    training is the same with or without it; the frozen top model g is shared, not copied."""
    shared = {} if ctx.top_model is None else {id(ctx.top_model): ctx.top_model}
    probe = copy.deepcopy(nets, memo=shared)
    probe.precision = "bfloat16"
    gen = ctx.generator(0)
    streams = (BatchStream(len(ctx.aux), batch_size, gen), BatchStream(len(observed), batch_size, gen))
    device = torch.device(ctx.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            sdar_iteration(ctx, probe, observed, gen, streams)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    networks = (probe.simulator, probe.classifier, probe.decoder, probe.d1, probe.d2)
    if not all(torch.isfinite(p).all() for net in networks if net is not None for p in net.parameters()):
        return "one iteration left non-finite weights"
    return ""


@torch.no_grad()
def holdout_mse(ctx: AuditContext, nets: "SDARNets", holdout: torch.Tensor, seed: int) -> float:
    """MSE of the held-out aux inputs decoded from f~'s embeddings of them, with the deployed
    noise (one fixed draw, so that evaluations differ only by the networks): what the attacker
    observes of its own progress. Simulator and decoder run in eval mode, then train on."""
    x, y = ctx.aux.x[holdout], ctx.aux.y[holdout]
    noise = ctx.generator(seed + HOLDOUT_STREAM)
    batch = decode_batch(nets.decoder.input_shape)
    with evaluating(nets.simulator, nets.decoder):
        total = sum(
            float((nets.decoder(ctx.add_noise(nets.simulator(xs), noise), nets.condition(ys)) - xs).pow(2).sum())
            for xs, ys in zip(x.split(batch), y.split(batch))
        )
    return total / x.numel()


class SimulatedTail(nn.Module):
    """h~ after the frozen server body g (Zhu et al., NDSS 2025, Sec. IV-B): U-shaped SL's label
    path, h~(g(z)). Only h~ is trained (its parameters are this module's, g is held outside them);
    g stays in eval mode so that training never moves the user's model's batch-norm statistics."""

    def __init__(self, body: nn.Module, embedding_shape: tuple[int, ...], classes: int, device: torch.device) -> None:
        super().__init__()
        self.body = [body.eval()]  # a list: g's parameters stay out of h~'s
        with torch.no_grad():
            features = math.prod(body(torch.zeros(2, *embedding_shape, device=device)).shape[1:])
        self.tail = mlp([features, HEAD_WIDTH, classes])

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.tail(self.body[0](z).flatten(1))


class SDARNets:
    """f~, the classifier (frozen g, a head trained with f~, or a trained tail after a frozen body
    g), f~^-1, d1, d2 and their optimisers."""

    def __init__(
        self,
        simulator: nn.Module,
        classifier: nn.Module,
        decoder: Decoder,
        d1: nn.Module | None,
        d2: nn.Module | None,
        train_classifier: bool,
        known_labels: torch.Tensor | None = None,
        conditional: bool = True,
        label_flip: float = 0.0,
        num_classes: int | None = None,
        lr_scale: float = 1.0,
    ) -> None:
        self.simulator, self.classifier, self.decoder, self.d1, self.d2 = simulator, classifier, decoder, d1, d2
        self.task_losses: list[torch.Tensor] = []  # the simulator's classification loss, per iteration
        self.precision = "float32"  # of the training steps: "float32" or "bfloat16" (sdar_training)
        self.bfloat16_failure = ""  # why bfloat16 was asked for and float32 ran, or ""
        self.known_labels, self.conditional = known_labels, conditional
        self.label_flip, self.num_classes = label_flip, num_classes
        simulated = list(simulator.parameters()) + (list(classifier.parameters()) if train_classifier else [])
        # Adam's multi-tensor (foreach) update: per element the arithmetic of torch's per-parameter
        # loop (CPU's default), so bit-identical results with fewer dispatches (tests/test_sdar.py;
        # benchmarks/attack_speed.py). Fused Adam rounds differently.
        adam = lambda params, lr: torch.optim.Adam(params, lr=lr, eps=ADAM_EPS, foreach=True)
        self.simulator_opt = adam(simulated, SIMULATOR_LR * lr_scale)
        self.decoder_opt = adam(decoder.parameters(), DECODER_LR * lr_scale)
        self.d1_opt = adam(d1.parameters(), D1_LR * lr_scale) if d1 is not None else None
        self.d2_opt = adam(d2.parameters(), D2_LR * lr_scale) if d2 is not None else None

    @classmethod
    def build(
        cls,
        ctx: AuditContext,
        seed: int,
        regularizers: Regularizers,
        known_labels: torch.Tensor | None = None,
        conditional: bool = True,
        label_flip: float = 0.0,
        simulator_init: str = "kaiming",
        lr_scale: float = 1.0,
        server_part: str | None = None,
    ) -> "SDARNets":
        """The simulator starts from `simulator_init` weights (preset "paper": Keras's Glorot-uniform,
        as the authors' TensorFlow code; "cpu": PyTorch's Kaiming-uniform), and an ONNX bottom
        model's simulator gets back the batch norm that export folded away (not when the graph
        kept a normalisation layer). Kaiming for the cpu preset is measured (digits CNN with g,
        the targets' labels, batch 32, target MSE at 200/400/600/800 iterations, seed 0):
        Glorot 0.0471/0.0367/0.0316/0.0262, Kaiming 0.0411/0.0316/0.0267/0.0230; seed 1 at
        250/500/750/1000: Glorot 0.0370/0.0350/0.0290/0.0260, Kaiming 0.0324/0.0278/0.0238/0.0219.
        Without g (seed 0, 250-1000): Glorot 0.0928/0.1054/0.1082/0.1063, Kaiming
        0.0890/0.0991/0.1020/0.0967 (both still above the mean guess 0.073 at 1000).
        Decoder, discriminators and head keep PyTorch's initialisation: with Glorot they
        learned slower (seed 0, target MSE at 150/300/450 iterations: 0.0525/0.0436/0.0377 with
        Glorot, 0.0463/0.0374/0.0323 without)."""
        classes = ctx.num_classes
        label_classes = classes if conditional else None
        embedding_shape, input_shape = ctx.encoder.output_shape, ctx.encoder.input_shape
        part = server_part or ("classifier" if ctx.top_model is not None else "none")
        simulator = bottom_architecture(ctx, seed, init=simulator_init, batch_norm=True)
        with seeded(seed):
            head = None
            if part == "body":
                head = SimulatedTail(ctx.top_model, embedding_shape, classes, ctx.device)
            elif part != "classifier":
                head = mlp([math.prod(embedding_shape), HEAD_WIDTH, classes])
            decoder = Decoder(embedding_shape, ctx.space, label_classes)
            d1 = d1_discriminator(embedding_shape, label_classes) if regularizers.d1 else None
            d2 = (
                discriminator(input_shape, label_classes, D2_CONVS, D2_SIDE, last_activation=True)
                if regularizers.d2
                else None
            )
        on_device = lambda net: None if net is None else net.to(ctx.device).train()
        classifier = on_device(head) if head is not None else ctx.top_model
        if CHANNELS_LAST and torch.device(ctx.device).type == "cpu":
            for net in (simulator, decoder, d1, d2):
                if net is not None:
                    net.to(memory_format=torch.channels_last)
        return cls(
            simulator,
            classifier,
            on_device(decoder),
            on_device(d1),
            on_device(d2),
            train_classifier=head is not None,
            known_labels=known_labels,
            conditional=conditional,
            label_flip=label_flip,
            num_classes=classes,
            lr_scale=lr_scale,
        )

    def reduced_precision(self) -> AbstractContextManager:
        """Autocast to bf16 around forward passes when the steps run in bfloat16, and never around an
        optimiser step: autocast keeps each weight's bf16 copy until its region ends, so a forward after
        an in-place update within one region would run on the old weights."""
        device = next(self.decoder.parameters()).device.type
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.precision == "bfloat16")

    def precision_detail(self) -> str:
        """The precision the steps ran in, with the reason where bfloat16 fell back to float32."""
        return f"float32 (bfloat16 failed: {self.bfloat16_failure})" if self.bfloat16_failure else self.precision

    def stalled(self) -> str:
        """Why the attack's own training signal did not improve, or "": the simulator's classification
        loss on aux (which the attacker observes) over the last tenth of the iterations against the
        first tenth. A simulator that never learned the task cannot stand in for f."""
        if len(self.task_losses) < STALL_MIN_ITERATIONS:
            return ""
        losses = torch.stack(self.task_losses).cpu()
        window = len(losses) // 10
        first, last = float(losses[:window].mean()), float(losses[-window:].mean())
        if last < first:
            return ""
        return (
            f"its own training signal did not improve (the simulator's classification loss on aux: "
            f"{first:.3g} over the first {window} iterations, {last:.3g} over the last {window})"
        )

    @torch.no_grad()
    def target_labels(self, observed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Labels of the target embeddings observed[index]: known, else the classifier's argmax."""
        if self.known_labels is not None:
            return self.known_labels[index]
        batch = decode_batch(self.decoder.input_shape)
        return torch.cat([self.classifier(z).argmax(dim=1) for z in observed[index].split(batch)])

    def training_labels(self, y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The aux labels the classifier trains on: each replaced by a uniform label with
        probability label_flip (U-shaped SL's regulariser against overfitting, Fig. 15 line 30)."""
        if self.label_flip == 0:
            return y
        flip = torch.rand(y.shape, generator=gen, device=y.device) < self.label_flip
        uniform = torch.randint(self.num_classes, y.shape, generator=gen, device=y.device)
        return torch.where(flip, uniform, y)

    def condition(self, y: torch.Tensor) -> torch.Tensor | None:
        """The label the decoder and discriminators see (none in the U-shaped attack)."""
        return y if self.conditional else None

    @torch.no_grad()
    def decode(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructions of all target embeddings (decoder in eval mode) and their labels."""
        self.decoder.eval()
        labels = self.target_labels(observed, torch.arange(len(observed), device=observed.device))
        batch = decode_batch(self.decoder.input_shape)
        x_hat = torch.cat(
            [self.decoder(z, self.condition(y)) for z, y in zip(observed.split(batch), labels.split(batch))]
        )
        return x_hat, labels


def sdar_iteration(
    ctx: AuditContext,
    nets: SDARNets,
    observed: torch.Tensor,
    gen: torch.Generator,
    streams: tuple[BatchStream, BatchStream],
) -> None:
    """One SDAR iteration (Zhu et al., NDSS 2025, App. A, Fig. 14 lines 22-33), in two steps.

    1. f~ and d1 step on the gradients of their losses from one forward pass of f~:
       L_f~ = CE(g(f~(x')), y') + lambda1 BCE(d1(f~(x'), y'), 1)             (Eq. 3)
       L_d1 = BCE(d1(f~(x'), y'), 0) + BCE(d1(z, y), 1)                        (Eq. 2)
    2. f~ runs again, updated, and f~^-1 and d2 step on
       L_f~^-1 = MSE(x', f~^-1(f~(x'), y')) + lambda2 BCE(d2(f~^-1(z, y), y), 1)  (Eq. 5)
       L_d2 = BCE(d2(f~^-1(z, y), y), 0) + BCE(d2(x', y'), 1)                  (Eq. 4)
    so the decoder learns to invert the simulator as it is after this iteration's update (the
    order of the authors' released code). (x', y') is an aux batch, z a batch of observed target
    embeddings with labels y (known, or the classifier's); in the U-shaped attack the decoder
    and discriminators see no labels and the classifier trains on flipped aux labels.
    """
    aux = ctx.aux
    pick, pick_target = streams[0].next(), streams[1].next()
    x_aux, y_aux = aux.x[pick], aux.y[pick]
    z_target = observed[pick_target]
    c_aux, c_target = nets.condition(y_aux), nets.condition(nets.target_labels(observed, pick_target))

    updates = []
    with nets.reduced_precision():
        z_aux = ctx.add_noise(nets.simulator(x_aux).float(), gen)
        simulator_loss = F.cross_entropy(nets.classifier(z_aux), nets.training_labels(y_aux, gen))
        nets.task_losses.append(simulator_loss.detach())
        if nets.d1 is not None:
            fake = nets.d1(z_aux, c_aux)
            simulator_loss = simulator_loss + LAMBDA1 * bce(fake, 1.0)
            updates.append((bce(fake, 0.0) + bce(nets.d1(z_target, c_target), 1.0), nets.d1_opt))
    updates.append((simulator_loss, nets.simulator_opt))
    simultaneous_step(updates)

    with torch.no_grad(), nets.reduced_precision():
        z_aux = ctx.add_noise(nets.simulator(x_aux).float(), gen)
    decoder_step(nets, x_aux, z_aux, c_aux, z_target, c_target)


def decoder_step(
    nets: SDARNets,
    x_aux: torch.Tensor,
    z_aux: torch.Tensor,
    c_aux: torch.Tensor | None,
    z_target: torch.Tensor,
    c_target: torch.Tensor | None,
) -> None:
    """Step 2 of sdar_iteration: f~^-1 and d2 step on Eqs. 5 and 4, the decoder learning to map the
    embeddings z_aux back to x_aux (f~'s in the attack; benchmarks/sdar_diagnosis.py's oracle
    control feeds f's own)."""
    updates = []
    with nets.reduced_precision():
        decoder_loss = F.mse_loss(nets.decoder(z_aux, c_aux), x_aux)
        if nets.d2 is not None:
            decoded = nets.d2(nets.decoder(z_target, c_target), c_target)
            decoder_loss = decoder_loss + LAMBDA2 * bce(decoded, 1.0)
            updates.append((bce(decoded, 0.0) + bce(nets.d2(x_aux, c_aux), 1.0), nets.d2_opt))
    updates.append((decoder_loss, nets.decoder_opt))
    simultaneous_step(updates)


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    """Binary cross-entropy of discriminator logits against a constant label (1 real, 0 fake)."""
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def simultaneous_step(updates: list[tuple[torch.Tensor, torch.optim.Optimizer]]) -> None:
    """Each optimiser steps on its own loss's gradient; all gradients are taken before any step."""
    grads = [torch.autograd.grad(loss, _params(opt), retain_graph=True) for loss, opt in updates]
    for (_, opt), opt_grads in zip(updates, grads):
        for p, g in zip(_params(opt), opt_grads):
            p.grad = g
        opt.step()


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


class LabelConditioned(nn.Module):
    """A discriminator body fed its input together with an embedded label (Zhu et al., NDSS 2025, App. B-C).

    The label goes through a 50-unit embedding and a dense layer; for (C, H, W) images and (C, T)
    sequences the result is one extra channel, for flat inputs it is concatenated as 50 more
    features.
    Without classes (the U-shaped attack) the body sees the input alone.
    """

    def __init__(self, body: nn.Module, sample_shape: tuple[int, ...], num_classes: int | None) -> None:
        super().__init__()
        self.body, self.sample_shape = body, tuple(sample_shape)
        self.label = None
        if num_classes and has_spatial_axes(sample_shape):
            self.label = LabelChannel(num_classes, sample_shape[1:])
        elif num_classes:
            self.label = nn.Sequential(
                nn.Embedding(num_classes, LABEL_EMBEDDING), nn.Linear(LABEL_EMBEDDING, LABEL_EMBEDDING)
            )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if not has_spatial_axes(self.sample_shape):
            x = x.flatten(1)
        joined = x if self.label is None else torch.cat([x, self.label(y)], dim=1)
        return self.body(joined).squeeze(1)


def d1_discriminator(embedding_shape: tuple[int, ...], num_classes: int | None) -> LabelConditioned:
    """Table IX's d1: the level-7 stack on maps of fewer positions than 16x16 (ResNet-20 level 7:
    64x8x8), the stack of levels 4-6 on larger ones; no activation after the last conv."""
    small = has_spatial_axes(embedding_shape) and math.prod(embedding_shape[1:]) < D1_SIDE**2
    convs, side, channels = (
        (D1_CONVS_LEVEL7, D1_SIDE_LEVEL7, D1_CHANNELS_LEVEL7) if small else (D1_CONVS, D1_SIDE, D1_CHANNELS)
    )
    return discriminator(embedding_shape, num_classes, convs, side, last_activation=False, table_channels=channels)


def discriminator(
    sample_shape: tuple[int, ...],
    num_classes: int | None,
    convs: tuple[tuple[int, int], ...],
    table_side: int,
    last_activation: bool,
    table_channels: int | None = None,
) -> LabelConditioned:
    """A discriminator (logit output) for samples of `sample_shape`, label-conditional when
    num_classes is given.

    Images, sequences and embeddings with spatial axes: Table IX's 3-wide convs (Conv1d on
    (C, T) sequences), LeakyReLU after the first, batch norm + LeakyReLU after the middle ones,
    and after the last nothing (d1) or LeakyReLU alone (d2, `last_activation`); then dropout and
    a dense logit. A stride halves only the axes longer than 1 (a 3x96 map: 2x48, 1x24). Widths
    are Table IX's on maps of its size (`table_side` squared positions) and shrink with the
    square root of the ratio of positions either way, at most 4x: on smaller maps so that the
    discriminator does not dwarf the models it regularises (8x8 digits get d2 widths 16-64
    instead of 64-256), on larger ones so that a layer costs what Table IX's does instead of
    growing with the positions (a 48x192 line gets d2 widths 21-85). With `table_channels` (d1:
    Table IX's embedding channels) the widths also shrink with the input's channels below those,
    within the same 4x: an 8x8x8 ResNet embedding gets d1 widths 32-64 instead of 128-256, whose
    2.1M parameters (1600x the simulator's) took 96% of an iteration (8x its time; benchmarks/RESULTS.md).
    Flat samples: a two-layer LeakyReLU MLP.
    """
    spatial = has_spatial_axes(sample_shape)
    label_features = 1 if spatial else LABEL_EMBEDDING
    extra = label_features if num_classes else 0
    if spatial:
        channels, *size = sample_shape
        ratio = math.sqrt(math.prod(size)) / table_side
        narrower = min(1.0, channels / table_channels) if table_channels else 1.0
        scale = max(MIN_WIDTH_SCALE, min(ratio, 1 / ratio) * narrower)
        conv, batch_norm = conv_class(len(size)), batch_norm_class(len(size))
        layers: list[nn.Module] = []
        cin = channels + extra
        for i, (full_width, stride) in enumerate(convs):
            cout = max(1, round(full_width * scale))
            strides = tuple(stride if side > 1 else 1 for side in size)
            layers.append(conv(cin, cout, 3, stride=strides, padding=1))
            if i == 0 or (i == len(convs) - 1 and last_activation):
                layers.append(nn.LeakyReLU(LEAKY_SLOPE))
            elif i < len(convs) - 1:
                layers += [batch_norm(cout), nn.LeakyReLU(LEAKY_SLOPE)]
            size, cin = [-(-side // k) for side, k in zip(size, strides)], cout
        features = cin * math.prod(size)
    else:
        layers = [
            nn.Linear(math.prod(sample_shape) + extra, FLAT_WIDTH),
            nn.LeakyReLU(LEAKY_SLOPE),
            nn.Linear(FLAT_WIDTH, FLAT_WIDTH),
            nn.LeakyReLU(LEAKY_SLOPE),
        ]
        features = FLAT_WIDTH
    body = nn.Sequential(*layers, nn.Flatten(), nn.Dropout(DROPOUT), nn.Linear(features, 1))
    return LabelConditioned(body, sample_shape, num_classes)
