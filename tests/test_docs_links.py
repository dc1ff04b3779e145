"""Every Markdown link in the user-facing documents lands inside this
repository, on a file that is there (and, for ``#anchor`` links to a
Markdown file, on a heading that is there).

The documents: ``README.md``, ``docs/*.md``, ``reports/**/*.md``,
``tests/README.md``, ``examples/README.md`` and any Markdown file under
``bench/`` or ``tools/``.  A report that leaves ``reports/`` while a page
still cites it, an image a report no longer has beside it, or a link to a
file outside the clone (which a user's clone does not have) fails here.
Pure file reading: no process group, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent

# [text](target) and ![alt](target); the text may hold one level of brackets
# ([`x[0]`](y)); the target may be <wrapped> and followed by a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target  (reference definitions)
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n.*?^[ \t]*\1[^\n]*$", re.M | re.S)  # indented in a list too
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
RELATIVE_PATH = re.compile(r"(\.\./)+[\w.-]+(/[\w.-]+)*")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "reports").rglob("*.md")),
            ROOT / "tests" / "README.md", ROOT / "examples" / "README.md",
            *sorted((ROOT / "bench").rglob("*.md")), *sorted((ROOT / "tools").rglob("*.md"))]
    return [d for d in docs if d.is_file()]


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (a link there is an example)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link target of a Markdown text, in order."""
    prose = _prose(text)
    found = [m.group(1) for m in LINK.finditer(prose)] + [m.group(1) for m in REF_DEF.finditer(prose)]
    return [t[1:-1] if t.startswith("<") else t for t in found]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation
    but hyphens and underscores removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def code_paths(text: str) -> list[str]:
    """Inline code that is a relative path climbing out of the folder
    (`../x/y.md`): named as a file to read, it must be in the clone."""
    spans = (m.group(0).strip("`").strip() for m in INLINE_CODE.finditer(FENCE.sub("", text)))
    return [s for s in spans if RELATIVE_PATH.fullmatch(s)]


def problems(doc: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with a document's relative links: each as 'doc: target: why'."""
    out = []
    root = root.resolve()
    text = doc.read_text(encoding="utf-8")
    for named in code_paths(text):
        dest = (doc.parent / named).resolve()
        if dest != root and root not in dest.parents:
            out.append(f"{doc.relative_to(root)}: `{named}`: names a file outside the repository")
        elif not dest.exists():
            out.append(f"{doc.relative_to(root)}: `{named}`: names a file the repository does not have")
    for target in links(text):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{doc.relative_to(root)}: {target}"
        if not path_part:  # #anchor in the same file
            dest = doc
        else:
            if path_part.startswith("/"):
                out.append(f"{where}: an absolute path (link relative to the document)")
                continue
            dest = (doc.parent / unquote(path_part)).resolve()
            if dest != root and root not in dest.parents:
                out.append(f"{where}: outside the repository (a clone does not have it)")
                continue
            if not dest.exists():
                out.append(f"{where}: no such file")
                continue
        if anchor and dest.is_file() and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            out.append(f"{where}: no heading with the anchor #{anchor} in {dest.relative_to(root)}")
    return out


def test_the_documents_are_found():
    names = {d.relative_to(ROOT).as_posix() for d in documents()}
    assert {"README.md", "docs/README.md", "reports/README.md"} <= names, sorted(names)
    assert any(n.startswith("reports/") and n != "reports/README.md" for n in names)


def test_every_link_lands_on_a_file_in_the_repository():
    bad = [p for d in documents() for p in problems(d)]
    assert not bad, ("Markdown links that lead nowhere (a removed report, a renamed heading, a file "
                     "outside the repository):\n" + "\n".join(bad))


def test_the_link_reader_itself():
    text = """
[a](docs/a.md) ![chart](x-step.png) [`f[0]`](b.md#sec) [web](https://example.org/x)
[same page](#here) [wrapped](<c d.md>) [titled](e.md "title")
`[not a link](inline.md)`
```python
[not a link either](fenced.md)
```
   ```text
   [nor this](indented-fence.md)
   ```
[ref]: f.md
"""
    assert links(text) == ["docs/a.md", "x-step.png", "b.md#sec", "https://example.org/x",
                           "#here", "c d.md", "e.md", "f.md"]
    assert slug("torch's FSDP2 `replicate` as a peer") == "torchs-fsdp2-replicate-as-a-peer"
    assert slug("Does not work / not tested") == "does-not-work--not-tested"
    assert slug("Large gradients reduced where they are (CPU)") == "large-gradients-reduced-where-they-are-cpu"


@pytest.mark.parametrize("target, why", [
    ("reports/gone.md", "no such file"),
    ("../outside/DESIGN.md", "outside the repository"),
    ("docs/page.md#no-such-heading", "no heading with the anchor"),
    ("/etc/passwd", "an absolute path"),
])
def test_a_broken_link_is_reported(tmp_path, target, why):
    (tmp_path / "repo" / "docs").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "DESIGN.md").write_text("# Design\n")
    root = tmp_path / "repo"
    (root / "docs" / "page.md").write_text("# A page\n\n## A section\n")
    doc = root / "README.md"
    doc.write_text(f"[fine](docs/page.md#a-section) [here](#top)\n\n# Top\n\n[broken]({target})\n")
    found = problems(doc, root)
    assert len(found) == 1 and why in found[0], found


def test_a_file_outside_named_in_code_is_reported(tmp_path):
    """A path in inline code that climbs out of the page's folder names a
    file to read: outside the clone, or not in it, it is reported."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    page = root / "docs" / "page.md"
    (root / "README.md").write_text("# Repo\n")
    page.write_text("See `../README.md`, `../../shared/DESIGN.md` and `../shared/DESIGN.md`; `a/b` is no path.\n")
    found = problems(page, root)
    assert len(found) == 2, found
    assert "`../../shared/DESIGN.md`: names a file outside the repository" in found[0], found
    assert "`../shared/DESIGN.md`: names a file the repository does not have" in found[1], found
