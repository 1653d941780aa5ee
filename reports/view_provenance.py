"""The provenance part of a report's view: the fingerprint a reviewer quotes, the files audited with
their digests, the versions and invocation, and the sign-off block a reviewer fills in. Read from the
result's provenance section (splitaudit.engine.provenance); a result without one has no such part."""

from __future__ import annotations

from dataclasses import dataclass

from splitaudit.reports.formatting import text
from splitaudit.reports.view_elements import Table, facts_table, section

# The lines a reviewer fills in by hand (HTML and PDF draw them as blanks, Markdown as a table).
SIGN_OFF_FIELDS = ("Reviewer", "Role", "Decision (accept / reject / needs changes)", "Date", "Signature")
SIGN_OFF_STATEMENT = (
    "I have checked that splitaudit verify, run on the JSON file of this report, finds the files named above unchanged "
    "(fingerprint {fingerprint}), and I have read the findings and limitations of this report."
)
TIME_LABELS = {"started": "started", "ended": "ended", "platform": "platform", "device_name": "device"}


@dataclass
class ProvenanceView:
    fingerprint: str
    files: Table | None
    versions: Table | None
    run: Table | None
    command_line: str
    statement: str
    sign_off: list[str]


def provenance_view(result: dict) -> ProvenanceView | None:
    """The provenance part of the view, or None for a result that has no provenance section."""
    provenance = section(result, "provenance")
    if not provenance.get("fingerprint"):
        return None
    fingerprint = text(provenance["fingerprint"])
    rows = [
        [text(f.get("role")), text(f.get("path")), text(f.get("sha256")), text(f.get("bytes"))]
        for f in provenance.get("files") or []
        if isinstance(f, dict)
    ]
    versions = {k: v for k, v in section(provenance, "versions").items() if v is not None}
    if provenance.get("converter"):
        versions["converter used"] = provenance["converter"]
    command = provenance.get("command_line")
    return ProvenanceView(
        fingerprint=fingerprint,
        files=Table(["input", "path", "SHA-256", "bytes"], rows) if rows else None,
        versions=facts_table(versions, {}),
        run=facts_table({k: provenance.get(k) for k in TIME_LABELS}, TIME_LABELS),
        command_line=" ".join(text(a) for a in command) if isinstance(command, list) else "(called from Python)",
        statement=SIGN_OFF_STATEMENT.format(fingerprint=fingerprint),
        sign_off=list(SIGN_OFF_FIELDS),
    )
