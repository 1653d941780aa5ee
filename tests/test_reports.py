"""Reports rendered from the session's real audit ("real") and from saved fixtures for the cases a
quick run cannot produce (black-box model, hostile strings, a crashed attack): content, escaping, structure."""

from __future__ import annotations

import math
import re
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from splitaudit import cli
from splitaudit.core.errors import InputError
from splitaudit.core.result import SCHEMA_VERSION
from splitaudit.reports import load_result, terminal_summary, write_comparison, write_junit, write_reports

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ["real", "image_audit", "sigma0_audit", "blackbox_audit", "tabular_audit", "failed_attack_audit"]
XSS = "<img src=x onerror=alert(1)>"


def fixture(name: str) -> dict:
    return load_result(FIXTURES / f"{name}.json")


class Outline(HTMLParser):
    """Headings in order, with the text and elements seen after each one; every img src."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[dict] = []
        self.images: list[str] = []
        self.links: list[str] = []
        self._in_heading = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("h2", "h3", "h4"):
            self.headings.append({"tag": tag, "title": "", "content": 0})
            self._in_heading = True
        elif self.headings and tag in ("table", "img", "ul", "p", "figure", "div"):
            self.headings[-1]["content"] += 1
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if "href" in attrs or "src" in attrs:
            self.links.append(attrs.get("href") or attrs.get("src"))

    def handle_endtag(self, tag):
        if tag in ("h2", "h3", "h4"):
            self._in_heading = False

    def handle_data(self, data):
        if self._in_heading:
            self.headings[-1]["title"] += data


def outline(html: str) -> Outline:
    parser = Outline()
    parser.feed(html)
    return parser


def empty_html_sections(html: str) -> list[str]:
    """Headings followed by nothing before a heading of the same or a higher level."""
    heads = outline(html).headings
    empty = []
    for i, head in enumerate(heads):
        nxt = heads[i + 1] if i + 1 < len(heads) else None
        has_child = nxt is not None and nxt["tag"] > head["tag"]
        if head["content"] == 0 and not has_child:
            empty.append(head["title"])
    return empty


def empty_markdown_sections(md: str) -> list[str]:
    heads = [
        (i, len(m.group(1)), m.group(2))
        for i, line in enumerate(md.splitlines())
        if (m := re.match(r"^(#+) (.*)", line))
    ]
    lines = md.splitlines()
    empty = []
    for n, (i, level, title) in enumerate(heads):
        end = heads[n + 1][0] if n + 1 < len(heads) else len(lines)
        body = "".join(lines[i + 1 : end]).strip()
        deeper = n + 1 < len(heads) and heads[n + 1][1] > level
        if not body and not deeper:
            empty.append(title)
    return empty


@pytest.fixture(scope="module")
def pages(tmp_path_factory, real_audit):
    """Each fixture rendered once for the whole module: name -> (folder, paths written)."""
    cache = {}

    def render_once(name: str) -> tuple[Path, list[Path]]:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            result = real_audit.data if name == "real" else fixture(name)
            cache[name] = out, write_reports(result, out, ["html", "md", "json"])
        return cache[name]

    return render_once


@pytest.fixture(params=NAMES)
def rendered(request, pages):
    return (request.param, *pages(request.param))


def test_every_fixture_renders_all_formats_without_empty_sections(rendered):
    name, out, paths = rendered
    assert [p.name for p in paths] == ["report.html", "report.md", "report.json"]  # report.json last
    html = (out / "report.html").read_text(encoding="utf-8")
    md = (out / "report.md").read_text(encoding="utf-8")
    assert empty_html_sections(html) == []
    assert empty_markdown_sections(md) == []
    assert "None" not in re.sub(r"<[^>]+>", "", html)


def test_html_is_self_contained(rendered):
    _, out, _ = rendered
    page = outline((out / "report.html").read_text(encoding="utf-8"))
    assert page.images and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert all(link.startswith(("data:", "#")) for link in page.links)


def test_markdown_images_are_files_next_to_it(rendered):
    _, out, _ = rendered
    md = (out / "report.md").read_text(encoding="utf-8")
    targets = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert targets and all((out / t).is_file() and (out / t).read_bytes()[:4] == b"\x89PNG" for t in targets)


def test_json_round_trips_non_finite_numbers(tmp_path):
    result = fixture("sigma0_audit")
    write_reports(result, tmp_path, ["json"])
    text = (tmp_path / "report.json").read_text()
    assert "Infinity" not in text and '"inf"' in text
    again = load_result(tmp_path / "report.json")
    assert math.isinf(again["dfil"]["mean"]) and again["attacks"] == result["attacks"]


def read_pages(out: Path) -> tuple[str, str]:
    return (out / "report.html").read_text(encoding="utf-8"), (out / "report.md").read_text(encoding="utf-8")


@pytest.fixture
def render(pages, tmp_path):
    """render(fixture name) from the module cache, or render(None, result) for a modified result."""

    def rendered_pages(name: str | None, result: dict | None = None) -> tuple[str, str]:
        if result is None:
            return read_pages(pages(name)[0])
        write_reports(result, tmp_path, ["html", "md"])
        return read_pages(tmp_path)

    return rendered_pages


def summary_text(html: str) -> str:
    """The plain text of the page up to the detailed sections."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html.split("<nav>")[0]))


