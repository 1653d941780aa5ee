"""Load auxiliary data (.npz, image folder, CSV) into one `Dataset`, and split it.

Every loader checks what a model will need (shape, finite values, non-empty) and raises
InputError with a one-line reason otherwise.
"""

from __future__ import annotations

import csv
import warnings
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from splitaudit.core.errors import InputError
from splitaudit.core.safety import (
    describe_bytes,
    display_path,
    memory_limit_bytes,
    memory_limit_source,
    require_regular_file,
)

MIN_PART_SAMPLES = 4  # attacks and estimators need a few samples in each of the aux and target parts
MAX_COMPRESSION_RATIO = 500  # deflate peaks near 1032:1 on constant bytes; real data is far below
REAL_KINDS = "biuf"  # numpy dtype kinds an input may hold: bool, integers, floats (no complex)
# The range of values the audit's float32 arithmetic carries honestly: a squared error of data spanning
# less than MIN_DATA_RANGE nears float32's smallest normal number (1.2e-38) and reads as 0; the
# squares of values beyond MAX_DATA_MAGNITUDE, summed over a sample, near its largest (3.4e38).
MIN_DATA_RANGE, MAX_DATA_MAGNITUDE = 1e-15, 1e15
IMAGE_CHANNELS = {1: "L", 3: "RGB"}  # image-folder channels, and the PIL mode each is read in
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
MAX_IMAGE_PIXELS = 89_478_485  # PIL's decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): 1 GiB as 32-bit pixels


@dataclass
class Dataset:
    """Inputs in the audit's space, with optional labels and a sensitive attribute."""

    x: torch.Tensor
    y: torch.Tensor | None = None
    attr: torch.Tensor | None = None
    class_names: list[str] | None = None
    source: str = ""
    token_ids: torch.Tensor | None = None  # token inputs (--vocab): the ids [N, T] whose embeddings x holds
    mask: torch.Tensor | None = None  # token inputs: the attention mask [N, T] (bool, True = real token)
    notes: list[str] = field(default_factory=list)  # what loading did to the data that the report should say
    text: dict | None = None  # raw text (.txt/.jsonl): how it was tokenised, truncated and padded (text_data.py)

    def __len__(self) -> int:
        return len(self.x)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def num_classes(self) -> int | None:
        return None if self.y is None else int(self.y.max()) + 1

    def subset(self, index: torch.Tensor | slice) -> "Dataset":
        pick = lambda t: None if t is None else t[index]
        return replace(
            self,
            x=self.x[index],
            y=pick(self.y),
            attr=pick(self.attr),
            token_ids=pick(self.token_ids),
            mask=pick(self.mask),
        )

    def to(self, device) -> "Dataset":
        move = lambda t: None if t is None else t.to(device)
        return replace(
            self,
            x=self.x.to(device),
            y=move(self.y),
            attr=move(self.attr),
            token_ids=move(self.token_ids),
            mask=move(self.mask),
        )


def in_unit_range(x: torch.Tensor) -> bool:
    """Whether every value lies in [0, 1]: the value range the input space records (pixel-like data,
    where decoders squash and attacks clamp; splitaudit.core.input_space)."""
    return bool(x.min() >= 0 and x.max() <= 1)


def load_dataset(
    path: "str | Path | Dataset",
    input_shape: tuple[int, ...] | None = None,
    label_column: str | None = None,
    attr_column: str | None = None,
) -> Dataset:
    """Load .npz, CSV or an image folder; reshape/resize to input_shape when it is known.
    A Dataset already in memory (the Python API) gets the same checks."""
    if isinstance(path, Dataset):
        return _validated(path, input_shape)
    path = Path(path)
    if not path.exists():
        raise InputError(f"data path not found: {path}")
    if path.is_dir():
        data = _load_folder(path, input_shape, label_column, attr_column)
    else:
        data = _load_file(require_regular_file(path, "data file"), label_column, attr_column)
    return _validated(data, input_shape)


