"""The repository's GitHub owner, in one place: `python notebooks/publish.py --owner NAME`.

The Colab badges, the notebooks' install cells, the README, the docs and pyproject's
URLs all name ``github.com/OWNER/optax_snoo``; until the repository is published OWNER is
the placeholder ``your-org``. A notebook opened on Colab cannot read a file of the
repository before cloning it, so the owner has to be written into each notebook; this
script is the one thing to run on publishing: it rewrites the owner everywhere and
regenerates every notebook's badge line and install cell from the templates below
(``tests/project/test_publish.py`` checks that all of them agree).

    python notebooks/publish.py --owner my-github-name   # rewrite
    python notebooks/publish.py --check                  # exit 1 if anything disagrees
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "optax_snoo"
PLACEHOLDER = "your-org"
OWNER_PATTERN = re.compile(r"github(?:\.com)?/([A-Za-z0-9_.-]+)/" + NAME)
BADGE_PATTERN = re.compile(r"^\[!\[Open In Colab\]\(.*$", re.MULTILINE)

INSTALL_CELL = '''\
# Set-up. The trainer (train/) and the model (models/) are not in the wheel: they run from a
# checkout of the repository. In a checkout this uses it; elsewhere (Colab) it clones the
# repository. Where optax_snoo or flax is not importable yet, it pip-installs the checkout
# with the `train` extra. (Cell written by notebooks/publish.py.)
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

REPOSITORY = "https://github.com/{owner}/optax_snoo"


def find_checkout(folder: Path) -> Path | None:
    for candidate in (folder, *folder.parents):
        if (candidate / "optax_snoo" / "__init__.py").is_file() and (candidate / "train").is_dir():
            return candidate
    return None


ROOT = find_checkout(Path.cwd())
if ROOT is None:  # Colab, or a notebook opened outside a checkout
    ROOT = Path.cwd() / "optax_snoo"
    if not ROOT.exists():
        subprocess.check_call(["git", "clone", "--depth=1", REPOSITORY, str(ROOT)])
if importlib.util.find_spec("optax_snoo") is None or importlib.util.find_spec("flax") is None:
    packages = ["-e", f"{{ROOT}}[train]"]
    if shutil.which("nvidia-smi"):  # a GPU runtime: jax's CUDA wheels, matching its version
        packages.append("jax[cuda12]")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *packages])
    importlib.invalidate_caches()
sys.path.insert(0, str(ROOT))  # optax_snoo, models, train and benchmarks from the checkout
print("checkout:", ROOT)'''


def badge(owner: str, notebook: str) -> str:
    """The "Open in Colab" badge line of one notebook (a file name in notebooks/)."""
    return ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/{owner}/{NAME}/blob/main/"
            f"notebooks/{notebook})")


def install_cell(owner: str) -> str:
    """The install cell every notebook starts with (its second cell)."""
    return INSTALL_CELL.format(owner=owner)


def text_files() -> list[Path]:
    """Files outside the notebooks that name the repository."""
    return [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "docs" / "conf.py",
            *sorted((ROOT / "docs").glob("*.md"))]


def notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("*.ipynb"))


def owners() -> dict[str, set[str]]:
    """Every owner named in a repository URL, per file (relative path)."""
    found = {}
    for path in text_files() + notebooks():
        if path.is_file():
            found[str(path.relative_to(ROOT))] = set(OWNER_PATTERN.findall(path.read_text()))
    return found


def current_owner() -> str:
    """The one owner all files name; a `ValueError` lists the files if they disagree."""
    names = set().union(*owners().values())
    if len(names) != 1:
        raise ValueError(f"the files name {len(names)} owners, expected 1: {owners()}")
    return names.pop()


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _set_source(cell: dict, text: str) -> None:
    lines = text.split("\n")
    cell["source"] = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def notebook_problems(path: Path, owner: str) -> list[str]:
    """What differs in one notebook from its badge and install cell for `owner`."""
    cells = json.loads(path.read_text())["cells"]
    problems = []
    if badge(owner, path.name) not in _source(cells[0]).splitlines():
        problems.append(f"{path.name}: cell 0 lacks the line {badge(owner, path.name)!r}")
    if cells[1]["cell_type"] != "code" or _source(cells[1]) != install_cell(owner):
        problems.append(f"{path.name}: cell 1 is not the install cell of publish.py")
    return problems


def rewrite(owner: str) -> None:
    """Names `owner` in every file and regenerates the notebooks' badges and install cells."""
    if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?", owner):
        raise ValueError(f"owner={owner!r} is not a GitHub user or organisation name")
    for path in text_files():
        if path.is_file():
            text = path.read_text()
            path.write_text(OWNER_PATTERN.sub(
                lambda m: m.group(0).replace(f"/{m.group(1)}/", f"/{owner}/"), text))
    for path in notebooks():
        notebook = json.loads(path.read_text())
        cells = notebook["cells"]
        head, line = _source(cells[0]), badge(owner, path.name)
        if BADGE_PATTERN.search(head):
            head = BADGE_PATTERN.sub(lambda _, line=line: line, head, count=1)
        else:  # after the title line
            title, _, rest = head.partition("\n")
            head = f"{title}\n\n{line}\n{rest}"
        _set_source(cells[0], head)
        if _source(cells[1]).startswith("# Set-up.") or "google.colab" in _source(cells[1]):
            _set_source(cells[1], install_cell(owner))
        else:
            cells.insert(1, {"cell_type": "code", "execution_count": None,
                             "id": f"{path.stem}-setup", "metadata": {}, "outputs": [],
                             "source": []})
            _set_source(cells[1], install_cell(owner))
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--owner", help="GitHub user or organisation that hosts the repository")
    group.add_argument("--check", action="store_true", help="only check that all files agree")
    args = parser.parse_args(argv)
    if args.owner:
        rewrite(args.owner)
    owner = current_owner()
    problems = [p for path in notebooks() for p in notebook_problems(path, owner)]
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"owner {owner!r} in every file")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