def test_summary_states_the_bound_strongest_attack_and_noise(render):
    html, md = render("image_audit")
    summary = summary_text(html)
    assert "PASSED" in summary
    assert "No attacker can reconstruct inputs with a mean squared error below 0.0658" in summary
    assert "Sensitive-attribute inference: accuracy 0.94 against 0.5" in summary
    assert "σ = 0.337" in summary and "MSE ≥ 0.05" in summary
    assert "No attacker can reconstruct inputs with a mean squared error below 0.0658" in md


def test_sigma_zero_says_nothing_is_guaranteed_and_the_noise_needed(render):
    html, md = render("sigma0_audit")
    summary = summary_text(html)
    assert "Nothing is guaranteed" in summary and "No attacker can" not in summary
    assert "σ = 0.337" in summary
    assert "dFIL is infinite for 898 of 898 samples" in html
    assert (
        "FAILED: the provable bound is too low" in html
        and "QUICK RUN: fewer seeds, epochs and iterations" in html
        and "[QUICK RUN: lower bounds on leakage]" in html
    )


def test_failed_attack_is_impossible_to_miss(render):
    html, md = render("failed_attack_audit")
    summary = summary_text(html)
    assert "FAILED: the audit is incomplete" in summary
    assert "INCOMPLETE AUDIT: the sdar attack failed (RuntimeError: CUDA out of memory)" in summary
    assert '<section class="attack failed" id="attack-sdar">' in html
    assert "INCOMPLETE AUDIT" in md and "❌" in md


def test_black_box_model_lists_skipped_attacks_and_violation(render):
    html, _ = render("blackbox_audit")
    assert "Bound violated by decoder" in html and "beats the bound" in html
    not_run = html.split("Attacks not run")[1].split("</table>")[0]
    assert "optimization" in not_run and "needs gradients of the model" in not_run and "sdar" in not_run
    assert "finite-difference" in html


def test_tabular_audit_shows_feature_profiles_not_image_metrics(render):
    html, md = render("tabular_audit")
    assert "SSIM" not in html and "Reconstructions (best, median, worst)" in html
    assert "τ" not in summary_text(html)  # no smoothing for tabular data


@pytest.mark.parametrize("fmt", ["html", "md"])
def test_malicious_strings_are_escaped(render, fmt):
    html, md = render("blackbox_audit")
    text = html if fmt == "html" else md
    assert "<img src=x" not in text and "onerror=alert(1)>" not in text
    assert "&lt;img src=x onerror=alert(1)&gt;" in text
    if fmt == "html":
        assert sum(tag.startswith("<img") for tag in re.findall(r"<[^>]+>", html)) == len(outline(html).images)
        assert all(src.startswith("data:") for src in outline(html).images)


