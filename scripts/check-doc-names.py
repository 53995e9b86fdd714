#!/usr/bin/env python3
"""Checks that every code name README.md and docs/**/*.md cite still exists.

The docs prove their claims by naming tests and functions
(`a_ring_heard_after_a_freeze_is_not_taken_for_a_read`,
`api::admission::ledger::tests`); a rename or a deletion leaves such a
name pointing at nothing, and a reader then trusts a proof that is gone.
A name here is a code span holding a snake_case identifier of four words
or more (optionally a `path::` before it and `()` after it): shorter ones
are too often JSON fields, flags or prose. It exists when it occurs as a
word in a file git tracks that is not Markdown.

Usage: scripts/check-doc-names.py
Exit status 1, with one line per missing name, when any is missing.
Standard library only.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CODE_SPAN = re.compile(r"`([^`]+)`")
NAME = re.compile(r"^(?:[a-z_][a-z0-9_]*::)*([a-z][a-z0-9]*(?:_[a-z0-9]+){3,})(?:\(\))?$")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tracked_files():
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / path for path in listed.split("\0") if path]


def code_words(files):
    """Every identifier-like word in the tracked files that are not Markdown."""
    words = set()
    for path in files:
        if path.suffix == ".md" or not path.is_file():
            continue
        try:
            words.update(WORD.findall(path.read_text(errors="ignore")))
        except OSError:
            continue
    return words


def main():
    files = tracked_files()
    words = code_words(files)
    pages = [path for path in files if path.suffix == ".md"
             and (path == ROOT / "README.md" or ROOT / "docs" in path.parents)]
    missing = []
    for page in sorted(pages):
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            for span in CODE_SPAN.findall(line):
                for token in re.split(r"[\s,]+", span):
                    name = NAME.match(token)
                    if name and name.group(1) not in words:
                        missing.append(f"{page.relative_to(ROOT)}:{number}: `{token}` names nothing in the code")
    for line in missing:
        print(line)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
