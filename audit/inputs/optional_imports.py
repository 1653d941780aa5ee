"""Optional libraries that arrive with a broken torchvision: onnx2pytorch (ONNX conversion) and
Hugging Face `transformers` (checkpoint folders, the `splitaudit[hf]` extra).

PyPI's torchvision is a CUDA build whose extension cannot load next to a CPU-only torch
(`operator torchvision::nms does not exist`). Whether it loads is decided once, by trying it
(`import_torchvision_or_stub`); when it does not, a stub stands in for it, and both users are told:
onnx2pytorch imports the stub (its detection ops RoiAlign, NMS and DeformConv are then unavailable,
and a model using them runs black-box), and transformers is made to see torchvision as absent
(`import_transformers`), so that its image utilities, which it imports on every model class, are
never reached. No other splitaudit module imports transformers.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from contextlib import contextmanager
from typing import Iterator


def import_torchvision_or_stub() -> None:
    """Import torchvision, or put a stub in its place whose attributes fail when called."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]

    def unavailable(attr: str):
        if attr.startswith("__"):  # module metadata (__file__, __spec__...) stays absent
            raise AttributeError(attr)

        def fail(*_args, **_kwargs):
            raise RuntimeError(f"torchvision.{attr} is unavailable: torchvision does not load here")

        return fail

    for name in ("torchvision", "torchvision.ops", "torchvision.io"):
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() callers (torch.onnx) need one
        stub.__getattr__ = unavailable
        stub.__path__ = []
        sys.modules[name] = stub


def torchvision_is_stub() -> bool:
    """Whether the torchvision in this process is the stub (after import_torchvision_or_stub)."""
    return getattr(sys.modules.get("torchvision"), "__file__", None) is None


def import_transformers():
    """The transformers module, offline (HF_HUB_OFFLINE=1: nothing is ever downloaded), with
    torchvision seen as absent when it does not load here. ImportError naming the extra when it is
    not installed."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import_torchvision_or_stub()
    try:
        import transformers.utils.import_utils as availability
    except ImportError as exc:
        raise ImportError('Hugging Face checkpoints need the hf extra: pip install "splitaudit[hf]"') from exc
    if torchvision_is_stub():
        with torchvision_hidden():  # transformers 5 caches the answer; 4.x keeps it in a module constant
            if hasattr(availability.is_torchvision_available, "cache_clear"):
                availability.is_torchvision_available.cache_clear()
                availability.is_torchvision_available()
            if hasattr(availability, "_torchvision_available"):
                availability._torchvision_available = False
    import transformers

    transformers.logging.set_verbosity_error()  # its load-time advice would go to the terminal of every audit
    transformers.logging.disable_progress_bar()
    return transformers


@contextmanager
def torchvision_hidden() -> Iterator[None]:
    """torchvision absent for the block (find_spec finds nothing), its stub back afterwards."""
    saved = {n: m for n, m in sys.modules.items() if n == "torchvision" or n.startswith("torchvision.")}
    for name in saved:
        sys.modules[name] = None
    try:
        yield
    finally:
        sys.modules.update(saved)
