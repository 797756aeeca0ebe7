"""What the wheel holds and what each part needs: the library alone, the trainer with its
`train` extra."""

import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from repository import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TRAIN_EXTRA_MODULES = ("flax", "orbax", "tqdm", "matplotlib")


def _blocking(modules, statement):
    """Python source that makes `modules` unimportable, then runs `statement`."""
    return (f"import sys\nfor name in {tuple(modules)!r}:\n    sys.modules[name] = None\n"
            f"{statement}\n")


def _python(source, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", source], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_setuptools_ships_every_library_package_and_nothing_else():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {str(init.parent.relative_to(ROOT)).replace("/", ".")
               for init in (ROOT / "optax_snoo").rglob("__init__.py")}
    assert listed == on_disk, f"pyproject lists {sorted(listed)}, the tree has {sorted(on_disk)}"
    assert PYPROJECT["tool"]["setuptools"]["package-data"] == {"optax_snoo": ["py.typed"]}


def test_wheel_has_only_optax_snoo_at_the_top_level(tmp_path):
    # Built without build isolation (no network): needs setuptools >= 77 (the dev extra),
    # from a copy of the sources, so no build/ left over in the checkout can leak in.
    pytest.importorskip("setuptools", minversion="77")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "optax_snoo", source / "optax_snoo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)], check=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"optax_snoo", "optax_snoo-0.1.0.dist-info"}
    assert "optax_snoo/py.typed" in names
    assert "optax_snoo/_src/kfac/transform.py" in names
    metadata = zipfile.ZipFile(wheel).read("optax_snoo-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    requires = {line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert {r.split(">=")[0] for r in requires} == {"jax", "jaxlib", "optax", "numpy"}


def test_library_dependencies_are_jax_optax_numpy_with_lower_bounds():
    dependencies = PYPROJECT["project"]["dependencies"]
    assert {d.split(">=")[0] for d in dependencies} == {"jax", "jaxlib", "optax", "numpy"}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {d.split(">=")[0] for d in extras["train"]} == {
        "flax", "orbax-checkpoint", "tqdm", "matplotlib"}
    for requirement in dependencies + [d for group in extras.values() for d in group]:
        assert ">=" in requirement, f"{requirement!r} has no lower bound"


def test_library_imports_without_the_train_extra_or_chex():
    statement = ("import optax_snoo, optax_snoo.kfac, optax_snoo.recipes\n"
                 "assert not any(m.split('.')[0] in ('flax', 'orbax', 'tqdm', 'matplotlib',"
                 " 'models', 'train') for m in sys.modules if sys.modules[m] is not None)\n"
                 "print('ok')")
    # chex is not a dependency (optax no longer needs it): the library must not import it.
    result = _python(_blocking((*TRAIN_EXTRA_MODULES, "chex"), statement))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("module", TRAIN_EXTRA_MODULES)
def test_train_without_its_extra_names_the_extra(module):
    result = _python(_blocking([module], "import train"))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: the trainer needs the 'train' extra"), last
    assert module in last and "pip install -e '.[train]'" in last, last


def test_train_with_its_extra_exports_its_api():
    result = _python("import train\nprint(all(hasattr(train, n) for n in train.__all__))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_license_file_matches_pyproject():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    urls = PYPROJECT["project"]["urls"]
    assert all(url.startswith("https://github.com/") for url in urls.values())
