"""CI integrations: the step the GitHub Action (action.yml) and the GitLab job run, and the pre-commit hook.

    python -m splitaudit.ci run MODEL --aux DATA [splitaudit run options...]
    python -m splitaudit.ci pre-commit --report privacy/report.json MODEL_FILE...

`run` (its arguments, or else the SPLITAUDIT_ARGS variable) audits with splitaudit run (reports into --out, default splitaudit-report, as HTML, Markdown,
JSON and SARIF, and JUnit on GitLab) and hands the outcome to the CI system it finds in the
environment: on GitHub Actions (GITHUB_ACTIONS) the Markdown report is appended to the job summary
(GITHUB_STEP_SUMMARY) and exit-code, passed, report-dir, fingerprint and sarif go to the step's
outputs (GITHUB_OUTPUT); on GitLab CI (GITLAB_CI) the same values go to splitaudit.env, a dotenv
report. It exits with splitaudit's own code (0 passed, 1 a gate failed, 2 bad input), so the job
fails on the gate while the steps marked to run always still upload the reports.

`pre-commit` checks each model file given against the reports' provenance: a model whose digest is
not the audited one (it changed since its audit) or that no report records fails the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

CI_FORMATS = "html,md,json,sarif"
DEFAULT_OUT = "splitaudit-report"
DOTENV = "splitaudit.env"
ARGS_VARIABLE = "SPLITAUDIT_ARGS"  # the Action's `args` input, as one string
MODEL_ROLES = ("model", "model-external-data", "top-model")


def audit_step(args: list[str], environ: dict[str, str] | None = None) -> int:
    """splitaudit run with args (none given: SPLITAUDIT_ARGS split as a shell would, so that a CI
    input passes through no shell eval), its outcome handed to the CI system; returns splitaudit's
    exit code."""
    environ = dict(os.environ if environ is None else environ)
    args = args or shlex.split(environ.get(ARGS_VARIABLE, ""))
    out = _option_value(args, "--out") or DEFAULT_OUT
    formats = CI_FORMATS + (",junit" if environ.get("GITLAB_CI") else "")
    command = [sys.executable, "-m", "splitaudit", "run", "--out", out, "--format", formats, *args]
    completed = subprocess.run(command, stderr=subprocess.PIPE, text=True, env=environ)
    sys.stderr.write(completed.stderr)
    outcome = _outcome(Path(out), completed.returncode, completed.stderr)
    if environ.get("GITHUB_ACTIONS"):
        _github(outcome, environ)
    if environ.get("GITLAB_CI"):
        _write_lines(Path(DOTENV), {f"SPLITAUDIT_{k.upper().replace('-', '_')}": v for k, v in outcome.items()})
    return completed.returncode


def _option_value(args: list[str], flag: str) -> str | None:
    """The last value given to flag (as click takes it), in `--flag V` or `--flag=V` form."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _outcome(out: Path, code: int, stderr: str) -> dict[str, str]:
    """What the CI reads of the audit: its exit code, verdict, folder, fingerprint and SARIF file."""
    report = out / "report.json"
    fingerprint = ""
    if report.is_file():
        fingerprint = (json.loads(report.read_text(encoding="utf-8")).get("provenance") or {}).get("fingerprint", "")
    sarif = out / "report.sarif"
    error = next((line for line in reversed(stderr.splitlines()) if line.startswith("splitaudit: error:")), "")
    return {
        "exit-code": str(code),
        "passed": "true" if code == 0 else "false",
        "report-dir": str(out),
        "fingerprint": fingerprint,
        "sarif": str(sarif) if sarif.is_file() else "",
        "error": error,
    }


def _github(outcome: dict[str, str], environ: dict[str, str]) -> None:
    if environ.get("GITHUB_OUTPUT"):
        _write_lines(Path(environ["GITHUB_OUTPUT"]), outcome)
    if environ.get("GITHUB_STEP_SUMMARY"):
        markdown = Path(outcome["report-dir"]) / "report.md"
        if markdown.is_file():
            summary = markdown.read_text(encoding="utf-8")
        else:
            summary = (
                f"## splitaudit could not audit (exit {outcome['exit-code']})\n\n{outcome['error'] or 'no report'}\n"
            )
        with open(environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as stream:
            stream.write(summary + "\n")


def _write_lines(path: Path, values: dict[str, str]) -> None:
    """KEY=VALUE lines appended (GITHUB_OUTPUT, a dotenv file); values are one line each."""
    with open(path, "a", encoding="utf-8") as stream:
        for key, value in values.items():
            stream.write(f"{key}={' '.join(str(value).splitlines())}\n")


def pre_commit(files: list[str], reports: list[str]) -> int:
    """0 when every model file given is one a report audited, unchanged; 1 naming each that is not."""
    from splitaudit.core.errors import InputError
    from splitaudit.engine.verify import provenance_of
    from splitaudit.inputs.digests import file_sha256
    from splitaudit.reports import load_result

    audited: dict[Path, tuple[str, str]] = {}
    try:
        for report in reports:
            provenance = provenance_of(load_result(Path(report)), report)
            for record in provenance["files"]:
                if record["role"] in MODEL_ROLES:
                    audited[Path(record["path"]).resolve()] = (record["sha256"], report)
    except InputError as exc:
        print(f"splitaudit: error: {exc}", file=sys.stderr)
        return 2
    problems = []
    for name in files:
        known = audited.get(Path(name).resolve())
        if known is None:
            problems.append(f"{name}: no audit records it (run splitaudit run on it and commit its report.json)")
        elif file_sha256(name) != known[0]:
            problems.append(f"{name}: changed since its audit ({known[1]}): rerun splitaudit and commit the new report")
    for problem in problems:
        print(f"splitaudit: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m splitaudit.ci", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    step = commands.add_parser("run", help="audit and report to GitHub Actions or GitLab CI")
    step.add_argument("args", nargs=argparse.REMAINDER, help="splitaudit run's model and options")
    hook = commands.add_parser("pre-commit", help="check model files against their audits' provenance")
    hook.add_argument("--report", action="append", required=True, help="an audit's report.json (repeatable)")
    hook.add_argument("files", nargs="*")
    parsed = parser.parse_args(argv)
    if parsed.command == "run":
        raise SystemExit(audit_step(parsed.args))
    raise SystemExit(pre_commit(parsed.files, parsed.report))


if __name__ == "__main__":
    main()
