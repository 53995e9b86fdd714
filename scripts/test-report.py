#!/usr/bin/env python3
"""Prints where a test run's time went, from nextest's JUnit files.

    scripts/test-report.py target/nextest/ci/junit-*.xml [--slowest N]

The N slowest tests (20 by default), then each tier's count, failures and
summed test time. A tier is the integration binary's top module (`pure`,
`store`, `gvisor`, `cluster`) or, for unit tests, the crate.
"""

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def tier_of(suite: str, name: str) -> str:
    if suite == "sandboxd::it":
        return name.split("::", 1)[0]
    return f"unit {suite.split('::', 1)[0]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+")
    parser.add_argument("--slowest", type=int, default=20)
    args = parser.parse_args()
    cases = []
    for path in args.junit:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as err:
            print(f"error: cannot read {path}: {err}", file=sys.stderr)
            return 1
        for suite in root.iter("testsuite"):
            for case in suite.iter("testcase"):
                failed = case.find("failure") is not None or case.find("error") is not None
                cases.append((float(case.get("time", "0")), suite.get("name", "?"), case.get("name", "?"), failed))
    if not cases:
        print("error: no test cases in the JUnit files", file=sys.stderr)
        return 1
    cases.sort(reverse=True)
    print(f"== the {min(args.slowest, len(cases))} slowest tests")
    for seconds, suite, name, failed in cases[: args.slowest]:
        mark = "  FAILED" if failed else ""
        print(f"{seconds:8.1f} s  {suite} {name}{mark}")
    totals = defaultdict(lambda: [0, 0, 0.0])
    for seconds, suite, name, failed in cases:
        total = totals[tier_of(suite, name)]
        total[0] += 1
        total[1] += failed
        total[2] += seconds
    print("== per tier (test time summed; tests run side by side, so wall time is less)")
    for tier, (count, failures, seconds) in sorted(totals.items(), key=lambda item: -item[1][2]):
        print(f"{tier:<22} {count:4d} tests  {failures:3d} failed  {seconds:8.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
