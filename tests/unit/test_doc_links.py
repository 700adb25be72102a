"""Every relative link in the README and docs/ reaches a file and, with #anchor, a heading in it.

A heading renamed (or a section dropped) leaves its links landing at the top of a page, silently:
GitHub's anchor rule is applied here to every heading, outside code blocks.
"""
from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose_lines(path: str) -> list[tuple[int, str]]:
    lines, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced:
                lines.append((number, line))
    return lines


def anchors(path: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return found


def broken_links(path: str) -> list[str]:
    broken = []
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            where = f"{os.path.relpath(path, ROOT)}:{number}: {target}"
            if not os.path.exists(dest):
                broken.append(f"{where}: no such file")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                broken.append(f"{where}: no such heading")
    return broken


def test_slug_follows_github() -> None:
    assert slug("Suspect nodes: slow nodes, other hardware") == "suspect-nodes-slow-nodes-other-hardware"
    assert slug("Steady-state cost of long-polls (`bench_polls.py`)") == "steady-state-cost-of-long-polls-bench_pollspy"
    assert slug("torchrun -> the plugin") == "torchrun---the-plugin"


def test_every_relative_link_resolves() -> None:
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "deploy", "README.md")]
    docs += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    broken = [b for path in docs if os.path.exists(path) for b in broken_links(path)]
    assert not broken, "\n".join(broken)
