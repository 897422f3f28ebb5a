"""Issue #54: the README is a front page (at most 250 lines) and the reference lives in docs/;
docs/cli.md is what scripts/cli-doc generates from the parser (it cannot drift from the
options); every relative link and anchor in the README and docs/ resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target), outside code (inline code and fenced blocks are blanked first)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -."""
    heads = re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    heads = [line for line in lines if line.startswith("## ")]
    for wanted in ("## Install", "## What did your trainer leave?", "## How it works", "## Library"):
        assert wanted in heads, heads


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_every_doc_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme] == []


def test_cli_reference_is_what_the_parser_generates():
    done = subprocess.run([sys.executable, REPO / "scripts" / "cli-doc", "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = (REPO / "docs" / "cli.md").read_text()
    for command in ("ls", "rewrite", "diff", "hash", "completion"):
        assert f"## streamck {command}\n" in text
    assert "--quantize" in text and "--max-shard-size" in text
