"""Fail CI when pytest skipped any test: python .ci/skipped.py REPORT.xml... (pytest's --junitxml).

In CI (CI=true) a test whose environment is missing fails through tests/support/processes.missing()
rather than skipping; any skip still reported here is a test that never ran, so it fails the run.
Each one is printed with its reason. Expected failures (xfail) are not skips and are not counted."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def skipped(report: str) -> list[str]:
    found = []
    for case in ET.parse(report).iter("testcase"):
        for skip in case.iter("skipped"):
            if skip.get("type") != "pytest.xfail":
                found.append(f"{case.get('classname')}::{case.get('name')}: {skip.get('message')}")
    return found


def main(reports: list[str]) -> int:
    found = [line for report in reports for line in skipped(report)]
    if not found:
        print(f"== no test was skipped ({', '.join(reports)})")
        return 0
    print(f"== {len(found)} test{'s were' if len(found) > 1 else ' was'} skipped; CI runs every test:")
    for line in found:
        print(f"   {line}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
