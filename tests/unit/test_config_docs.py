"""engine/docs/configuration.md's key reference is the schema's own docs (engine/config/reference.py,
written by scripts/config_docs.py): the committed page equals a fresh rendering, every key of
``--help`` has a row with the same type, default and doc, and the prose outside the markers is the
page's own. Torch-free and in-process: well under a second."""

from __future__ import annotations

import difflib
import os
import re

import pytest

from engine.config import CONFIG_KEYS, format_help
from engine.config.reference import BEGIN, END, PAGE, REGENERATE, reference_markdown, render_page
from tests.doc_blocks import REPO

_HELP_LINE = re.compile(r"^  --(\S+)  \((\w+), default: (.*?)\)  (.*)$")


def _page() -> str:
    with open(os.path.join(REPO, PAGE), encoding="utf-8") as f:
        return f.read()


def test_the_committed_page_equals_the_schema_rendering():
    """Regenerate in memory and compare; on a difference, name the command that regenerates the page."""
    text = _page()
    rendered = render_page(text)
    diff = "".join(list(difflib.unified_diff(text.splitlines(True), rendered.splitlines(True), PAGE,
                                             "rendered from engine/config/schema*.py", n=0))[:40])
    assert rendered == text, f"{PAGE} differs from the schema; regenerate it: {REGENERATE}\n{diff}"


def _unescape(cell: str) -> str:
    return cell.replace(r"\|", "|").replace("&lt;", "<").replace(r"\*", "*")


def test_every_help_line_has_a_row_with_its_type_default_and_doc():
    """The help printer (engine/config/loading.py ``format_help``) is the oracle: each of its key lines has
    one row in the reference with the same type, default and doc (whitespace runs aside)."""
    rows = {}
    for line in reference_markdown().splitlines():
        cells = re.split(r"(?<!\\)\|", line)
        if len(cells) == 6 and cells[1].strip().startswith("`") and "." in cells[1]:
            key = cells[1].strip().strip("`")
            assert key not in rows, f"{key} has two rows"
            rows[key] = tuple(_unescape(c.strip()) for c in cells[2:5])
    helped = [m.groups() for m in map(_HELP_LINE.match, format_help().splitlines()) if m]
    assert [key for key, *_ in helped] == list(CONFIG_KEYS) == list(rows), "the rows are not --help's keys in order"
    for key, kind, default, doc in helped:
        assert rows[key] == (kind, f"`{default}`", " ".join(doc.split())), key


def test_prose_outside_the_markers_is_kept_and_a_page_without_them_is_refused():
    """Only the part between the markers is replaced; what precedes and follows stays byte for byte."""
    page = f"# Title\n\nprose before\n\n{BEGIN}\nstale rows\n{END}\n\nprose after\n"
    rendered = render_page(page)
    assert rendered == f"# Title\n\nprose before\n\n{BEGIN}\n{reference_markdown()}{END}\n\nprose after\n"
    assert render_page(rendered) == rendered
    for broken in ("# no markers\n", f"{END}\n{BEGIN}\n", f"{BEGIN}\n{BEGIN}\n{END}\n"):
        with pytest.raises(ValueError, match="needs one line"):
            render_page(broken)


def test_the_script_checks_and_rewrites_a_page(tmp_path, capsys):
    """``scripts/config_docs.py --check`` exits 1 naming the command on a stale page, which the plain
    command then rewrites (prose kept); a page without markers exits 2."""
    from scripts.config_docs import main

    page = tmp_path / "configuration.md"
    page.write_text(f"intro\n{BEGIN}\n| `job.device` | str | `\"cpu\"` | stale |\n{END}\nend\n", encoding="utf-8")
    assert main(["--check", "--page", str(page)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--page", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == f"intro\n{BEGIN}\n{reference_markdown()}{END}\nend\n"
    assert main(["--check", "--page", str(page)]) == 0
    page.write_text("no markers\n", encoding="utf-8")
    assert main(["--check", "--page", str(page)]) == 2
