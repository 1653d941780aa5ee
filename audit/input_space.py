"""The input space: what kind of inputs an audit is about, decided once and read everywhere else.

The kind (image, sequence, tabular or tokens), the shape and value range of the continuous view
the estimators differentiate, and the metrics that fit it. `decide_space` is the one rule that
turns a data set's sample shape into a kind; the audit context applies it once, where the data
and the encoder meet, and every attack, estimator, network builder and report reads the result
(`ctx.space.kind`, report.json's `data.input_kind`) instead of looking at shapes or values.
Torch-free, so that the result's schema and the reports can name the kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

INPUT_KINDS = ("image", "sequence", "tabular", "tokens")
InputKind = Literal[INPUT_KINDS]  # the schema's and the attacks' names for the kinds
# Metrics that fit one kind only; an attack declares them in its `metrics` and fills them there.
TEXT_METRICS = frozenset({"token_accuracy", "exact_match", "rouge_l", "bleu", "rare_token_recall"})
KIND_METRICS: dict[str, frozenset[str]] = {
    "image": frozenset({"ssim"}),  # structural similarity compares local windows of an image
    "sequence": frozenset(),
    "tabular": frozenset(),
    "tokens": TEXT_METRICS,  # reconstructions decoded to the nearest tokens and read as text
}
SPATIAL_AXES = {"image": 2, "sequence": 1, "tabular": 0, "tokens": 0}
CONTINUOUS_VIEWS = {
    "image": "the input images",
    "sequence": "the input sequences",
    "tabular": "the input features",
    "tokens": "the token embeddings (rows of the model's embedding table, one per position)",
}


@dataclass(frozen=True)
class InputSpace:
    """The audited inputs: their kind, the shape of one sample of the continuous view (what the
    data's x holds and dFIL differentiates: the inputs, or for tokens their embeddings T x D) and
    whether its values lie in [0, 1] (pixel-like: decoders squash and attacks clamp there, PSNR
    takes 1 as the peak; never for tokens)."""

    kind: InputKind
    sample_shape: tuple[int, ...]
    unit_range: bool

    @property
    def spatial_axes(self) -> int:
        """Axes a convolution slides along: 2 for images (H, W), 1 for sequences (T), else 0.
        Token positions are not a signal's axis: token networks work per position or on the flat
        embeddings."""
        return SPATIAL_AXES[self.kind]

    @property
    def continuous_view(self) -> str:
        """What the estimators differentiate and the reconstruction attacks reconstruct, in words."""
        return CONTINUOUS_VIEWS[self.kind]

    @property
    def metrics(self) -> frozenset[str]:
        """The kind-specific metrics that fit these inputs (SSIM on images, text metrics on tokens)."""
        return KIND_METRICS[self.kind]

    def leaves_out(self, declared: tuple[str, ...] | frozenset[str]) -> frozenset[str]:
        """Those of an attack's declared metrics that fit other kinds only (not filled here)."""
        other = frozenset().union(*(m for kind, m in KIND_METRICS.items() if kind != self.kind))
        return frozenset(declared) & (other - self.metrics)


def decide_space(sample_shape: tuple[int, ...], unit_range: bool, tokens: bool) -> InputSpace:
    """The one rule that decides the kind of an audit's inputs:

    - tokens: the data holds token ids and the model was cut after its embedding lookup (--vocab
      declares it; nothing infers it): the continuous view is the embeddings, T x D;
    - image: samples C x H x W, whatever C: a one-channel 1 x H x W (a spectrogram, a grayscale
      scan) is an image, as the 2-D convolutions of a model over it take it;
    - sequence: samples C x T, channels over one axis (1-D conv bottoms: audio, sensor series);
      a two-axis sample is never an image without its channel axis (give H x W as 1 x H x W);
    - tabular: flat samples (d,), and samples of four or more axes, which no network here
      convolves: they are treated as flat features.

    unit_range: whether the data's values lie in [0, 1]; ignored for tokens."""
    shape = tuple(sample_shape)
    if tokens:
        return InputSpace("tokens", shape, unit_range=False)
    kind: InputKind = {3: "image", 2: "sequence"}.get(len(shape), "tabular")
    return InputSpace(kind, shape, unit_range)
