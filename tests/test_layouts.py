"""Data and model layouts: channels-last models (tf2onnx's NHWC graphs) are audited on channels-first
images, data is moved (never reshaped) between the two layouts, and a reshape that would scramble
samples is refused. The reference for embeddings is the exported torch module run on the data in
its own layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from splitaudit.core.config import AuditOptions
from splitaudit.core.errors import InputError
from splitaudit.engine.pipeline import prepare_context
from splitaudit.execution.recipe import make_recipe, rebuild_context
from splitaudit.inputs.data import load_dataset
from tests.support.exporter_graphs import STYLES, write_style

NHWC_STYLE = next(s for s in STYLES if s.name.startswith("tf2onnx NHWC"))  # NHWCNet on 16x16x3


def images(n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((n, 3, 16, 16)).astype(np.float32), rng.integers(0, 3, n)


def audit_options(model, aux, **extra) -> AuditOptions:
    return AuditOptions(model=str(model), aux=str(aux), quick=True, **extra).validate()


@torch.no_grad()
def check_channels_first_audit(ctx, module, expected_aux: torch.Tensor) -> None:
    """The audit holds C,H,W images, the file's values, and embeds them as the module does on H,W,C."""
    assert ctx.aux.sample_shape == (3, 16, 16)
    assert torch.equal(ctx.aux.x, expected_aux)
    assert any("channels-last images (16x16x3)" in note for note in ctx.encoder.warnings)
    for _ in range(2):
        embedded = ctx.encoder.embed(ctx.aux.x)
        assert torch.allclose(embedded, module(ctx.aux.x.permute(0, 2, 3, 1)), atol=1e-5)


@pytest.mark.parametrize("layout", ["channels first", "channels last"])
def test_channels_last_onnx_model_is_audited_on_channels_first_images(tmp_path, layout):
    """Before, channels-first data was reshaped (not transposed) into the model's 16x16x3: every
    sample scrambled, silently; and channels-last data was audited with H read as channels."""
    path, module = write_style(NHWC_STYLE, tmp_path)
    x, y = images()
    stored = x if layout == "channels first" else x.transpose(0, 2, 3, 1)
    np.savez(tmp_path / "data.npz", x=stored, y=y)
    options = audit_options(path, tmp_path / "data.npz", target_fraction=0.5)
    ctx = prepare_context(options)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # split_dataset's split
    check_channels_first_audit(ctx, module, torch.from_numpy(x)[order[len(x) // 2 :]])
    moved = [note for note in ctx.encoder.warnings if "rearranged" in note]
    assert len(moved) == (layout == "channels last")
    worker = rebuild_context(make_recipe(options, ctx), "cpu")  # the context as a worker process opens it
    check_channels_first_audit(worker, module, ctx.aux.x)


def test_channels_last_model_reads_an_image_folder(tmp_path):
    """An image folder is read channels first; before, the model's 16x16x3 was read as 16 channels."""
    path, module = write_style(NHWC_STYLE, tmp_path)
    x, y = images(12)
    for i, (image, label) in enumerate(zip(x, y)):
        folder = tmp_path / "images" / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image.transpose(1, 2, 0) * 255).astype(np.uint8)).save(folder / f"{i}.png")
    ctx = prepare_context(audit_options(path, tmp_path / "images"))
    assert ctx.aux.sample_shape == (3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(ctx.encoder.embed(ctx.aux.x), module(ctx.aux.x.permute(0, 2, 3, 1)), atol=1e-5)


def test_data_in_another_arrangement_is_refused_not_reshaped(tmp_path):
    np.savez(tmp_path / "data.npz", x=np.random.rand(8, 2, 3, 5).astype(np.float32))
    with pytest.raises(InputError, match=r"shape \(2, 3, 5\) and the model expects \(3, 2, 5\).*scramble"):
        load_dataset(tmp_path / "data.npz", input_shape=(3, 2, 5))


def test_flat_rows_and_singleton_dims_still_reshape_in_order(tmp_path):
    x = np.random.rand(8, 64).astype(np.float32)
    np.savez(tmp_path / "flat.npz", x=x)
    assert torch.equal(
        load_dataset(tmp_path / "flat.npz", input_shape=(1, 8, 8)).x, torch.from_numpy(x).view(8, 1, 8, 8)
    )
    np.savez(tmp_path / "gray.npz", x=x.reshape(8, 8, 8, 1))
    assert torch.equal(
        load_dataset(tmp_path / "gray.npz", input_shape=(1, 8, 8)).x, torch.from_numpy(x).view(8, 1, 8, 8)
    )