def test_minimal_result_renders_without_empty_sections(render):
    minimal = {"schema_version": SCHEMA_VERSION, "gate": {"passed": True, "reasons": [], "checks": []}}
    html, md = render(None, minimal)
    assert empty_html_sections(html) == [] and empty_markdown_sections(md) == []
    assert "Not computed" in html


def test_result_without_leakage_sections_or_optional_keys(render):
    result = fixture("image_audit")
    for key in ("dfil", "prior", "calibration"):
        del result[key]
    for attack in result["attacks"].values():
        for key in ("metrics_std", "baseline_std", "examples", "details", "seeds", "assumptions"):
            attack.pop(key, None)
    html, md = render(None, result)
    assert empty_html_sections(html) == [] and empty_markdown_sections(md) == []
    assert "Recommended noise" not in html and "Attacks against the bound" in html


def test_terminal_summary_is_a_compact_table():
    text = terminal_summary(fixture("failed_attack_audit"))
    lines = text.splitlines()
    assert lines[0] == "FAILED: the audit is incomplete [QUICK RUN: lower bounds on leakage]"
    assert any(line.startswith("sdar") and "FAILED" in line for line in lines)
    assert any(line.startswith("decoder") and "MSE 0.07471" in line for line in lines)
    assert max(len(line) for line in lines) <= 110


def test_junit_has_one_case_per_gate_check(tmp_path):
    result = fixture("sigma0_audit")
    suite = ET.parse(write_junit(result, tmp_path / "j.xml")).getroot()
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["audit-complete", "fail-under-mse"]
    assert cases[1].find("failure").get("message").startswith("van Trees bound MSE 0 is below")


def test_load_result_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"schema_version": 99}')
    with pytest.raises(InputError, match=f"schema version 99; this splitaudit reads versions 5, {SCHEMA_VERSION}"):
        load_result(bad)
    bad.write_text("not json")
    with pytest.raises(InputError, match="invalid JSON"):
        load_result(bad)


def test_comparison_shows_deltas_and_direction(tmp_path):
    paths = write_comparison(fixture("sigma0_audit"), fixture("image_audit"), tmp_path, ["html", "md", "json"])
    assert [p.name for p in paths] == ["comparison.html", "comparison.md", "comparison.json"]
    md = (tmp_path / "comparison.md").read_text(encoding="utf-8")
    row = next(line for line in md.splitlines() if line.startswith("| van Trees"))
    assert "| 0 " in row and "0.0658" in row and "better" in row
    decoder = next(line for line in md.splitlines() if line.startswith("| decoder"))
    assert "0.9833" in decoder and "0.3082" in decoder and "better" in decoder
    html = (tmp_path / "comparison.html").read_text(encoding="utf-8")
    assert empty_html_sections(html) == [] and outline(html).images


def test_comparison_with_skipped_attacks_and_escaping(tmp_path):
    write_comparison(fixture("image_audit"), fixture("blackbox_audit"), tmp_path, ["html"])
    html = (tmp_path / "comparison.html").read_text(encoding="utf-8")
    assert "before ok, after skipped" in html and "<img src=x" not in html


def test_render_and_compare_commands(tmp_path, capsys):
    shutil.copy(FIXTURES / "image_audit.json", tmp_path / "report.json")
    with pytest.raises(SystemExit) as exc:
        cli.main(["render", str(tmp_path / "report.json")])
    assert exc.value.code == 0 and (tmp_path / "report.html").is_file() and (tmp_path / "report.md").is_file()
    with pytest.raises(SystemExit) as exc:
        cli.main(
            [
                "compare",
                str(FIXTURES / "sigma0_audit.json"),
                str(tmp_path / "report.json"),
                "--out",
                str(tmp_path / "cmp"),
                "--format",
                "md",
            ]
        )
    assert exc.value.code == 0 and [p.name for p in (tmp_path / "cmp").glob("*.md")] == ["comparison.md"]
    assert "comparison.md" in capsys.readouterr().out


