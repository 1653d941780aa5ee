"""splitaudit: audit what a split-learning bottom model's embeddings leak."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("splitaudit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"


def __getattr__(name: str):
    """`splitaudit.audit` and `splitaudit.AuditResult`, imported on first use so that
    `import splitaudit` (and `splitaudit --help`) stays light: no torch until an audit runs."""
    if name in ("audit", "AuditResult"):
        from splitaudit import api

        return getattr(api, name)
    raise AttributeError(f"module 'splitaudit' has no attribute {name!r}")
