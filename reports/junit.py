"""The gates as JUnit XML test cases, for CI systems that display them."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from splitaudit.reports.files import write_atomic


def write_junit(result: dict, path: Path) -> Path:
    checks = result["gate"]["checks"]
    suite = ET.Element(
        "testsuite", name="splitaudit", tests=str(len(checks)), failures=str(sum(not c["passed"] for c in checks))
    )
    for check in checks:
        case = ET.SubElement(suite, "testcase", classname="splitaudit.gate", name=check["name"])
        if not check["passed"]:
            ET.SubElement(case, "failure", message=check["message"]).text = check["message"]
    path.parent.mkdir(parents=True, exist_ok=True)
    xml = ET.tostring(suite, encoding="utf-8", xml_declaration=True)
    return write_atomic(path.parent, path.name, xml)
