"""The project's face: docs/ stays small, every relative link in README and docs resolves, and no text in the tree
names internal work items."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_DOC_FILES = 40
MAX_DOC_BYTES = 2 * 1024 * 1024
# Internal work items and numbered stops must not appear anywhere (the same pattern as
# grep -rniE "\bstop[ -]?[0-9]+\b|\bissue [0-9]+\b").
FORBIDDEN = re.compile(r"\bstop[ -]?[0-9]+\b|\bissue [0-9]+\b", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def tree_files() -> list[Path]:
    """Every file of the working tree except .git (and ignored build outputs when git can tell)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        files = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.rglob("*") if ".git" not in p.relative_to(ROOT).parts]
    return [p for p in files if p.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fence = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.*)$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def broken_links(md: Path) -> list[str]:
    bad = []
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # links inside code blocks are code
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(target)
    return bad


def test_docs_stay_under_40_files_and_2_mb() -> None:
    files = [p for p in DOCS.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert 5 <= len(files) < MAX_DOC_FILES, f"docs/ holds {len(files)} files"
    assert size < MAX_DOC_BYTES, f"docs/ holds {size / 2**20:.1f} MiB"


def test_link_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` heading\n\n[ok](#some-code-heading) [web](https://x)\n")
    (tmp_path / "b.md").write_text("[ok](a.md#title) [gone](c.md) [bad anchor](a.md#nope)\n```\n[in code](d.md)\n```\n")
    assert broken_links(tmp_path / "a.md") == []
    assert broken_links(tmp_path / "b.md") == ["c.md", "a.md#nope"]


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    bad = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))}
    assert len(pages) > 5 and not bad, bad


def test_no_text_or_file_name_in_the_tree_names_internal_work_items() -> None:
    files = tree_files()
    assert any(p.name == "README.md" for p in files) and len(files) > 100
    hits = []
    for p in files:
        rel = str(p.relative_to(ROOT))
        if FORBIDDEN.search(rel):
            hits.append(rel)
        data = p.read_bytes()
        if b"\0" in data[:8192]:  # binary (images, archives)
            continue
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits[:20])
    # (the examples are split so that this file does not match itself)
    assert FORBIDDEN.search("see " + "Issue" + " 12") and FORBIDDEN.search("at " + "stop" + "-27")
    assert not FORBIDDEN.search("two stops, issue tracker, nonstop 3")
