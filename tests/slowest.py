"""Print the slowest tests of one or more pytest JUnit XML reports, slowest first.

`tests/run` runs the suite in two pytest runs (in parallel, then the tests marked `alone`);
each prints its own slowest set-ups, calls and tear-downs, and this prints, after both, the
tests that took longest in all (set-up, call and tear-down together) across them.

    python tests/slowest.py N REPORT.xml...
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def slowest(reports: list[Path], n: int) -> list[tuple[float, str]]:
    """The `n` slowest test cases of `reports` as (seconds, file::name); a report that is
    missing (its pytest run did not start) is left out."""
    cases: list[tuple[float, str]] = []
    for report in reports:
        if not report.exists():
            continue
        for case in ET.parse(report).getroot().iter("testcase"):
            where = case.get("file") or case.get("classname", "")
            cases.append((float(case.get("time") or 0), f"{where}::{case.get('name')}"))
    return sorted(cases, reverse=True)[:n]


def main(argv: list[str]) -> int:
    n, reports = int(argv[0]), [Path(a) for a in argv[1:]]
    rows = slowest(reports, n)
    print(f"{f' slowest {len(rows)} tests (set-up, call and tear-down) ':=^80}")
    for seconds, test in rows:
        print(f"{seconds:8.2f}s {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
