"""Reconstruction metrics shared by the reconstruction attacks (decoder, optimization, sdar).

Every MSE is per dimension, `||x_hat - x||^2 / d`, in the data space the bounds use (a
--normalize is folded into the encoder, so x is already that space): the quantity the
Cramér-Rao and van Trees bounds of Maeng et al. (NeurIPS 2023) bound, and the MSE that SDAR (Zhu et al., NDSS 2025) reports.
PSNR and the metrics that fit the input space (SSIM on images) follow, and the best, median and
worst reconstructions are kept as JSON-ready examples for the report.
"""

from __future__ import annotations

import torch
from pytorch_msssim import ssim

from splitaudit.core.input_space import InputSpace

SSIM_MAX_WINDOW = 11  # the usual Gaussian window (sigma 1.5); smaller images get a smaller odd one
MIN_MSE_FOR_PSNR = 1e-10  # a perfect reconstruction reports 100 dB for range 1 instead of infinity
EXAMPLE_DECIMALS = 4


def per_sample_mse(x_true: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Per-dimension squared error of each sample: Tensor[N]."""
    return (x_hat.detach().float() - x_true.detach().float()).flatten(1).pow(2).mean(dim=1)


def data_range(x: torch.Tensor, unit_range: bool) -> float:
    """1 for an input space in [0, 1] (pixels); otherwise x's value range (max - min), or 1 if constant."""
    if unit_range:
        return 1.0
    low, high = float(x.min()), float(x.max())
    return high - low if high > low else 1.0


def ssim_window(height: int, width: int) -> int:
    """The largest odd window <= min(H, W), capped at 11 (an 8x8 digit gets 7)."""
    size = min(SSIM_MAX_WINDOW, height, width)
    return size if size % 2 == 1 else size - 1


def reconstruction_metrics(x_true: torch.Tensor, x_hat: torch.Tensor, space: InputSpace) -> dict:
    """{"mse", "psnr", and "ssim" where it fits the space (images)}, each the mean over samples.

    PSNR = 10 log10(R^2 / mse) per sample with R = `data_range(x_true, space.unit_range)`; SSIM uses
    pytorch-msssim with a Gaussian window that fits the image (`ssim_window`).
    """
    x_true, x_hat = x_true.detach().float(), x_hat.detach().float().to(x_true.device)
    errors = per_sample_mse(x_true, x_hat)
    value_range = data_range(x_true, space.unit_range)
    psnr = 10 * torch.log10(value_range**2 / errors.clamp_min(MIN_MSE_FOR_PSNR))
    metrics = {"mse": float(errors.mean()), "psnr": float(psnr.mean())}
    if "ssim" in space.metrics:
        window = ssim_window(*x_true.shape[-2:])
        metrics["ssim"] = float(ssim(x_hat, x_true, data_range=value_range, win_size=window))
    return metrics


def mean_guess_baseline(aux_x: torch.Tensor, target_x: torch.Tensor, space: InputSpace) -> dict:
    """The metrics of predicting the aux mean for every target: what the prior alone gives."""
    guess = aux_x.detach().float().mean(dim=0, keepdim=True).to(target_x.device)
    return reconstruction_metrics(target_x, guess.expand_as(target_x), space)


def reconstruction_examples(
    x_true: torch.Tensor, x_hat: torch.Tensor, target_indices: torch.Tensor | None = None
) -> list[dict]:
    """The best, median and worst reconstructions (by per-sample MSE), JSON-ready for the report.

    target_indices: the target-set index of each row (when the rows are a subsample).
    """
    errors = per_sample_mse(x_true, x_hat).cpu()
    order = torch.argsort(errors)
    picks = {"best": order[0], "median": order[len(order) // 2], "worst": order[-1]}
    indices = torch.arange(len(errors)) if target_indices is None else target_indices.cpu()
    return [
        {
            "label": label,
            "index": int(indices[row]),
            "mse": float(errors[row]),
            "shape": list(x_true.shape[1:]),
            "original": _rounded(x_true[row]),
            "reconstruction": _rounded(x_hat[row]),
        }
        for label, row in picks.items()
    ]


def _rounded(x: torch.Tensor) -> list:
    return torch.round(x.detach().double().cpu(), decimals=EXAMPLE_DECIMALS).tolist()
