"""SDAR: simulator decoding with adversarial regularisation (Zhu et al., NDSS 2025).

Offline form of the vanilla-SL attack (Zhu et al., NDSS 2025, Sec. IV-A and Fig. 14). The attacker (the
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
so by default the attacker uses the target labels themselves. In U-shaped SL (Sec. IV-B) the
server has no labels and holds only the body g, never the client's tail h: option `labels =
"inferred"` drops the label inputs of the decoder and discriminators (App. B-C) and infers the
targets' labels through a simulated tail, h~(g(z)) when `top_model_role = "body"` says that
`--top-model` is g, else a head trained in g's place. A top model that outputs the class scores
(`top_model_role = "classifier"`) holds h and is never used in that mode. `labels = "predicted"`
(a server with the classifier but without labels) conditions the decoder on the labels it infers.
Offline that tail names the classes' clusters arbitrarily (U_SHAPED_LIMIT); `labels = "clustered"`
instead clusters the target embeddings and names the clusters by the layout of the aux classes
(attacks/cluster_naming.py, this tool's addition), then runs the label-conditional attack on them.

Noise: the client adds N(0, sigma^2 I) to what it sends (`--noise-sigma`) and the server sees
that sigma in the protocol, so the attacker adds the same noise to f~'s outputs. Then g is fed
what it was trained on, d1 compares like with like (otherwise it separates real from simulated
embeddings by their noise alone), and the decoder learns to decode noisy embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from splitaudit.attacks.base import Attack, SeedOutcome, option
from splitaudit.attacks.cluster_naming import check_clusterable, geometry_named_labels
from splitaudit.attacks.kmeans import best_assignment_accuracy
from splitaudit.attacks.nets import (
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
from splitaudit.attacks.plateau import STOPPED_BY_CAP, Plateau, evaluating, restore, snapshot
from splitaudit.attacks.reconstruction import mean_guess_baseline, reconstruction_examples, reconstruction_metrics
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
# Budgets (option `preset`). "paper": SL's batches of 128 for 20k iterations (App. B-B) at the
# paper's learning rates, the default on a GPU. "cpu": chosen by measured learning curves
# (benchmarks/sdar_curve.py: digits CNN, targets' labels, batch 32, target MSE; mean guess 0.073).
# Steps matter more than the batch (seed 0 at 1000/1500 iterations: batch 16 0.0222/0.0185,
# 32 0.0210/0.0184, 64 0.0208/0.0163; a step of 64 costs 1.5x one of 32), and every learning
# rate 4x the paper's (their relations kept: the decoder's half the simulator's, each
# discriminator's lambda times its generator's) reaches in 1000 iterations what the paper's
# rates reach in 2000: with g, seeds 0/1/2, paper rates 0.0210/0.0220/- at 1000 and
# 0.0146/0.0167/- at 2000; 2x 0.0161/0.0171/- at 1000; 4x 0.0138/0.0152/0.0153 at 1000,
# 0.0129/0.0143/0.0118 at 1500 (the preset), 0.0108/0.0115/0.0133 at 2000. Without g, where only
# d1 ties f~ to f, seed 0: paper rates 0.0495 at 2000; 4x 0.0244 at 1000, 0.0133 at 2000, 0.0119
# at 2500 (the preset), 0.0100 at 3000. One iteration of 32 costs ~22 ms on one CPU core.
# The simulator's initial weights: "paper" keeps the authors' (Keras's Glorot-uniform, from their
# released code; the paper names none), "cpu" PyTorch's Kaiming-uniform, which trains the digits
# CNN's simulator faster (SDARNets.build has the numbers).
PRESETS = {
    "cpu": {"iterations": 1500, "batch_size": 32, "simulator_init": "kaiming", "lr_scale": 4.0},
    "paper": {"iterations": 20000, "batch_size": 128, "simulator_init": "glorot", "lr_scale": 1.0},
}
ITERATIONS_WITHOUT_G = 2500  # the cpu preset's budget when no top model is given
QUICK_ITERATIONS = 150
DROPOUT = 0.4  # Table IX discriminators
HEAD_WIDTH = 128  # the head trained in g's place when no top model is given
LABEL_FLIP = 0.1  # U-shaped SL: probability of replacing an aux label by a uniform one (Fig. 15, line 30)
# Table IX conv stacks, (channels, stride) per 3x3 conv, and the map side they are used at
# there: d1 at split levels 4-6 (ResNet-20's 32x16x16 embeddings) and at level 7 (64x8x8), d2
# on 32x32 images. d1 also narrows with its input's channels against those 32 and 64.
D1_CONVS, D1_SIDE, D1_CHANNELS = ((64, 1), (128, 2), (256, 1), (256, 1), (256, 1), (256, 2)), 16, 32
D1_CONVS_LEVEL7, D1_SIDE_LEVEL7, D1_CHANNELS_LEVEL7 = ((128, 1), (256, 1), (256, 1), (256, 1), (256, 2)), 8, 64
D2_CONVS, D2_SIDE = ((64, 1), (128, 2), (128, 2), (256, 2)), 32
MIN_WIDTH_SCALE = 0.25
FLAT_WIDTH = 256  # discriminator MLP width for flat samples
# Early stopping on the held-out aux MSE (option early_stopping): measured every EVAL_EVERY
# iterations, stopped after PATIENCE measurements without a new best, the decoder restored to
# its best measurement. Chosen by replaying the rule on recorded curves (benchmarks/sdar_stopping.py;
# digits CNN with g, seeds 0-2, cap 1500; today's fixed budget 0.0130 +- 0.0010 target MSE):
# patience 6 at 50 runs to the cap on all three seeds and, restored to its best measurement,
# reaches 0.0121; patience 4 stopped at 1050/900/750 iterations with 0.0145 (+1.5 std), patience
# 2-3 at 400-700 with 0.017 (+4 std). The held-out signal moves by 10-20% between measurements.
EVAL_EVERY = 50
PATIENCE = 6
# Expected share of the iteration cap that runs with early stopping on (benchmarks/sdar_stopping.py):
# the digits CNN ran its cap on all three seeds, the ResNet stem stopped at 0.8 / 0.4 of it, the
# tabular MLP at 0.4 / 0.43 / 1.0. 0.7 is within 2x of any run stopping between 0.35 of the cap and it.
EXPECTED_SHARE = 0.7
STALL_MIN_ITERATIONS = 20  # fewer: too few losses to tell a trend from batch noise
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


# Where the labels of the target embeddings come from (option `labels`; "true" is the old
# name of "known").
LABEL_SOURCES = {
    "known": "the targets' own labels (vanilla SL: the server holds them)",
    "inferred": "inferred by the attack (U-shaped SL: label-free decoder and discriminators, "
    "labels from the classifier)",
    "predicted": "predicted by the classifier, and the decoder conditioned on them",
    "clustered": "inferred without a classifier (U-shaped SL): k-means clusters of the target embeddings, each "
    "named after the aux class whose place in the class layout it takes; decoder and discriminators "
    "conditioned on them",
}
LABEL_ALIASES = {"true": "known"}
# What `--top-model` is (option `top_model_role`), and so what the attacker may do with it.
TOP_MODEL_ROLES = {
    "classifier": "it outputs the class scores (vanilla SL: the server's part ends in the classifier)",
    "body": "it is the server's body g of U-shaped SL; the client's tail h after it is simulated (h~)",
}
# How the attack gets labels for f~'s embeddings (SDARSettings.server_part), in the report's words.
SERVER_PARTS = {
    "classifier": "top model g (frozen)",
    "body": "the server's body g (frozen) followed by a simulated tail h~ trained on aux labels",
    "none": "head trained jointly (no top model given: it stands in for g and the client's tail)",
    "withheld": "head trained jointly; --top-model was not used: it outputs the class scores, so it holds "
    "the client's tail, which a U-shaped server does not have (top_model_role = body says it is only g)",
}
# Why offline U-shaped label inference can misname the classes (issue 25's measurements, benchmarks/README.md).
U_SHAPED_LIMIT = (
    "offline, only d1's match of the embeddings' distribution ties the simulator to f, and a "
    "distribution shows the classes' clusters but not which cluster is which class: the inferred labels "
    "can be a renaming of the true ones (label_accuracy_relabelled scores the partition whatever the "
    "names), and reconstructions decoded through misnamed classes look like other classes; labels = clustered "
    "names the clusters by the layout of the aux classes instead"
)
FULL = Regularizers()
ABLATIONS = {"mse_no_d1": Regularizers(d1=False), "mse_no_d2": Regularizers(d2=False)}


@dataclass(frozen=True)
class SDAROptions:
    """`[attack.sdar]`: budget (preset or iterations/batch_size), target labels, label flips, ablation.
    Checked up front; sdar_settings fills in the defaults that depend on the device and --quick."""

    preset: str | None = option(
        None, "training budget: paper (GPU default) or cpu (CPU default)", choices=tuple(PRESETS)
    )
    iterations: int | None = option(
        None, f"training iterations (default: the preset's; quick {QUICK_ITERATIONS})", low=1
    )
    batch_size: int | None = option(None, "training batch size (default: the preset's)", low=2)
    labels: str = option(
        "known",
        "the target labels: known (vanilla SL); in U-shaped SL inferred (the paper's simulated tail) or "
        "clustered (k-means clusters named by the class layout; labels the decoder is conditioned on)",
        choices=tuple(LABEL_SOURCES) + tuple(LABEL_ALIASES),
    )
    label_flip: float | None = option(
        None,
        f"probability of replacing an aux label by a uniform one (default {LABEL_FLIP} where a "
        "classifier infers the target labels, 0 otherwise)",
        low=0,
        high=1,
    )
    ablation: bool = option(False, "also run without d1 and without d2 (mse_no_d1, mse_no_d2)")
    top_model_role: str = option(
        "classifier",
        "what --top-model is: classifier (it outputs the class scores; never used to infer labels in "
        "U-shaped SL) or body (the server's part g of U-shaped SL, followed by a simulated tail)",
        choices=tuple(TOP_MODEL_ROLES),
    )
    early_stopping: bool = option(
        True,
        "stop when the held-out aux reconstruction MSE stops improving (the iterations stay a cap; off when "
        "the cap is at most eval_every x (patience + 1), where no plateau could end training earlier)",
    )
    eval_every: int = option(EVAL_EVERY, "iterations between two measurements of the held-out aux MSE", low=1)
    patience: int = option(PATIENCE, "measurements without a better held-out aux MSE before stopping", low=1)
    holdout_fraction: float = option(
        0.1, "share of the aux data held out of training for early stopping", above=0, below=1
    )


class SDARAttack(Attack):
    """SDAR (Zhu et al., NDSS 2025): simulator + decoder, each regularised by a discriminator.

    Options (`[attack.sdar]`): `preset` ("cpu": 1500 iterations of 32 with g, 2500 without, at
    4x the paper's learning rates, 150 under --quick; "paper": App. B-B's 20,000 iterations of
    128 at the paper's rates, the default on a GPU);
    `iterations` and `batch_size` override the preset's; `labels`: "known" (default; "true" is
    its old name): the server holds the targets' labels, as in vanilla SL; "inferred": the
    U-shaped attack (Sec. IV-B, Fig. 15): decoder and discriminators without label inputs (App.
    B-C), the classifier trained on aux labels flipped with probability `label_flip` (0.1; the
    paper tries 0.1-0.4) and its argmax on the target embeddings reported as `label_accuracy`
    beside the MSE, against the majority-class baseline; "predicted": the same label inference,
    but the decoder and discriminators conditioned on the inferred labels. `ablation = true`
    also runs the variants without d1 and without d2 (same seed, so the same initial networks)
    and reports their MSE as `mse_no_d1` and `mse_no_d2`. `top_model_role`: "classifier" (default;
    `--top-model` outputs the class scores and is never used with inferred labels, since it holds
    the client's tail) or "body" (it is the server's g; a tail h~ after it is trained).
    `early_stopping` (default true): the iterations are a cap; training stops when the MSE of a
    held-out `holdout_fraction` of the aux data (kept out of training), reconstructed through f~
    and the decoder, has not improved for `patience` measurements taken every `eval_every`
    iterations (the attacker's own signal, never the targets), and the decoder is restored to its
    best measurement; details say how many iterations ran and why training stopped.

    U-shaped label inference offline (benchmarks/README.md, seed 0, cpu preset, flips 0.1; majority
    0.092, mean guess 0.073): digits CNN without g, label accuracy 0.137 and MSE 0.114 at 1500
    iterations; with its body g 0.068 and 0.193 at 1000; a flat LayerNorm U-shaped model with its g
    0.016 at 500, but 0.512 under the best renaming of the classes (`label_accuracy_relabelled`):
    the unconditional d1 matches the embeddings' distribution, which does not name the clusters
    (U_SHAPED_LIMIT). Such runs are reported as FAILED (Attack.training_failure), never as privacy.
    Where g's map carries the names the tail works: on tests/ushaped.py's ResNet (8x8x8 embeddings,
    a strided basic block as g) 0.992 and MSE 0.0055 at 1500 iterations (known labels: 0.0071), on
    its MobileNet 0.842 and 0.0085; on its ViT 0.19-0.24 (0.27-0.36 relabelled) and MSE about the mean guess. `labels = "clustered"` (k-means named by
    the class layout) names 0.980 on the flat model, 0.935 on the ResNet (MSE 0.0072), 0.645 on the
    MobileNet (0.0142) and 0.231 on the ViT, fixed before training.

    What the ablation shows (digits CNN, targets' labels, seed 0, benchmarks/sdar_curve.py; Zhu et
    al. (NDSS 2025) report about 3x on CIFAR-10). Without g, d1 is all that ties f~ to f: the
    decoder soon fits f~'s embeddings, but on the targets it does no better than the mean guess
    (0.073) unless d1 pulls f~ onto f's embeddings. At the cpu preset's rates: 0.0160 at 1500
    iterations and 0.0119 at 2500 with d1, against 0.116 and 0.121 without (10x); at the
    paper's rates: 0.0495 against 0.096-0.106 at 2000 (2x). With g, g already ties f~ to f and
    d1 adds little: 0.0129 with d1 and 0.0125 without at 1500 iterations (cpu preset), within
    the spread between seeds. A regression found on the way: after issue 13's changes the
    demo's SDAR MSE rose from 0.0154 to 0.0267 because the U-shaped label flips were applied
    with known labels too (seed 0, 2000 iterations, paper rates: 0.0290 with them, 0.0146
    without); they now apply only where the attack infers the labels.
    On small tabular data SDAR is unstable (breast_cancer, 285 aux rows, binary label, with g,
    seed 0: target MSE 0.013 at 600 iterations, 0.059 at 2000, mean guess 0.021): g barely
    constrains f~ and d1 does not keep it on f's embeddings; Zhu et al. (NDSS 2025) evaluates images only.
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
    relative_cost = 100.0  # digits CNN on one CPU core: ~35 s a seed, the decoder ~7 s
    needs = frozenset({"labels"})
    # Over token embeddings the simulator would be the bottom re-initialised from the embeddings on,
    # trained to reproduce hidden states of aux sentences without querying f; its decoder would
    # regress embeddings to be decoded to the nearest tokens. Not built or validated for text yet.
    not_for_tokens = (
        "not adapted to token inputs: its simulator and discriminators are built for continuous inputs; "
        "for text, the decoder and token-inversion attacks (query access) are run instead"
    )
    title = "SDAR inversion (no query access)"
    query_access_reference = "decoder"
    metrics = ("mse", "psnr", "ssim")
    Options = SDAROptions
    assumptions = (
        "Passive server without any query access to the bottom model: it sees only the target "
        "embeddings (with the client's noise) and, as in vanilla split learning, their labels "
        "(with labels = inferred, as in U-shaped split learning, it does not and infers them); "
        "it holds labelled auxiliary data from the same domain, knows the bottom model's "
        "architecture (else only its input/output shapes) and the noise level, and uses the "
        "trained top model when one is given (Zhu et al., NDSS 2025)."
    )

    def check_inputs(self, ctx: AuditContext) -> None:
        """Clustered labels need aux samples of every class and a target sample per cluster."""
        if ctx.aux.y is not None and sdar_settings(ctx).labels == "clustered":
            check_clusterable(ctx.aux.y, len(ctx.target), ctx.num_classes)

    def training_failure(self, entry: dict, not_converged: list[str]) -> str:
        """Also FAILED when the U-shaped label inference does no better than the majority class: the
        reconstructions were trained through labels that carry nothing about the targets."""
        reasons = [super().training_failure(entry, not_converged)]
        accuracy, majority = entry["metrics"].get("label_accuracy"), entry["baseline"].get("label_accuracy")
        if accuracy is not None and accuracy <= majority:
            reasons.append(
                f"its label inference did no better than the majority class (label accuracy {accuracy:.3g} "
                f"against {majority:.3g})"
            )
        if any(reasons) and accuracy is not None:
            reasons.append(label_diagnosis(entry))
        return "; ".join(r for r in reasons if r)

    def estimated_seconds(self, ctx: AuditContext, pass_seconds: float, timed: Callable) -> float:
        """A few of its own training iterations, timed on this model and data, times the
        iterations of every seed and ablation variant."""
        settings = sdar_settings(ctx)
        observed = ctx.observed_embeddings("target", ctx.generator(0))
        known = conditioning_labels(ctx, settings.labels, observed, 0)[0]
        training = sdar_training(ctx, observed, known, 0, settings.batch_size, FULL, **training_options(settings))
        with training as (_, iteration, _):
            seconds = timed(iteration)
        variants = 1 + (len(ABLATIONS) if settings.ablation else 0)
        return len(ctx.seeds) * variants * settings.iterations * seconds

    def expected_share_of_cap(self, ctx: AuditContext) -> float:
        """EXPECTED_SHARE of the iteration cap where early stopping is on, else all of it."""
        return 1.0 if sdar_settings(ctx).stopping is None else EXPECTED_SHARE

    def run_seed(self, ctx: AuditContext, seed: int) -> SeedOutcome:
        settings = sdar_settings(ctx)
        target = ctx.target
        observed = ctx.observed_embeddings("target", ctx.generator(seed))
        known_labels, naming = conditioning_labels(ctx, settings.labels, observed, seed)
        run = lambda regularizers: sdar_reconstruct(
            ctx,
            observed,
            known_labels,
            seed,
            settings.iterations,
            settings.batch_size,
            regularizers,
            stopping=settings.stopping,
            **training_options(settings),
        )
        x_hat, labels, stalled, plateau = run(FULL)
        metrics = reconstruction_metrics(target.x, x_hat, target.is_image)
        baseline = mean_guess_baseline(ctx.aux.x, target.x, target.is_image)
        if settings.labels != "known":
            metrics["label_accuracy"] = float((labels == target.y).float().mean())
            baseline["label_accuracy"] = majority_class_accuracy(ctx.aux.y, target.y)
            metrics["label_accuracy_relabelled"] = relabelled_accuracy(labels, target.y)
            baseline["label_accuracy_relabelled"] = largest_class_share(target.y)
        if settings.ablation:
            for key, regularizers in ABLATIONS.items():
                metrics[key] = reconstruction_metrics(target.x, run(regularizers)[0], target.is_image)["mse"]
        details = {
            "preset": settings.preset,
            "iterations": settings.iterations,
            "batch_size": settings.batch_size,
            "lambda1": LAMBDA1,
            "lambda2": LAMBDA2,
            "simulator_init": settings.simulator_init,
            "learning_rate": SIMULATOR_LR * settings.lr_scale,
            "simulator": "bottom model's architecture, re-initialised"
            if ctx.encoder.architecture() is not None
            else "generic network of the same shapes",
            "classifier": SERVER_PARTS[settings.server_part],
            "target_labels": LABEL_SOURCES[settings.labels],
            "attacker_holds": attacker_holds(ctx, settings),
            **stop_details(plateau, settings.iterations),
        }
        if settings.label_flip:
            details["label_flip"] = settings.label_flip
        if settings.labels == "inferred":
            details["label_inference_limit"] = U_SHAPED_LIMIT
        if naming:  # flat facts: the report's tables show scalars, not nested dicts
            details["label_layout_agreement"] = naming["layout_agreement"]
            details["label_cluster_features"] = naming["features"]["reduction"]
        return SeedOutcome(
            metrics=metrics,
            baseline=baseline,
            examples=reconstruction_examples(target.x, x_hat),
            details=details,
            not_converged=stalled,
        )


@dataclass(frozen=True)
class SDARSettings:
    """What one SDAR run uses: its options with the defaults that depend on the device, the top
    model and --quick filled in, and what follows from them (server_part, stopping)."""

    preset: str
    labels: str  # a key of LABEL_SOURCES (LABEL_ALIASES resolved)
    iterations: int
    batch_size: int
    simulator_init: str
    lr_scale: float
    label_flip: float
    ablation: bool
    server_part: str  # a key of SERVER_PARTS
    stopping: Stopping | None


def sdar_settings(ctx: AuditContext) -> SDARSettings:
    """The run's options (checked: InputError), with the preset's budget where iterations/batch_size are not given.

    The preset defaults to "paper" on a GPU and "cpu" otherwise. Quick runs are a smoke test
    (QUICK_ITERATIONS) unless a preset or iterations are asked for. That quick budget is the one
    exception to Attack.options' quick_X rule: a quick_iterations option would replace even the
    iterations a user asks for under --quick, and here the user's preset or iterations win.
    """
    opts = SDARAttack().options(ctx)
    preset = opts.preset or ("paper" if ctx.device.type == "cuda" else "cpu")
    labels = LABEL_ALIASES.get(opts.labels, opts.labels)
    budget = dict(PRESETS[preset])
    part = server_part(ctx.top_model is not None, opts.top_model_role, labels)
    if preset == "cpu" and part in ("none", "withheld"):
        budget["iterations"] = ITERATIONS_WITHOUT_G
    if ctx.quick and opts.preset is None:
        budget["iterations"] = QUICK_ITERATIONS
    iterations = budget["iterations"] if opts.iterations is None else opts.iterations
    # Flipping regularises label inference (U-shaped SL); with the targets' labels known it would
    # only train the simulator on wrong labels (digits CNN with g, seed 0, 2000 iterations:
    # target MSE 0.0290 with 10% flips against 0.0146 without).
    default_flip = LABEL_FLIP if labels in ("inferred", "predicted") else 0.0
    return SDARSettings(
        preset=preset,
        labels=labels,
        iterations=iterations,
        batch_size=budget["batch_size"] if opts.batch_size is None else opts.batch_size,
        simulator_init=budget["simulator_init"],
        lr_scale=budget["lr_scale"],
        label_flip=default_flip if opts.label_flip is None else opts.label_flip,
        ablation=opts.ablation,
        server_part=part,
        stopping=early_stopping(opts, iterations),
    )


def early_stopping(stops: SDAROptions, iterations: int) -> Stopping | None:
    """The stopping rule, or None where it is off or could not end training before the cap: the
    earliest plateau comes `patience` measurements after the first one, and below that holding aux
    out would only weaken the attack (a quick run's 150 iterations, with the defaults' 350)."""
    if not stops.early_stopping or iterations <= stops.eval_every * (stops.patience + 1):
        return None
    return Stopping(stops.eval_every, stops.patience, stops.holdout_fraction)


def stop_details(plateau: Plateau | None, iterations: int) -> dict:
    """How many iterations ran and why training ended, for the report's details."""
    if plateau is None:
        return {"iterations_trained": iterations, "stopped_by": STOPPED_BY_CAP}
    return {**plateau.details("iterations"), "holdout_mse": plateau.best, "holdout_curve": plateau.history}


def attacker_holds(ctx: AuditContext, settings: SDARSettings) -> str:
    """What the attacker was given, in the report's words (the threat model of this run)."""
    parts = [
        "the target embeddings (with the client's noise)",
        "labelled auxiliary data",
        "the bottom model's architecture" if ctx.encoder.architecture() is not None else "the bottom model's shapes",
    ]
    if settings.labels == "known":
        parts.append("the targets' labels")
    part = settings.server_part
    if part == "classifier":
        parts.append("the top model g, which outputs the class scores")
    elif part == "body":
        parts.append("the server's body g (not the client's tail h)")
    return ", ".join(parts)


def server_part(has_top_model: bool, role: str, labels: str) -> str:
    """How the attack uses --top-model (a key of SERVER_PARTS). A top model that outputs the class
    scores holds the client's tail in U-shaped SL, which the server does not have: with inferred
    labels it is never used, or the "inferred" labels would be read off the client's classifier."""
    if not has_top_model:
        return "none"
    if role == "body":
        return "body"
    return "withheld" if labels in ("inferred", "clustered") else "classifier"


def conditioning_labels(
    ctx: AuditContext, labels: str, observed: torch.Tensor, seed: int
) -> tuple[torch.Tensor | None, dict]:
    """The target labels the decoder and discriminators are conditioned on, fixed before training
    (None: the classifier's, as training goes), and how clustered labels were named. `labels`: the
    run's label source (SDARSettings.labels)."""
    if labels == "known":
        return ctx.target.y, {}
    if labels == "clustered":
        return geometry_named_labels(observed, ctx.aux.x, ctx.aux.y, ctx.num_classes, seed)
    return None, {}


def training_options(settings: SDARSettings) -> dict:
    """The keyword arguments of sdar_reconstruct/sdar_training that a run's settings decide."""
    return {
        "conditional": settings.labels != "inferred",
        "label_flip": settings.label_flip,
        "simulator_init": settings.simulator_init,
        "lr_scale": settings.lr_scale,
        "server_part": settings.server_part,
    }


def relabelled_accuracy(predicted: torch.Tensor, true: torch.Tensor) -> float:
    """Label accuracy under the best one-to-one renaming of the predicted classes (Hungarian
    matching on the confusion matrix): how well the inferred labels partition the targets into
    their classes, whatever each part is called. Without a label-tied signal (U-shaped SDAR without
    g) the attack can find the classes' clusters and still name them wrongly. The same score as
    k-means' cluster accuracy."""
    return best_assignment_accuracy(predicted.cpu().numpy(), true.cpu().numpy())


PARTITION_MARGIN = 0.05  # relabelled accuracy within this of one constant label: no classes found
NAMING_MARGIN = 0.1  # named accuracy this far below the relabelled one: the classes were misnamed


def label_diagnosis(entry: dict) -> str:
    """Why a U-shaped run (labels not known) failed, read off its label metrics: the classes were
    not separated, separated but misnamed, or labelled well with the reconstruction still lost."""
    named, relabelled = entry["metrics"]["label_accuracy"], entry["metrics"]["label_accuracy_relabelled"]
    constant = entry["baseline"]["label_accuracy_relabelled"]
    if relabelled <= constant + PARTITION_MARGIN:
        return (
            f"why: the target embeddings' classes were not separated (label accuracy {relabelled:.3g} even under "
            f"the best renaming of classes, against {constant:.3g} for one constant label), so the labels gave "
            "the reconstructions nothing to condition on"
        )
    if named < relabelled - NAMING_MARGIN:
        return (
            f"why: the classes were separated ({relabelled:.3g} under the best renaming) but named wrongly "
            f"({named:.3g}); {U_SHAPED_LIMIT}"
        )
    return (
        f"why: the labels were inferred ({named:.3g}) but the simulator trained on aux did not learn f's map well "
        "enough to decode the targets; the same attack with the targets' labels (sdar.labels = known) shows "
        "whether labels are the cause"
    )


def largest_class_share(y: torch.Tensor) -> float:
    """The relabelled accuracy of any constant labelling: the largest class's share of y."""
    return float(torch.bincount(y).max()) / len(y)


def majority_class_accuracy(aux_y: torch.Tensor, target_y: torch.Tensor) -> float:
    """Label accuracy of always guessing the aux data's most frequent class (the label baseline)."""
    majority = torch.bincount(aux_y).argmax()
    return float((target_y == majority).float().mean())


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
) -> tuple[torch.Tensor, torch.Tensor, str, Plateau | None]:
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
    restored to their state at the best measurement. Returns the reconstructions, the target
    labels the classifier gives (or the known ones), why the training signal stalled ("" if it
    did not) and the held-out signal's Plateau (None without `stopping`).
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
        return (*nets.decode(observed), nets.stalled(), plateau)


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
) -> Iterator[tuple["SDARNets", Callable[[], None], Callable[[], float]]]:
    """SDAR's freshly built networks, a function that runs one training iteration and one that
    measures the held-out aux MSE, inside the attack's seeded, thread-limited scope
    (sdar_reconstruct trains with it, the cost estimate times it). A `holdout_fraction` of the
    aux data is held out of training (at least one sample when positive). Dropout draws from the
    global RNG (seeded: reproducible runs). The networks are small: on CPU one thread avoids the
    threads' hand-offs that slow small ops down on busy cores."""
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
        yield (
            nets,
            lambda: sdar_iteration(ctx, nets, observed, gen, streams),
            lambda: holdout_mse(ctx, nets, holdout, seed),
        )


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
        self.known_labels, self.conditional = known_labels, conditional
        self.label_flip, self.num_classes = label_flip, num_classes
        simulated = list(simulator.parameters()) + (list(classifier.parameters()) if train_classifier else [])
        adam = lambda params, lr: torch.optim.Adam(params, lr=lr, eps=ADAM_EPS)
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
            decoder = Decoder(embedding_shape, input_shape, ctx.aux.in_unit_range, label_classes)
            d1 = d1_discriminator(embedding_shape, label_classes) if regularizers.d1 else None
            d2 = (
                discriminator(input_shape, label_classes, D2_CONVS, D2_SIDE, last_activation=True)
                if regularizers.d2
                else None
            )
        on_device = lambda net: None if net is None else net.to(ctx.device).train()
        classifier = on_device(head) if head is not None else ctx.top_model
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

    z_aux = ctx.add_noise(nets.simulator(x_aux), gen)
    simulator_loss = F.cross_entropy(nets.classifier(z_aux), nets.training_labels(y_aux, gen))
    nets.task_losses.append(simulator_loss.detach())
    updates = []
    if nets.d1 is not None:
        fake = nets.d1(z_aux, c_aux)
        simulator_loss = simulator_loss + LAMBDA1 * bce(fake, 1.0)
        updates.append((bce(fake, 0.0) + bce(nets.d1(z_target, c_target), 1.0), nets.d1_opt))
    updates.append((simulator_loss, nets.simulator_opt))
    simultaneous_step(updates)

    with torch.no_grad():
        z_aux = ctx.add_noise(nets.simulator(x_aux), gen)
    decoder_loss = F.mse_loss(nets.decoder(z_aux, c_aux), x_aux)
    updates = []
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
    2.1M parameters (1600x the simulator's) took 96% of an iteration (8x its time; benchmarks/README.md).
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
