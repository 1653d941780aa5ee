"""splitaudit: audit what a split-learning bottom model's embeddings leak."""

from splitaudit.core.version import __version__

__all__ = ["__version__", "audit", "AuditResult"]


def __getattr__(name: str):
    """`splitaudit.audit` and `splitaudit.AuditResult`, imported on first use so that
    `import splitaudit` (and `splitaudit --help`) stays light: no torch until an audit runs."""
    if name in ("audit", "AuditResult"):
        from splitaudit import api

        return getattr(api, name)
    raise AttributeError(f"module 'splitaudit' has no attribute {name!r}")
