"""report.html in real headless Chromium: no console messages, no network requests, the summary on screen.

Skipped (with the reason) when Debian's chromium is not installed; .ci/run installs it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from splitaudit.reports import load_result, write_reports

pytestmark = pytest.mark.browser

FIXTURES = Path(__file__).parent / "fixtures"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
INTERNAL = "not an origin"  # initiator of the browser's own requests (updates, accounts), not the page's

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium not installed (apt-get install chromium); the browser checks of report.html are skipped",
)


def chromium(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def load(page: Path, tmp_path: Path) -> tuple[str, list[str], list[str]]:
    """The DOM after load, the console messages, and the URLs the page requested."""
    net_log = tmp_path / "net.json"
    done = chromium(page, tmp_path, "--dump-dom", "--enable-logging=stderr", "--v=0", f"--log-net-log={net_log}")
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    log = json.loads(net_log.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    jobs = [e.get("params", {}) for e in log["events"] if e["type"] == start_job]
    requests = [job["url"] for job in jobs if "url" in job and job.get("initiator") != INTERNAL]
    return done.stdout, console, requests


@needs_chromium
def test_the_checks_detect_console_messages_and_requests(tmp_path):
    page = tmp_path / "canary.html"
    page.write_text('<!doctype html><img src="http://192.0.2.1/x.png"><script>console.error("boom")</script>')
    _, console, requests = load(page, tmp_path)
    assert any("boom" in line for line in console)
    assert requests == ["http://192.0.2.1/x.png"]


@needs_chromium
@pytest.mark.parametrize("name", ["blackbox_audit", "failed_attack_audit"])
def test_report_loads_without_console_messages_or_network(tmp_path, name):
    write_reports(load_result(FIXTURES / f"{name}.json"), tmp_path, ["html"])
    dom, console, requests = load(tmp_path / "report.html", tmp_path)
    assert console == []
    assert requests == []
    assert '<header class="verdict fail">' in dom
    assert not re.search(r"<img src=\"?x", dom)  # the malicious class name stayed text


@needs_chromium
def test_first_screen_shows_the_summary(tmp_path):
    write_reports(load_result(FIXTURES / "failed_attack_audit.json"), tmp_path, ["html"])
    shot = tmp_path / "first-screen.png"
    chromium(
        tmp_path / "report.html",
        tmp_path,
        f"--screenshot={shot}",
        "--window-size=1280,900",
        "--virtual-time-budget=2000",
    )
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[:2] == (900, 1280) and pixels.std() > 10
    top = pixels[:300]
    red_border = np.all(np.abs(top - [0xC5, 0x30, 0x30]) < 12, axis=-1)
    assert red_border.sum() > 2000  # the failed verdict's banner and the incomplete-audit alert
    summary_cards = np.all(np.abs(pixels - [0xF7, 0xFA, 0xFC]) < 3, axis=-1)
    assert summary_cards[250:700].sum() > 20000  # the summary cards are on the first screen
