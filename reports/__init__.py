"""Rendering: every output is made from the result object alone (report.json's content)."""

from splitaudit.reports.compare import write_comparison
from splitaudit.reports.junit import write_junit
from splitaudit.reports.terminal import terminal_summary
from splitaudit.reports.writer import load_result, write_reports

__all__ = ["load_result", "terminal_summary", "write_comparison", "write_junit", "write_reports"]
