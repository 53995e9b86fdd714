#!/usr/bin/env python3
"""Checks that every relative link in README.md and docs/**/*.md resolves.

A link resolves when the file or directory it names exists (relative to the
page that holds it) and, when it carries a `#anchor` into a Markdown page,
that page has a heading (or an explicit `<a id=…>` / `<a name=…>`) whose
GitHub-style slug is that anchor. Links with a scheme (https:, mailto:, …)
are not checked. Code blocks and code spans are skipped.

Usage: scripts/check-links.py [FILE.md ...]   (default: README.md docs/**/*.md)
Exit status 1, with one line per broken link, when any link is broken.
Standard library only.
"""

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text):
    """The page's lines outside fenced code blocks, with their numbers."""
    in_fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            marker = fence.group(1)
            if in_fence is None:
                in_fence = marker
            elif in_fence == marker:
                in_fence = None
            continue
        if in_fence is None:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    kept = []
    for char in text:
        if char in (" ", "-", "_") or char.isalnum():
            kept.append(char)
        elif unicodedata.category(char).startswith(("L", "N", "M")):
            kept.append(char)
    return "".join(kept).replace(" ", "-")


_anchors = {}


def anchors(page):
    """Every anchor a Markdown page defines."""
    if page not in _anchors:
        found = set()
        seen = {}
        text = page.read_text(encoding="utf-8")
        for _, line in prose_lines(text):
            heading = HEADING.match(line)
            if heading:
                base = slug(heading.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
            for explicit in HTML_ANCHOR.findall(line):
                found.add(explicit)
        _anchors[page] = found
    return _anchors[page]


def links(page):
    """(line number, target) for every link on the page."""
    text = page.read_text(encoding="utf-8")
    for number, line in prose_lines(text):
        definition = REFERENCE_DEF.match(line)
        if definition:
            yield number, definition.group(1)
            continue
        for target in INLINE_LINK.findall(CODE_SPAN.sub("", line)):
            yield number, target


def problem(page, target):
    """Why `target` on `page` does not resolve, or None."""
    if SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part)
    if path_part:
        resolved = (page.parent / path_part).resolve()
        if not resolved.exists():
            return "no such file"
    else:
        resolved = page
    if anchor and resolved.is_file() and resolved.suffix == ".md":
        if unquote(anchor).lower() not in anchors(resolved):
            return f"no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}"
    return None


def pages(arguments):
    if arguments:
        return [Path(argument).resolve() for argument in arguments]
    found = [ROOT / "README.md"]
    found += sorted((ROOT / "docs").rglob("*.md"))
    return [page for page in found if page.is_file()]


def main(arguments):
    broken = []
    checked = 0
    for page in pages(arguments):
        for number, target in links(page):
            checked += 1
            why = problem(page, target)
            if why:
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target}: {why}")
    for line in broken:
        print(line)
    if broken:
        print(f"{len(broken)} broken link(s) of {checked} checked", file=sys.stderr)
        return 1
    print(f"{checked} links checked, none broken")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
