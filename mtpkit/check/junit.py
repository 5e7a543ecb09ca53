"""JUnit XML reports of `mtpkit check`, for CI systems that show test results.

One builder writes both reports: a check that ran (one test case per check, a failed check
is a `<failure>`, a warning passes with it in `<system-out>`) and a check that could not run
(one `check` case holding an `<error>`), so CI always shows why.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    """One test case; at most one of `failure`, `error`, `warning` and `skipped` is set."""

    name: str
    failure: str | None = None
    error: str | None = None
    warning: str | None = None
    skipped: str | None = None
    error_type: str = "MtpkitError"


def where(source: str, revision: str | None) -> str:
    return source + (f"@{revision}" if revision else "")


def build_xml(suite_name: str, cases: list[Case], properties: dict[str, str]) -> str:
    """The report: one suite named after the checked source, its properties, its cases."""
    counts = {
        "tests": str(len(cases)),
        "failures": str(sum(c.failure is not None for c in cases)),
        "errors": str(sum(c.error is not None for c in cases)),
    }
    suites = ET.Element("testsuites", name="mtpkit check", **counts)
    skipped = str(sum(c.skipped is not None for c in cases))
    suite = ET.SubElement(suites, "testsuite", name=suite_name, **counts, skipped=skipped)
    if properties:
        props = ET.SubElement(suite, "properties")
        for name, value in properties.items():
            ET.SubElement(props, "property", name=name, value=value)
    classname = "mtpkit.check.verdict." + re.sub(r"[^\w.-]+", "_", suite_name)
    for c in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=c.name)
        if c.failure is not None:
            ET.SubElement(case, "failure", message=c.failure, type=c.name).text = c.failure
        elif c.error is not None:
            ET.SubElement(case, "error", message=c.error, type=c.error_type).text = c.error
        elif c.warning is not None:
            ET.SubElement(case, "system-out").text = f"warning: {c.warning}"
        elif c.skipped is not None:
            ET.SubElement(case, "skipped", message=c.skipped)
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def junit_xml(result: dict[str, Any]) -> str:
    """The report of a check that ran (a `check --json` object)."""
    cases = [
        Case(
            c["name"],
            failure=c["detail"] if c["status"] == "fail" else None,
            warning=c["detail"] if c["status"] == "warn" else None,
            skipped=c["detail"] if c["status"] == "skip" else None,
        )
        for c in result["checks"]
    ]
    properties = {"verdict": result["verdict"]}
    if result.get("acceptance") is not None:
        properties["acceptance"] = str(result["acceptance"])
    if result.get("moe_dtype") is not None:
        properties["moe_dtype"] = str(result["moe_dtype"])
    for key, value in (result.get("best_variant") or {}).items():
        properties[f"best_variant.{key}"] = str(value)
    return build_xml(where(result["source"], result.get("revision")), cases, properties)


def junit_error_xml(
    source: str, revision: str | None, message: str, error_type: str = "MtpkitError"
) -> str:
    """The report of a check that could not run (exit 1), whatever stopped it."""
    case = Case("check", error=message, error_type=error_type)
    return build_xml(where(source, revision), [case], {})


def write_junit(report: dict[str, Any] | str, path: str | Path, source: str | None = None) -> None:
    """Write a report (a result, or XML text from `junit_error_xml`) to `path`, atomically
    and never inside the checked `source` (`mtpkit.convert.destination.write_file`)."""
    from mtpkit.convert.destination import local_source_dir, write_file

    text = report if isinstance(report, str) else junit_xml(report)
    sources = [local_source_dir(source)] if source is not None else []
    write_file(Path(path), text, option="--junit", sources=sources)
