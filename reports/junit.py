"""The gates as JUnit XML test cases, for CI systems that display them."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from splitaudit.reports.documents import Document
from splitaudit.reports.files import write_atomic
from splitaudit.reports.view_verdict import QUICK_ALERT


def write_junit_document(document: Document, out_dir: Path) -> Path:
    """KIND.junit.xml: the gate's checks of a report, sweep or cuts."""
    return write_junit(document.data, out_dir / f"{document.kind}.junit.xml")


def write_junit(result: dict, path: Path) -> Path:
    """The gate's checks as one test suite; a --quick run is named so and carries the quick-run
    warning, since a CI view of passed checks must not read as a full audit's."""
    checks = result["gate"]["checks"]
    quick = bool((result.get("run") or {}).get("quick"))
    suite = ET.Element(
        "testsuite",
        name="splitaudit (quick run)" if quick else "splitaudit",
        tests=str(len(checks)),
        failures=str(sum(not c["passed"] for c in checks)),
    )
    properties = ET.SubElement(suite, "properties")
    ET.SubElement(properties, "property", name="quick", value=str(quick).lower())
    for check in checks:
        case = ET.SubElement(suite, "testcase", classname="splitaudit.verdicts.gate", name=check["name"])
        if not check["passed"]:
            ET.SubElement(case, "failure", message=check["message"]).text = check["message"]
    if quick:  # after the test cases, where the JUnit schema puts it
        ET.SubElement(suite, "system-out").text = QUICK_ALERT
    path.parent.mkdir(parents=True, exist_ok=True)
    xml = ET.tostring(suite, encoding="utf-8", xml_declaration=True)
    return write_atomic(path.parent, path.name, xml)
