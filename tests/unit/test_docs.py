"""The docs stay true: the CLI reference is the CLI's, the README stays a front door, and links lead somewhere."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 200
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto: ...: not a file in the checkout


def _generator():
    spec = importlib.util.spec_from_file_location("generate_cli_reference", DOCS / "generate_cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_cli_reference_is_the_clis_own():
    committed = (DOCS / "reference" / "cli.md").read_text()
    assert committed == _generator().render(), (
        "docs/reference/cli.md is out of date with the CLI: run `python docs/generate_cli_reference.py`")


def test_the_docs_cli_reference_names_every_command():
    from typer.main import get_command

    from mbtune.cli import app

    rendered = _generator().render()
    for name in get_command(app).commands:  # type: ignore[attr-defined]
        assert f"## mbtune {name}\n" in rendered


def test_the_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the depth into docs/")


def _relative_links(text: str) -> list[str]:
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)  # fenced code holds examples, not links
    text = re.sub(r"`[^`\n]*`", "", text)  # so does inline code
    return [target for target in LINK.findall(text) if not SCHEME.match(target) and not target.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_in_the_readme_and_docs_points_to_a_file(page):
    broken = [target for target in _relative_links(page.read_text())
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to files that do not exist: {broken}"


def test_the_docs_link_checker_sees_links():
    found = _relative_links("See [a](docs/a.md#part), [b](https://x.org), [c](#here) and `[d](e.md)`.\n"
                            "```\n[f](g.md)\n```\n")
    assert found == ["docs/a.md#part"]