def _load_file(path: Path, label_column, attr_column) -> Dataset:
    if path.suffix.lower() == ".npz":
        return _load_npz(path)
    if path.suffix.lower() in {".csv", ".tsv"}:
        return _load_csv(path, label_column, attr_column)
    raise InputError(f"unsupported data file {path}: use .npz, .csv or a folder of class_name/*.png images")


def _load_folder(path: Path, input_shape, label_column, attr_column) -> Dataset:
    """A folder of class subfolders is an image folder; otherwise it must hold one .npz or .csv."""
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    if not entries:
        raise InputError(f"data folder is empty: {path}")
    if any(p.is_dir() for p in entries):
        return _load_image_folder(path, input_shape)
    tables = [p for p in entries if p.suffix.lower() in {".npz", ".csv", ".tsv"}]
    if len(tables) != 1:
        raise InputError(
            f"data folder {path} must hold class subfolders of images, or exactly one .npz/.csv file (found {len(tables)})"
        )
    return _load_file(require_regular_file(tables[0], "data file"), label_column, attr_column)


def _load_npz(path: Path) -> Dataset:
    if not zipfile.is_zipfile(path):
        raise InputError(f"{display_path(path)} is not an .npz file (not a zip archive); save it with numpy.savez")
    check_npz_sizes(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        reason = "it holds object arrays, which splitaudit never unpickles" if "pickle" in str(exc) else exc
        raise InputError(f"cannot read {display_path(path)} as .npz ({reason}); it must hold numeric arrays") from exc
    if "x" not in arrays:
        raise InputError(f"{path} has no array 'x' (found: {', '.join(arrays) or 'nothing'})")
    x = _real(arrays["x"], path)
    y, names = _labels(arrays.get("y"), "y", len(x), path)
    attr, _ = _labels(arrays.get("attr"), "attr", len(x), path)
    return Dataset(x=torch.as_tensor(x, dtype=torch.float32), y=y, attr=attr, class_names=names, source=str(path))


def check_npz_sizes(path: Path, limit: int | None = None) -> None:
    """Refuse an .npz whose members declare more than `limit` bytes in total (zip headers and .npy
    headers both), or that expand more than MAX_COMPRESSION_RATIO times: a zip bomb must fail on
    its declared sizes, before a byte of it is decompressed."""
    limit = memory_limit_bytes() if limit is None else limit
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            declared = sum(m.file_size for m in members)
            compressed = sum(m.compress_size for m in members)
            arrays = sum(_npy_declared_bytes(archive, m) for m in members)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InputError(f"cannot read {display_path(path)} as .npz ({exc})") from exc
    if max(declared, arrays) > limit:
        raise InputError(
            f"{display_path(path)} declares {describe_bytes(max(declared, arrays))} of arrays; "
            f"splitaudit loads at most {describe_bytes(limit)} ({memory_limit_source()})"
        )
    if declared > 64 * 1024**2 and declared > MAX_COMPRESSION_RATIO * max(compressed, 1):
        raise InputError(
            f"{display_path(path)} expands {declared / max(compressed, 1):.0f} times (over "
            f"{MAX_COMPRESSION_RATIO}): a zip bomb, or data too repetitive to audit"
        )


def _npy_declared_bytes(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> int:
    """The array size an .npy member's header declares (shape x itemsize), reading the header only."""
    with archive.open(member) as handle:
        try:
            version = np.lib.format.read_magic(handle)
            shape, _, dtype = (
                np.lib.format.read_array_header_1_0(handle)
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0(handle)
            )
        except ValueError:
            return 0  # not an .npy member: np.load reports it
    return int(np.prod(shape, dtype=object)) * dtype.itemsize


def _load_csv(path: Path, label_column: str | None, attr_column: str | None) -> Dataset:
    rows = _csv_rows(path)
    if len(rows) < 2:
        raise InputError(f"{path} has no data rows (a header line and at least one row are needed)")
    header, body = [h.strip() for h in rows[0]], rows[1:]
    duplicates = sorted({h for h in header if header.count(h) > 1})
    if duplicates:
        raise InputError(
            f"{path} has duplicate column names ({', '.join(repr(d) for d in duplicates)}); "
            "every column needs its own name"
        )
    for name, flag in ((label_column, "--label-column"), (attr_column, "--attr-column")):
        if name is not None and name not in header:
            raise InputError(f"{flag} {name!r} is not a column of {path} (columns: {', '.join(header)})")
    columns = {h: [r[i].strip() if i < len(r) else "" for r in body] for i, h in enumerate(header)}
    y, names = _labels(_column(columns, label_column), label_column, len(body), path)
    attr, _ = _labels(_column(columns, attr_column), attr_column, len(body), path)
    features = [h for h in header if h not in {label_column, attr_column}]
    if not features:
        raise InputError(f"{path} has no feature columns besides the label and attribute")
    try:
        x = np.array([[float(columns[h][i]) for h in features] for i in range(len(body))], dtype=np.float32)
    except ValueError as exc:
        raise InputError(
            f"{path}: every feature column must be numeric ({exc}); name label/attribute columns with --label-column/--attr-column"
        ) from exc
    return Dataset(x=torch.from_numpy(x), y=y, attr=attr, class_names=names, source=str(path))


def _csv_rows(path: Path) -> list[list[str]]:
    """The rows of a UTF-8 CSV/TSV file; a byte-order mark (as Excel writes) is dropped, not read
    as part of the first column's name."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return list(csv.reader(handle, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{display_path(path)} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8 CSV"
        ) from exc
    except csv.Error as exc:
        raise InputError(f"cannot read {display_path(path)} as CSV: {exc}") from exc


def _column(columns: dict, name: str | None) -> np.ndarray | None:
    return None if name is None else np.array(columns[name])


def _labels(values, name, n: int, path: Path) -> tuple[torch.Tensor | None, list[str] | None]:
    """Map any label values to 0..K-1 (sorted), keeping their names."""
    if values is None:
        return None, None
    values = np.asarray(values)
    if values.shape != (n,):
        raise InputError(f"{path}: {name!r} must hold one value per sample ({n}), got shape {values.shape}")
    if values.dtype.kind not in REAL_KINDS + "US":
        raise InputError(f"{path}: {name!r} must hold integer or text class labels, got {values.dtype}")
    if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
        raise InputError(f"{path}: {name!r} holds NaN or infinite values")
    if values.dtype.kind == "f" and not np.all(values == np.round(values)):
        raise InputError(
            f"{path}: {name!r} holds non-integer numbers (e.g. {values[values != np.round(values)][0]:g}); "
            "labels and attributes are classes: integers or text"
        )
    names, codes = np.unique(values, return_inverse=True)
    return torch.as_tensor(codes, dtype=torch.long), [str(v) for v in names]


def _load_image_folder(path: Path, input_shape) -> Dataset:
    """class_name/*.png|jpg, as torchvision's ImageFolder lays it out; scaled to [0, 1]. The memory
    the images take at the audit's size is checked before any image is decoded."""
    classes = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    files = _image_files(path, classes)
    if not files:
        raise InputError(f"no images found in {path}: expected class_name/*.png or *.jpg, or one .npz/.csv file")
    channels, size = _image_geometry(input_shape, files[0][0])
    mode = IMAGE_CHANNELS.get(channels)
    if mode is None:
        raise InputError(f"image folders need a model with 1 or 3 input channels, not {channels}")
    _check_image_memory(path, len(files), channels, size, input_shape is None)
    x = np.empty((len(files), channels, size[1], size[0]), dtype=np.float32)  # filled in place: one copy in memory
    for i, (file, _) in enumerate(files):
        x[i] = _decoded(file, mode, size).reshape(size[1], size[0], channels).transpose(2, 0, 1)
    y = torch.tensor([c for _, c in files], dtype=torch.long)
    return Dataset(x=torch.from_numpy(x).div_(255.0), y=y, class_names=classes, source=str(path))


def _image_files(path: Path, classes: list[str]) -> list[tuple[Path, int]]:
    """(file, class index) of every regular image file under path/class_name (no FIFOs or devices).
    A file reached through a symlink that leads out of the folder is refused: a data folder from
    elsewhere must not make the audit read, and show in its report, files the folder does not hold."""
    root = path.resolve()
    files = []
    for index, name in enumerate(classes):
        for file in sorted((path / name).rglob("*")):
            if file.suffix.lower() in IMAGE_SUFFIXES and file.is_file():
                target = file.resolve()
                if not target.is_relative_to(root):
                    raise InputError(
                        f"image {display_path(file)} leads out of the data folder {display_path(path)} (a symlink to "
                        f"{display_path(target)}); splitaudit reads only images inside it: copy the file in"
                    )
                files.append((file, index))
    return files


def _check_image_memory(path: Path, count: int, channels: int, size: tuple[int, int], from_first: bool) -> None:
    """Refuse, before decoding, images whose float32 array at the audit's size would exceed the memory limit."""
    needed = count * channels * size[0] * size[1] * 4
    limit = memory_limit_bytes()
    if needed > limit:
        origin, remedy = (
            (
                "the first image's size (the model declares none)",
                "pass --input-shape C,H,W to resize them, or use fewer images",
            )
            if from_first
            else ("the model's input size", "use fewer images")
        )
        raise InputError(
            f"the {count} images in {display_path(path)} take {describe_bytes(needed)} as float32 at "
            f"{channels}x{size[1]}x{size[0]}, {origin}; splitaudit loads at most {describe_bytes(limit)} "
            f"({memory_limit_source()}): {remedy}"
        )


def _decoded(file: Path, mode: str, size: tuple[int, int]) -> np.ndarray:
    """One image in PIL `mode`, resized to `size` (width, height): float32 values 0..255, H x W (x C)."""
    from PIL import Image

    with _opened_image(file) as img:
        return np.asarray(img.convert(mode).resize(size, Image.BILINEAR), dtype=np.float32)


@contextmanager
def _opened_image(file: Path):
    """The image at `file` with its header read and nothing decoded; refused when it has more pixels than
    MAX_IMAGE_PIXELS (a decompression bomb: a few KB on disk, GBs decoded). Any read error is an InputError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked below, with our own words
            img = Image.open(file)
        with img:
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InputError(
                    f"image {display_path(file)} is {width}x{height} pixels, over the {MAX_IMAGE_PIXELS} pixels "
                    "splitaudit decodes (a decompression bomb, or an image to shrink first)"
                )
            yield img
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise InputError(f"cannot read image {display_path(file)}: {exc}") from exc


def _image_geometry(input_shape, first_image: Path) -> tuple[int, tuple[int, int]]:
    """(channels, (width, height)) from the model's input shape (channels first: a channels-last
    model's shape is turned round before, raw_model.audit_layout), else from the first image."""
    if input_shape is not None:
        if len(input_shape) != 3:
            raise InputError(f"an image folder needs a model input of shape C,H,W, not {input_shape}")
        return input_shape[0], (input_shape[2], input_shape[1])
    with _opened_image(first_image) as img:
        return (1 if img.mode in {"1", "L", "I", "F"} else 3), img.size


def _validated(data: Dataset, input_shape) -> Dataset:
    if len(data) < MIN_PART_SAMPLES:
        raise InputError(f"{data.source} holds {len(data)} samples; an audit needs at least {MIN_PART_SAMPLES}")
    if not torch.isfinite(data.x).all():
        raise InputError(f"{data.source} holds NaN or infinite values in 'x'; clean or impute them first")
    if len(data) > 1 and bool((data.x == data.x[:1]).all()):
        raise InputError(
            f"{data.source}: every sample of 'x' is the same (constant data): nothing to reconstruct or classify"
        )
    _check_scale(data)
    return data if input_shape is None else _conformed(data, tuple(input_shape))


def _real(x: np.ndarray, source) -> np.ndarray:
    """x, or InputError when it holds complex (or other non-real) values: float32 would keep their real part."""
    if x.dtype.kind not in REAL_KINDS:
        raise InputError(f"{source}: 'x' must hold real numbers (bool, integer or float), got {x.dtype}")
    return x


def _check_scale(data: Dataset) -> None:
    """InputError when the values of 'x' span less than MIN_DATA_RANGE or reach beyond
    MAX_DATA_MAGNITUDE: the MSEs, variances and prior terms computed from them would underflow to 0
    or overflow to inf in float32, and a bound from them would be void."""
    low, high = float(data.x.min()), float(data.x.max())
    if high - low < MIN_DATA_RANGE:
        raise InputError(
            f"{data.source}: the values of 'x' span only {high - low:.3g} ({low:.3g} to {high:.3g}); below "
            f"{MIN_DATA_RANGE:.0e} their squared errors underflow float32, so MSEs and bounds would read 0: rescale "
            "the data (and the model's input with it)"
        )
    if max(-low, high) > MAX_DATA_MAGNITUDE:
        raise InputError(
            f"{data.source}: the values of 'x' reach {max(-low, high):.3g} in magnitude; beyond {MAX_DATA_MAGNITUDE:.0e} "
            "their squared errors overflow float32: rescale the data (and the model's input with it)"
        )


def _conformed(data: Dataset, wanted: tuple[int, ...]) -> Dataset:
    """The data in the model's input shape. A reshape keeps every sample's values in order, so it is
    used only where the shapes differ by flattening (one side 1-D) or by dimensions of size 1. Where
    the channels (or a sequence's features) sit at the other end, first against last (a tf2onnx
    graph's H,W,C against C,H,W images), they are moved, and the report says so. Any other
    rearrangement is refused: a reshape would silently scramble every sample."""
    shape = data.sample_shape
    if shape == wanted:
        return data
    if int(np.prod(shape)) != int(np.prod(wanted)):
        raise InputError(
            f"data samples have shape {shape} but the model expects {wanted}; "
            "pass --input-shape or data of the model's input shape"
        )
    squeezed = lambda dims: tuple(d for d in dims if d != 1)
    if len(shape) == 1 or len(wanted) == 1 or squeezed(shape) == squeezed(wanted):
        return replace(data, x=data.x.reshape(len(data), *wanted))
    last, first = (*range(1, len(shape)), 0), (len(shape) - 1, *range(len(shape) - 1))
    for order, moved in ((last, "first to last"), (first, "last to first")):
        if tuple(shape[i] for i in order) == wanted:
            note = (
                f"the data's samples ({'x'.join(map(str, shape))}) were rearranged to {'x'.join(map(str, wanted))}, "
                f"the shape the audit works in: channels moved from {moved} (MSEs are per value, so unchanged)"
            )
            x = data.x.permute(0, *(i + 1 for i in order)).contiguous()
            return replace(data, x=x, notes=[*data.notes, note])
    raise InputError(
        f"data samples have shape {shape} and the model expects {wanted}: the same values in another "
        "arrangement, which a reshape would scramble; save the data in the model's layout"
    )


def split_dataset(data: Dataset, target_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Seeded split into (attacker's auxiliary part, held-out target part)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(data), generator=gen)
    n_target = int(round(target_fraction * len(data)))
    if min(n_target, len(data) - n_target) < MIN_PART_SAMPLES:
        raise InputError(
            f"{data.source} has {len(data)} samples: too few to split into aux and target parts "
            f"of at least {MIN_PART_SAMPLES} samples each"
        )
    return data.subset(perm[n_target:]), data.subset(perm[:n_target])


def dataset_from_arrays(x, y=None, attr=None, source: str = "<in-memory arrays>", mask=None) -> Dataset:
    """Arrays or tensors (the Python API) as a Dataset, with labels mapped as the file loaders map them;
    a token attention mask is kept as given (tokens.load_token_data checks it)."""
    x = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)
    if not np.issubdtype(x.dtype, np.number) or x.ndim < 2:
        raise InputError(f"{source}: x must be a numeric array of samples (N, ...), got {x.dtype} of shape {x.shape}")
    x = _real(x, source)
    as_numpy = lambda v: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
    labels, names = _labels(as_numpy(y), "y", len(x), Path(source))
    attrs, _ = _labels(as_numpy(attr), "attr", len(x), Path(source))
    kept_mask = None if mask is None else torch.as_tensor(np.asarray(as_numpy(mask)))
    return Dataset(
        x=torch.as_tensor(x, dtype=torch.float32),
        y=labels,
        attr=attrs,
        class_names=names,
        source=source,
        mask=kept_mask,
    )
