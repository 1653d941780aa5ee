"""Matplotlib charts (Agg backend) rendered to PNG bytes; the writers inline or save them."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from splitaudit.core.errors import InputError  # noqa: E402

ATTACK_COLOR, BASELINE_COLOR, VIOLATION_COLOR = "#2b6cb0", "#a0aec0", "#c53030"
# text.usetex off: a matplotlibrc that turns it on would hand every label to LaTeX
STYLE = {"font.size": 9, "axes.spines.top": False, "axes.spines.right": False, "text.usetex": False}
DPI = 130
MAX_LABEL_CHARS = 60  # longer text from a report is cut: with bbox_inches="tight" a label's length sizes the canvas
MAX_FIGURE_PIXELS = 25_000_000  # 100 MB as RGBA; the largest chart of a real report is under 1 million pixels


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def chart_text(value) -> str:
    """A string from a report (attack name, example label, axis words) as matplotlib text: one line of at
    most MAX_LABEL_CHARS, every '$' escaped so that matplotlib never parses it as mathtext (a
    malformed formula such as '$\\foo{$' raises while the figure is saved)."""
    text = " ".join(str(value).split())
    if len(text) > MAX_LABEL_CHARS:
        text = text[: MAX_LABEL_CHARS - 1] + "…"
    return text.replace("$", r"\$")


def _subplots(width: float, height: float, **kwargs):
    """plt.subplots of figsize (width, height) inches, refused before any canvas is allocated when it
    would exceed MAX_FIGURE_PIXELS at DPI (sizes grow with the attacks or examples a report holds)."""
    pixels = width * height * DPI**2
    if pixels > MAX_FIGURE_PIXELS:
        raise InputError(
            f"a chart of this report would be {width:.0f} x {height:.0f} inches ({pixels / 1e6:.0f} million pixels), "
            f"over the {MAX_FIGURE_PIXELS / 1e6:.0f} million a chart may take: the report holds far more attacks "
            "or examples than splitaudit writes"
        )
    return plt.subplots(figsize=(width, height), **kwargs)


def dfil_histogram(values: list[float]) -> bytes:
    """Distribution of per-sample dFIL (finite values); log-scaled when they span decades."""
    data = np.asarray(values, dtype=float)
    with plt.rc_context(STYLE):
        fig, ax = _subplots(6, 2.6)
        spread = data.min() > 0 and data.max() / data.min() > 50
        bins = np.geomspace(data.min(), data.max(), 40) if spread else 40
        ax.hist(data, bins=bins, color=ATTACK_COLOR, alpha=0.85)
        if spread:
            ax.set_xscale("log")
        ax.axvline(data.mean(), color=VIOLATION_COLOR, linestyle="--", label=f"mean {data.mean():.3g}")
        ax.set_xlabel("dFIL per sample (higher = leaks more)")
        ax.set_ylabel("samples")
        ax.legend(frameon=False)
        return _png(fig)


@dataclass
class MseBar:
    """One reconstruction attack in the bound chart."""

    name: str
    mse: float
    std: float
    baseline: float | None
    violates: bool


@dataclass
class BoundLine:
    """A bound drawn across the attacks' bars: its label, value (None: not computed) and colour."""

    label: str
    value: float | None
    color: str


def bounds_chart(bars: list[MseBar], bounds: list[BoundLine]) -> bytes:
    """Each reconstruction attack's MSE against the bounds and its mean-guess baseline."""
    with plt.rc_context(STYLE):
        fig, ax = _subplots(6.5, 0.55 * len(bars) + 1.4)
        rows = np.arange(len(bars))
        colors = [VIOLATION_COLOR if b.violates else ATTACK_COLOR for b in bars]
        errors = [b.std if math.isfinite(b.std) else 0 for b in bars]
        ax.barh(rows, [b.mse for b in bars], xerr=errors, color=colors, height=0.5, label="attack MSE")
        baselines = [(i, b.baseline) for i, b in enumerate(bars) if b.baseline is not None]
        if baselines:
            ax.scatter(
                [v for _, v in baselines],
                [i for i, _ in baselines],
                marker="|",
                s=400,
                color="black",
                zorder=3,
                label="guessing the average input",
            )
        for line in bounds:
            if line.value is not None and math.isfinite(line.value):
                ax.axvline(
                    line.value, color=line.color, linestyle="--", label=f"{chart_text(line.label)}: {line.value:.3g}"
                )
        ax.set_yticks(rows, [chart_text(b.name) + (" (beats the bound!)" if b.violates else "") for b in bars])
        ax.invert_yaxis()
        ax.set_xlabel("reconstruction MSE per input dimension (lower = attack recovers more)")
        ax.legend(
            frameon=False,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.35 if len(bars) < 3 else -0.2),
            ncol=2,
            fontsize=8,
        )
        return _png(fig)


