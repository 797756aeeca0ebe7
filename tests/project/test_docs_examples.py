"""Every ```python block of the README and of the docs pages runs as it is written."""

import re

import pytest

from repository import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _blocks():
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer(page.read_text())):
            yield pytest.param(match[1], id=f"{page.relative_to(ROOT)}:{number}")


def test_readme_opens_with_a_python_example():
    assert BLOCK.search((ROOT / "README.md").read_text()), "README.md has no ```python block"


@pytest.mark.parametrize("code", list(_blocks()))
def test_example_runs(code, capsys):
    exec(compile(code, "<example>", "exec"), {"__name__": "__example__"})
    printed = capsys.readouterr().out
    if "print(" in code:  # what an example prints is what a reader is told to expect
        assert printed.strip(), "the example prints nothing"
        assert not re.search(r"\bnan\b", printed, re.IGNORECASE), printed
