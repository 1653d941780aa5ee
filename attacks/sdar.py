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
targets' labels through a simulated tail, h~(g(z)) when `--top-model-role body` says that
`--top-model` is g, else a head trained in g's place. A top model that outputs the class scores
(`--top-model-role classifier`) holds h and is never used in that mode. `labels = "predicted"`
(a server with the classifier but without labels) conditions the decoder on the labels it infers.
Offline that tail names the classes' clusters arbitrarily (U_SHAPED_LIMIT); `labels = "clustered"`
instead clusters the target embeddings and names the clusters by the layout of the aux classes
(attacks/parts/cluster_naming.py, this tool's addition), then runs the label-conditional attack on them.

Noise: the client adds N(0, sigma^2 I) to what it sends (`--noise-sigma`) and the server sees
that sigma in the protocol, so the attacker adds the same noise to f~'s outputs. Then g is fed
what it was trained on, d1 compares like with like (otherwise it separates real from simulated
embeddings by their noise alone), and the decoder learns to decode noisy embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from splitaudit.attacks.base import Attack, SeedOutcome
from splitaudit.attacks.kmeans import best_assignment_accuracy, largest_class_share
from splitaudit.attacks.parts.cluster_naming import check_clusterable, geometry_named_labels
from splitaudit.attacks.parts.reconstruction import mean_guess_baseline, reconstruction_examples, reconstruction_metrics
from splitaudit.attacks.parts.sdar_training import (
    ABLATIONS,
    EVAL_EVERY,
    FULL,
    LAMBDA1,
    LAMBDA2,
    PATIENCE,
    PATIENCE_WITH_G,
    PRECISIONS,
    SIMULATOR_LR,
    Stopping,
    sdar_reconstruct,
    sdar_training,
    training_precision,
)
from splitaudit.context.audit_context import AuditContext
from splitaudit.core.options import option
from splitaudit.core.plateau import STOPPED_BY_CAP, Plateau

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
LABEL_FLIP = 0.1  # U-shaped SL: probability of replacing an aux label by a uniform one (Fig. 15, line 30)
# Expected share of the iteration cap that runs with early stopping on (benchmarks/sdar_stopping.py):
# the digits CNN ran its cap on all three seeds, the ResNet stem stopped at 0.8 / 0.4 of it, the
# tabular MLP at 0.4 / 0.43 / 1.0. 0.7 is within 2x of any run stopping between 0.35 of the cap and it.
EXPECTED_SHARE = 0.7


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
# How the attack gets labels for f~'s embeddings (SDARSettings.server_part), in the report's words.
SERVER_PARTS = {
    "classifier": "top model g (frozen)",
    "body": "the server's body g (frozen) followed by a simulated tail h~ trained on aux labels",
    "none": "head trained jointly (no top model given: it stands in for g and the client's tail)",
    "withheld": "head trained jointly; --top-model was not used: it outputs the class scores, so it holds "
    "the client's tail, which a U-shaped server does not have (--top-model-role body says it is only g)",
}
# Why offline U-shaped label inference can misname the classes (measured in benchmarks/RESULTS.md).
U_SHAPED_LIMIT = (
    "offline, only d1's match of the embeddings' distribution ties the simulator to f, and a "
    "distribution shows the classes' clusters but not which cluster is which class: the inferred labels "
    "can be a renaming of the true ones (label_accuracy_relabelled scores the partition whatever the "
    "names), and reconstructions decoded through misnamed classes look like other classes; labels = clustered "
    "names the clusters by the layout of the aux classes instead"
)

# Why early stopping is off by default where no top model ties f~ to f (measured in benchmarks/RESULTS.md,
# "The 64 px ResNet stem at the full settings" and "SDAR without g: the cap, not the held-out signal");
# a run that was asked to stop on the signal anyway says so.
BLIND_STOPPING_LIMIT = (
    "without a top model, the held-out aux MSE that ends training measures how well the decoder inverts the "
    "simulator, not how close the simulator is to the bottom model: on a 64 px ResNet stem its rank "
    "correlation with the target MSE over training was 0.06-0.20 (0.87-0.90 on a digits CNN with its top "
    "model), and on the digits CNN without it, stopping on it restored decoders of target MSE 0.068 where "
    "the iteration cap reached 0.014; where it stopped can be an arbitrary point of an erratic curve"
)


@dataclass(frozen=True)
class SDAROptions:
    """`[attack.sdar]`: budget (preset or iterations/batch_size), target labels, label flips, ablation.
    Checked up front; sdar_settings fills in the defaults that depend on the device and --quick."""

    MOVED: ClassVar[dict[str, str]] = {
        "top_model_role": "the run option --top-model-role (what --top-model is; the utility reads it too)"
    }
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
    early_stopping: bool | None = option(
        None,
        "stop when the held-out aux reconstruction MSE stops improving, the iterations a cap (default: on where "
        "a top model labels the simulator's embeddings, off without one, where that signal does not track the "
        "targets; off whatever is asked when the cap is at most eval_every x (patience + 1))",
    )
    eval_every: int = option(EVAL_EVERY, "iterations between two measurements of the held-out aux MSE", low=1)
    patience: int | None = option(
        None,
        f"measurements without a better held-out aux MSE before stopping (default {PATIENCE_WITH_G} where a top "
        f"model labels the simulator's embeddings, {PATIENCE} without one)",
        low=1,
    )
    holdout_fraction: float = option(
        0.1, "share of the aux data held out of training for early stopping", above=0, below=1
    )
    precision: str = option(
        "auto",
        "the training steps' arithmetic: bfloat16 (autocast; weights and measurements stay float32), float32, "
        "or auto (bfloat16 on a CPU with native bf16 instructions for inputs of 1024 values or more, float32 elsewhere)",
        choices=PRECISIONS,
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
    and reports their MSE as `mse_no_d1` and `mse_no_d2`. `--top-model-role` (a run option): "classifier"
    (default; `--top-model` outputs the class scores and is never used with inferred labels, since it
    holds the client's tail) or "body" (it is the server's g; a tail h~ after it is trained).
    `early_stopping` (default: on with a top model, off without): the iterations are a cap; training
    stops when the MSE of a held-out `holdout_fraction` of the aux data (kept out of training),
    reconstructed through f~ and the decoder, has not improved for `patience` measurements taken every
    `eval_every` iterations (the attacker's own signal, never the targets), and the decoder is
    restored to its best measurement; details say how many iterations ran and why training stopped.
    Without g that signal does not track the targets (BLIND_STOPPING_LIMIT), so training runs to the cap.

    Known limits, measured in benchmarks/RESULTS.md (`sdar_curve.py`): offline, U-shaped label
    inference can name the classes' clusters arbitrarily (U_SHAPED_LIMIT), and such runs are
    reported as inconclusive (Attack.inconclusive_reason), never as privacy; without g, d1 is all that ties
    f~ to f (without it the reconstruction stays near the mean guess), and the held-out signal that
    would stop training does not track the targets (BLIND_STOPPING_LIMIT: off by default, said in the
    details of a run asked to stop on it);
    on small tabular data the attack is unstable (Zhu et al., NDSS 2025, evaluate images only). On
    anisotropic images the networks grow and shrink per axis (attacks/parts/nets.py). Without g on a
    binary task, as on the text-line bottom of benchmarks/sdar_diagnosis.py (3x48x192 -> 16x3x96,
    upright/turned), the attack does not learn although its decoder is able: trained on f's own aux
    embeddings the same decoder beats the mean guess, and it inverts f~ on the targets' inputs just
    as well, but f's embeddings decode at the mean guess or worse; a binary label ties f~ to f by
    one bit per sample and d1 matches their distributions, not which input lands where.

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
    input_kinds = frozenset({"image", "sequence", "tabular"})
    other_kinds_reason = (
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

    def inconclusive_reason(self, entry: dict, not_converged: list[str]) -> str:
        """Also inconclusive when the U-shaped label inference does no better than the majority class:
        the reconstructions were trained through labels that carry nothing about the targets."""
        reasons = [super().inconclusive_reason(entry, not_converged)]
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
        x_hat, labels, stalled, plateau, precision = run(FULL)
        metrics = reconstruction_metrics(target.x, x_hat, ctx.space)
        baseline = mean_guess_baseline(ctx.aux.x, target.x, ctx.space)
        if settings.labels != "known":
            metrics["label_accuracy"] = float((labels == target.y).float().mean())
            baseline["label_accuracy"] = majority_class_accuracy(ctx.aux.y, target.y)
            metrics["label_accuracy_relabelled"] = relabelled_accuracy(labels, target.y)
            baseline["label_accuracy_relabelled"] = largest_class_share(target.y)
        if settings.ablation:
            for key, regularizers in ABLATIONS.items():
                metrics[key] = reconstruction_metrics(target.x, run(regularizers)[0], ctx.space)["mse"]
        details = {
            "preset": settings.preset,
            "iterations": settings.iterations,
            "batch_size": settings.batch_size,
            "lambda1": LAMBDA1,
            "lambda2": LAMBDA2,
            "simulator_init": settings.simulator_init,
            "learning_rate": SIMULATOR_LR * settings.lr_scale,
            "precision": precision,
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
        if settings.stopping is not None and settings.server_part in ("none", "withheld"):
            details["stopping_signal_limit"] = BLIND_STOPPING_LIMIT
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
    precision: str  # "float32" or "bfloat16" (auto resolved for the device)


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
    part = server_part(ctx.top_model is not None, ctx.top_model_role, labels)
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
        stopping=early_stopping(opts, iterations, part),
        precision=training_precision(opts.precision, ctx.device, math.prod(ctx.encoder.input_shape)),
    )


def early_stopping(stops: SDAROptions, iterations: int, part: str) -> Stopping | None:
    """The stopping rule, or None where it is off or could not end training before the cap: the
    earliest plateau comes `patience` measurements after the first one, and below that holding aux
    out would only weaken the attack (a quick run's 150 iterations, with the defaults' 350 or 550).
    By default it is on where the top model g (server part `part`) labels the simulator's embeddings,
    there the held-out signal tracks the targets, with patience PATIENCE_WITH_G; without g it is off
    unless asked for (then with patience PATIENCE): that signal does not track the targets
    (BLIND_STOPPING_LIMIT), and stopping on it cost the digits CNN five times its MSE."""
    with_g = part in ("classifier", "body")
    wanted = with_g if stops.early_stopping is None else stops.early_stopping
    patience = stops.patience or (PATIENCE_WITH_G if with_g else PATIENCE)
    if not wanted or iterations <= stops.eval_every * (patience + 1):
        return None
    return Stopping(stops.eval_every, patience, stops.holdout_fraction)


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
        "precision": settings.precision,
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
        return f"why: the classes were separated ({relabelled:.3g} under the best renaming) but named wrongly " + (
            f"({named:.3g}) although labels = clustered named them by the aux classes' layout (agreement "
            f"{entry['details']['label_layout_agreement']:.3g}): the layout does not identify the classes here; "
            "the targets' labels (labels = known) measure what named classes would leak"
            if "label_layout_agreement" in entry.get("details", {})
            else f"({named:.3g}); {U_SHAPED_LIMIT}"
        )
    return (
        f"why: the labels were inferred ({named:.3g}) but the simulator trained on aux did not learn f's map well "
        "enough to decode the targets; the same attack with the targets' labels (sdar.labels = known) shows "
        "whether labels are the cause"
    )


def majority_class_accuracy(aux_y: torch.Tensor, target_y: torch.Tensor) -> float:
    """Label accuracy of always guessing the aux data's most frequent class (the label baseline)."""
    majority = torch.bincount(aux_y).argmax()
    return float((target_y == majority).float().mean())
