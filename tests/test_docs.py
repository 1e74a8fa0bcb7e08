"""The documentation: the site in docs/ builds with `mkdocs build --strict` and no warning (a
broken link between pages, a link to a missing file, a missing anchor or a page left out of the
nav fails it: mkdocs.yml's `validation`), and every relative link in README.md,
terraform/README.md and the pages points at a file that exists, and at a heading that exists where
it names one, as GitHub renders them (the READMEs are outside the site, and GitHub's heading
anchors are not always the site's).

    .venv/bin/pytest tests/test_docs.py
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"


def build_site(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config` into `site_dir`, with the venv's python."""
    command = ["build", "--strict", "--config-file", str(config), "--site-dir", str(site_dir)]
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )


def warnings_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if "WARNING" in line]


def test_the_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    result = build_site(CONFIG, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert not warnings_of(result), output
    assert (tmp_path / "site" / "index.html").is_file(), output


def test_the_strict_build_fails_on_a_broken_link_a_missing_anchor_and_a_page_off_the_nav(
    tmp_path: Path,
) -> None:
    # The repository's own config and pages, each breakage in a copy: what mkdocs.yml's
    # validation settings must catch.
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(CONFIG, tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    index.write_text(
        index.read_text()
        + "\n[gone](no-such-page.md) [no anchor](per-step.md#no-such-heading)"
        + " [outside](../README.md)\n"
    )
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n")
    result = build_site(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert len(warnings_of(result)) == 4, output
    for broken in ("'no-such-page.md'", "'#no-such-heading'", "'../README.md'", "- orphan.md"):
        assert broken in output, f"{broken} not reported:\n{output}"


# ---------------------------------------------------------------------------------------------
# Relative links as GitHub resolves them

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def _without_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, outside code blocks and code spans."""
    prose = _without_code(text)
    return _LINK.findall(prose) + _REFERENCE.findall(prose)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (code spans, links and emphasis as text),
    lower case, without punctuation, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = unicodedata.normalize("NFC", text.replace("`", "")).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def github_anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 ... for repeated ones."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        anchor = github_anchor(heading)
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        anchors.add(anchor if n == 0 else f"{anchor}-{n}")
    return anchors


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file, or whose heading in it, does not exist."""
    broken = []
    for target in links(page.read_text()):
        if _EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in github_anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file}")
    return broken


PAGES = [ROOT / "README.md", ROOT / "terraform" / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page: Path) -> None:
    assert not broken_links(page)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Per-step mode: staleness\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#per-step-mode-staleness) [self](#page) [web](https://x.org)\n"
        "[gone](missing.md) [no heading](other.md#nope) `[code](missing-too.md)`\n"
        "```\n[fenced](missing-three.md)\n```\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "other.md#nope"]
