"""The installed distribution's version: what report.json's `tool.version` and `--version` say."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("splitaudit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