def test_a_complete_audit_without_thresholds_is_not_called_passed():
    """With no gate thresholds, "passed" only means "complete": the banner must not claim more."""
    from splitaudit.reports.view import build_view
    from splitaudit.verdicts.gate import evaluate_gate

    result = fixture("image_audit")
    gated = build_view(result, with_figures=False)
    assert gated.verdict_class == "pass" and gated.headline.startswith("PASSED")
    result["gate"] = evaluate_gate(result)  # the same audit with no thresholds asked for
    plain = build_view(result, with_figures=False)
    assert plain.passed and plain.verdict_class == "neutral"
    assert plain.headline.startswith("AUDIT COMPLETE") and "PASSED" not in plain.headline
    assert plain.summary[0].label == "Verdict" and plain.summary[0].tone == "info"


def test_smoothed_bounds_state_their_condition_wherever_they_promise_something():
    """With randomized smoothing the bound covers smoothed inputs only (Maeng et al., NeurIPS 2023, A.1): the
    recommendation must say so, and a violation must name that cause before blaming the prior."""
    from splitaudit.reports.view import build_view
    from splitaudit.stages.bound_check import check_against_bound

    result = fixture("blackbox_audit")
    result["prior"]["smoothing"] = result["calibration"]["smoothing"] = 0.25
    result["attacks"], result["bounds"] = check_against_bound(result["bounds"], result["attacks"], 0.25)
    view = build_view(result, with_figures=False)
    noise = next(item.text for item in view.summary if item.label == "Recommended noise")
    assert "for inputs smoothed with noise τ = 0.25" in noise
    alert = next(a for a in view.alerts if a.startswith("The provable bound is not trustworthy"))
    assert "applies only if the client smooths its inputs" in alert


def test_a_bound_beaten_by_an_attack_is_called_untrustworthy_not_too_low():
    from splitaudit.reports.view import build_view
    from splitaudit.verdicts.gate import evaluate_gate

    result = fixture("blackbox_audit")
    bound = result["bounds"]["van_trees_mse"]
    assert result["bounds"]["violated_by"]
    result["gate"] = evaluate_gate(result, fail_under_mse=bound / 2)  # the bound clears the threshold
    assert build_view(result, with_figures=False).headline == "FAILED: the provable bound cannot be trusted"
    result["gate"] = evaluate_gate(
        {**result, "bounds": {**result["bounds"], "violated_by": []}}, fail_under_mse=bound * 2
    )
    assert build_view(result, with_figures=False).headline == "FAILED: the provable bound is too low"


def test_sdar_section_says_what_query_access_is_worth(render):
    """SDAR's MSE beside the query-access decoder's, which its entry names (image_audit: decoder
    0.0747, sdar 0.0963, so 1.3x); no comparison when the decoder did not run."""
    html, md = render("image_audit")
    sentence = (
        "What query access is worth: the decoder attack, which can run the bottom model, "
        "reaches MSE 0.07471; this attack, which cannot, 0.09632 (1.3x the error)."
    )
    sdar_section = html.split('id="attack-sdar"')[1].split("</section>")[0]
    assert sentence in sdar_section and sentence in md
    assert html.count("What query access is worth") == 1
    result = fixture("image_audit")
    result["attacks"]["decoder"] = {"kind": "reconstruction", "status": "skipped", "reason": "not asked for"}
    html, _ = render(None, result)
    assert "What query access is worth" not in html


def test_a_report_written_before_entries_carried_their_words_still_renders(render):
    """Older report.json files have no title, baseline_name, query_access_reference or series in
    their attack entries: the attack's name, the baseline by kind and the metric's name stand in,
    and nothing is looked up in the attack modules."""
    result = fixture("tabular_audit")
    for entry in result["attacks"].values():
        for key in ("title", "baseline_name", "query_access_reference", "series"):
            entry.pop(key, None)
    html, md = render(None, result)
    assert "Model completion (fine-tune)" not in html
    fine_tune = html.split('id="attack-fine-tune"')[1].split("</section>")[0]
    assert "<h4>accuracy against k</h4>" in fine_tune and "baseline: guessing the average input" in html
    assert "Clustering (k-means)" in render("tabular_audit")[0], "the words a new report carries are shown"
