"""The repository's owner is named the same everywhere, and every notebook starts with the
badge and the install cell of `notebooks/publish.py` (the one place that writes them)."""

import importlib.util
import json
import shutil

import pytest

from repository import ROOT

_spec = importlib.util.spec_from_file_location("publish", ROOT / "notebooks" / "publish.py")
publish = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(publish)


def test_one_owner_everywhere():
    owners = publish.owners()
    for name in ("README.md", "pyproject.toml", "docs/index.md"):
        assert owners.get(name), f"{name} names no github.com/OWNER/optax_snoo URL"
    for path in publish.notebooks():
        assert owners[str(path.relative_to(ROOT))], path
    assert publish.current_owner() == "your-org"


@pytest.mark.parametrize("path", publish.notebooks(), ids=lambda p: p.name)
def test_notebook_has_the_published_badge_and_install_cell(path):
    assert publish.notebook_problems(path, publish.current_owner()) == []


def test_rewrite_changes_every_file_and_nothing_else(tmp_path, monkeypatch):
    copy = tmp_path / "repo"
    for path in publish.text_files() + publish.notebooks():
        if path.is_file():
            name = path.relative_to(ROOT)
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, copy / name)
    monkeypatch.setattr(publish, "ROOT", copy)
    before = {p: p.read_text() for p in copy.rglob("*") if p.is_file()}
    publish.rewrite("someone-else")
    assert publish.current_owner() == "someone-else"
    for path, text in before.items():
        after = path.read_text()
        assert after.replace("someone-else", "your-org") == text, path
        if path.suffix == ".ipynb":
            assert publish.notebook_problems(path, "someone-else") == []
            json.loads(after)
    with pytest.raises(ValueError, match="owner='a b'"):
        publish.rewrite("a b")
    publish.rewrite("your-org")
    assert {p: p.read_text() for p in before} == before