def series_chart(
    ks: list[str],
    attack: list[float],
    attack_std: list[float],
    baseline: list[float],
    baseline_std: list[float],
    baseline_label: str,
    x_label: str,
    y_label: str,
) -> bytes:
    """An attack's metric against a numeric parameter (fine-tune's accuracy against the labelled
    samples per class), with its baseline; the y axis spans [0, 1] for a metric that lives there."""
    with plt.rc_context(STYLE):
        fig, ax = _subplots(5, 2.8)
        x = [float(k) for k in ks]
        ax.errorbar(
            x,
            attack,
            yerr=_finite(attack_std),
            marker="o",
            color=ATTACK_COLOR,
            label="attack (frozen bottom model)",
            capsize=3,
        )
        if baseline:
            ax.errorbar(
                x,
                baseline,
                yerr=_finite(baseline_std),
                marker="s",
                color=BASELINE_COLOR,
                label=chart_text(baseline_label),
                capsize=3,
            )
        if len(x) > 1 and min(x) > 0 and max(x) / min(x) >= 10:
            ax.set_xscale("log")
        ax.set_xticks(x, [chart_text(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel(chart_text(x_label))
        ax.set_ylabel(chart_text(y_label))
        if all(0 <= v <= 1 for v in attack + baseline):
            ax.set_ylim(0, 1.02)
        ax.legend(frameon=False, fontsize=8)
        return _png(fig)


def _finite(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else 0.0 for v in values]


def reconstructions_chart(examples: list[dict], input_kind: str) -> bytes:
    """Originals next to reconstructions: images of the image kind (report.json's
    `data.input_kind`) that imshow can show (1 or 3 channels), feature profiles otherwise."""
    with plt.rc_context(STYLE):
        if input_kind == "image" and all(
            _as_image(np.asarray(e["original"], dtype=float)) is not None for e in examples
        ):
            return _png(_image_grid(examples))
        return _png(_feature_profiles(examples))


def _as_image(array: np.ndarray) -> np.ndarray | None:
    """A C x H x W image as H x W (x 3) in [0, 1] for imshow, or None when imshow cannot show it
    (other channel counts, or a report whose example does not have the image's three axes)."""
    if array.ndim != 3 or array.shape[0] not in (1, 3):
        return None
    return np.clip(array[0] if array.shape[0] == 1 else array.transpose(1, 2, 0), 0, 1)


def _image_grid(examples: list[dict]):
    """One mosaic (originals on top, reconstructions below) drawn on a single axes: fast to render."""
    fig, ax = _subplots(1.5 * len(examples) + 0.6, 3.4)
    images = [[_as_image(np.asarray(e[key], dtype=float)) for e in examples] for key in ("original", "reconstruction")]
    height, width = images[0][0].shape[:2]
    gap = max(1, width // 8)
    color = images[0][0].ndim == 3
    mosaic = np.ones((2 * height + gap, len(examples) * (width + gap) - gap) + ((3,) if color else ()))
    for row, line in enumerate(images):
        for col, image in enumerate(line):
            top, left = row * (height + gap), col * (width + gap)
            mosaic[top : top + height, left : left + width] = image
    ax.imshow(mosaic, cmap=None if color else "gray", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(
        [(width + gap) * i + width / 2 - 0.5 for i in range(len(examples))],
        [f"{chart_text(e.get('label', ''))}\nMSE {e.get('mse', float('nan')):.3g}" for e in examples],
    )
    ax.xaxis.tick_top()
    ax.set_yticks(
        [height / 2 - 0.5, height + gap + height / 2 - 0.5], ["original", "reconstructed"], rotation=90, va="center"
    )
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return fig


def _feature_profiles(examples: list[dict]):
    fig, axes = _subplots(2.6 * len(examples), 2.4, ncols=len(examples), squeeze=False, sharey=True)
    for ax, example in zip(axes[0], examples):
        original = np.ravel(np.asarray(example["original"], dtype=float))
        ax.plot(original, color="black", linewidth=1, label="original")
        ax.plot(
            np.ravel(np.asarray(example["reconstruction"], dtype=float)),
            color=ATTACK_COLOR,
            linewidth=1,
            linestyle="--",
            label="reconstructed",
        )
        ax.set_title(f"{chart_text(example.get('label', ''))}: MSE {example.get('mse', float('nan')):.3g}", fontsize=9)
        ax.set_xlabel("feature")
    axes[0][0].legend(frameon=False, fontsize=7)
    fig.tight_layout()
    return fig


def advantage_comparison_chart(names: list[str], before: list[float], after: list[float]) -> bytes:
    """Each attack's advantage before and after, side by side."""
    with plt.rc_context(STYLE):
        fig, ax = _subplots(6, 0.5 * len(names) + 1.2)
        rows = np.arange(len(names))
        ax.barh(rows - 0.18, _finite(before), height=0.36, color=BASELINE_COLOR, label="before")
        ax.barh(rows + 0.18, _finite(after), height=0.36, color=ATTACK_COLOR, label="after")
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_yticks(rows, [chart_text(n) for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("advantage over the baseline (lower = better protected)")
        ax.legend(frameon=False, fontsize=8)
        return _png(fig)


@dataclass
class SweepSeries:
    """One line of a sweep chart: a value (and its std) per audited sigma; None where absent."""

    label: str
    values: list[float | None]
    std: list[float] | None = None


UTILITY_COLOR, TARGET_COLOR = "#1a202c", "#dd6b20"
SERIES_MARKERS = "osD^vP*X"


def _sigma_axis(ax, sigmas: list[float]) -> list[float]:
    """A log sigma axis with a tick at each audited sigma; sigma = 0 is drawn a third of the
    smallest positive sigma to its left and labelled 0. Returns the x positions."""
    positive = [s for s in sigmas if s > 0] or [1.0]
    zero = min(positive) / 3
    positions = [s if s > 0 else zero for s in sigmas]
    ax.set_xscale("log")
    ax.set_xticks(positions, [f"{s:.3g}" for s in sigmas], rotation=45)
    ax.minorticks_off()
    ax.set_xlabel("embedding noise σ (log scale; σ = 0 at the left)")
    return positions


def _plot_series(ax, x: list[float], series: SweepSeries, marker: str, color=None, positive_only=False) -> None:
    keep = [
        i for i, v in enumerate(series.values) if v is not None and math.isfinite(v) and (v > 0 or not positive_only)
    ]
    if not keep:
        return
    std = [
        series.std[i] if series.std and series.std[i] is not None and math.isfinite(series.std[i]) else 0.0
        for i in keep
    ]
    ax.errorbar(
        [x[i] for i in keep],
        [series.values[i] for i in keep],
        yerr=std if any(std) else None,
        marker=marker,
        color=color,
        label=chart_text(series.label),
        capsize=3,
        linewidth=1.2,
        markersize=4,
    )


def sweep_mse_chart(
    sigmas: list[float],
    bounds: list[tuple[SweepSeries, str]],
    attacks: list[SweepSeries],
    mean_guess: float | None,
    target: float | None,
) -> bytes:
    """The bounds (each with its colour) and every reconstruction attack's MSE against sigma,
    log-log, with the mean-guess MSE (what no information gives) and the target bound as
    horizontal lines."""
    with plt.rc_context(STYLE):
        fig, ax = _subplots(6.5, 3.6)
        x = _sigma_axis(ax, sigmas)
        for series, color in bounds:
            _plot_series(ax, x, series, "s", color, positive_only=True)
        for series, marker in zip(attacks, SERIES_MARKERS):
            _plot_series(ax, x, series, marker, positive_only=True)
        ax.set_yscale("log")
        if mean_guess is not None and math.isfinite(mean_guess) and mean_guess > 0:
            ax.axhline(mean_guess, color="black", linestyle=":", label=f"guessing the average input: {mean_guess:.3g}")
        if target is not None and math.isfinite(target) and target > 0:
            ax.axhline(target, color=TARGET_COLOR, linestyle="--", linewidth=1, label=f"target bound: {target:.3g}")
        ax.set_ylabel("reconstruction MSE per dimension")
        ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
        return _png(fig)


def sweep_utility_chart(sigmas: list[float], advantages: list[SweepSeries], utility: SweepSeries | None) -> bytes:
    """Each label attack's advantage (left axis) and the task accuracy (right axis) against sigma."""
    with plt.rc_context(STYLE):
        fig, ax = _subplots(6.5, 3.4)
        x = _sigma_axis(ax, sigmas)
        for series, marker in zip(advantages, SERIES_MARKERS):
            _plot_series(ax, x, series, marker)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_ylabel("label-attack advantage (0 = no leak)")
        handles, labels = ax.get_legend_handles_labels()
        if utility is not None:
            right = ax.twinx()
            right.spines["right"].set_visible(True)
            _plot_series(right, x, utility, "o", UTILITY_COLOR)
            right.set_ylabel("task accuracy (utility)")
            right.set_ylim(0, 1.02)
            more_handles, more_labels = right.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        ax.legend(handles, labels, frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.12, 1))
        return _png(fig)
