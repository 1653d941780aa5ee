"""splitaudit: audit what a split-learning bottom model's embeddings leak."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("splitaudit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
