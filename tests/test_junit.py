"""The JUnit report's exact elements, for a check that ran and for one that could not run.

Both come from one builder; CI systems read these elements and attributes, so they are
asserted one by one rather than only parsed.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from mtpkit.check.junit import junit_error_xml, junit_xml, write_junit
from mtpkit.core.errors import MtpkitError

RESULT = {
    "source": "org/model",
    "revision": "main",
    "verdict": "fail",
    "checks": [
        {"name": "head_present", "status": "pass", "detail": "4 MTP tensors in mtp/weights"},
        {"name": "manifest", "status": "warn", "detail": "no manifest"},
        {"name": "norm_shift", "status": "fail", "detail": "norms shifted twice <fix>"},
    ],
    "acceptance": 0.5625,
    "best_variant": {
        "norm_shift": -1,
        "hidden": "post_norm",
        "concat_order": "embedding_first",
        "acceptance": 0.7,
    },
}


def attributes(element: ET.Element | None) -> dict[str, str]:
    assert element is not None
    return dict(element.attrib)


def test_result_report_has_one_case_per_check():
    text = junit_xml(RESULT)
    assert text.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites ')
    root = ET.fromstring(text)
    assert root.tag == "testsuites"
    assert attributes(root) == {
        "name": "mtpkit check",
        "tests": "3",
        "failures": "1",
        "errors": "0",
    }
    (suite,) = list(root)
    assert attributes(suite) == {
        "name": "org/model@main",
        "tests": "3",
        "failures": "1",
        "errors": "0",
        "skipped": "0",
    }
    props = [attributes(p) for p in suite.findall("properties/property")]
    assert props == [
        {"name": "verdict", "value": "fail"},
        {"name": "acceptance", "value": "0.5625"},
        {"name": "best_variant.norm_shift", "value": "-1"},
        {"name": "best_variant.hidden", "value": "post_norm"},
        {"name": "best_variant.concat_order", "value": "embedding_first"},
        {"name": "best_variant.acceptance", "value": "0.7"},
    ]
    cases = suite.findall("testcase")
    assert [attributes(c) for c in cases] == [
        {"classname": "mtpkit.check.verdict.org_model_main", "name": name}
        for name in ("head_present", "manifest", "norm_shift")
    ]
    passed, warned, failed = cases
    assert list(passed) == []
    assert [(e.tag, e.text) for e in warned] == [("system-out", "warning: no manifest")]
    assert [(e.tag, e.attrib, e.text) for e in failed] == [
        (
            "failure",
            {"message": "norms shifted twice <fix>", "type": "norm_shift"},
            "norms shifted twice <fix>",
        )
    ]


def test_result_without_probes_or_revision_has_only_the_verdict_property():
    result = {**RESULT, "revision": None, "acceptance": None, "best_variant": None}
    suite = ET.fromstring(junit_xml(result)).find("testsuite")
    assert suite is not None and suite.get("name") == "org/model"
    assert [attributes(p) for p in suite.findall("properties/property")] == [
        {"name": "verdict", "value": "fail"}
    ]


def test_error_report_has_one_error_case_and_no_properties():
    root = ET.fromstring(junit_error_xml("models/a b", "v1", "no such directory models/a b"))
    assert attributes(root) == {
        "name": "mtpkit check",
        "tests": "1",
        "failures": "0",
        "errors": "1",
    }
    (suite,) = list(root)
    assert attributes(suite) == {
        "name": "models/a b@v1",
        "tests": "1",
        "failures": "0",
        "errors": "1",
        "skipped": "0",
    }
    assert suite.find("properties") is None
    (case,) = list(suite)
    assert attributes(case) == {"classname": "mtpkit.check.verdict.models_a_b_v1", "name": "check"}
    assert [(e.tag, e.attrib, e.text) for e in case] == [
        (
            "error",
            {"message": "no such directory models/a b", "type": "MtpkitError"},
            "no such directory models/a b",
        )
    ]


def test_write_junit_creates_parents_and_names_an_unwritable_path(tmp_path):
    path = tmp_path / "reports" / "check.xml"
    write_junit(RESULT, path)
    assert path.read_text(encoding="utf-8") == junit_xml(RESULT)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MtpkitError, match="cannot write --junit "):
        write_junit(RESULT, blocker / "check.xml")
