"""Sphinx configuration: `python -m sphinx -W -b html docs docs/_build/html`.

Two things are generated at build time, so that they cannot go stale: the API pages (one
entry per name in each public module's `__all__`) and the trainer's flag lists (the
output of `python -m train --help` and of its `sample`/`evaluate`/`prepare` tools).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

from sphinx.pycode import ModuleAnalyzer

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"
sys.path.insert(0, str(ROOT))

import optax_snoo  # noqa: E402 (from this checkout)

project = "optax_snoo"
author = "the optax_snoo authors"
copyright = "2026, the optax_snoo authors"
REPOSITORY = "https://github.com/your-org/optax_snoo"  # notebooks/publish.py sets the owner

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_generated/*.txt", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # NamedTuple fields: documented once, by autodoc
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": False}

html_theme = "furo"
html_title = "optax_snoo"
html_theme_options = {"source_repository": REPOSITORY + "/", "source_branch": "main",
                      "source_directory": "docs/"}

# No network at build time: no intersphinx.

PUBLIC_MODULES = {
    "optax_snoo": "The transformations",
    "optax_snoo.kfac": "optax_snoo.kfac",
    "optax_snoo.labels": "optax_snoo.labels",
    "optax_snoo.rounding": "optax_snoo.rounding",
    "optax_snoo.memory": "optax_snoo.memory",
    "optax_snoo.recipes": "optax_snoo.recipes",
}


def _data_doc(module, name: str) -> str:
    """The ``#:`` comment before (or string after) a constant's definition, in the module
    of the package that defines it (a constant has no ``__doc__`` of its own: its type's
    would be shown, "A dict.").

    Raises:
      RuntimeError: the constant has none, so the build fails rather than show nothing.
    """
    obj = getattr(module, name)
    package = module.__name__.split(".")[0]  # `optax_snoo.kfac.PHASES` is in `optax_snoo._src`
    for source in sorted(m for m in sys.modules if m.split(".")[0] == package):
        if getattr(sys.modules[source], name, None) is obj:
            docs = ModuleAnalyzer.for_module(source).find_attr_docs()
            if ("", name) in docs:
                return "\n".join(docs[("", name)]).strip()
    raise RuntimeError(f"{module.__name__}.{name}: no ``#:`` comment where it is defined; "
                       "write one (the API page shows it)")


# A constant's value is shown beside its name when its repr fits on a line.
_LONGEST_VALUE = 80


def _recipe_directive(name: str, recipe) -> str:
    """A recipe's entry: its summary, its options and a table of its hyperparameters (name,
    type, default, help), generated from the recipe itself."""
    steps = (f" Its source's run: {recipe.record_steps} steps." if recipe.record_steps
             else "") + f" Fewest steps: {recipe.min_steps}."
    options = ", ".join(f"``{o}``" for o in recipe.options) or "none"
    lines = [f".. py:data:: {name}", "", f"   A recipe: {recipe.summary}.{steps}", "",
             f"   Options: {options}. Hyperparameters (the trainer's ``--NAME`` flags of "
             "``--optimizer=" + recipe.name + "``):", "", "   .. list-table::",
             "      :header-rows: 1", "", "      * - name", "        - type",
             "        - default", "        - meaning"]
    for field, tp, default, help_ in recipe.hyperparameters.describe():
        lines += [f"      * - ``{field}``", f"        - {tp}", f"        - ``{default!r}``",
                  f"        - {_code_spans(help_)}"]
    return "\n".join(lines) + "\n"


def _directive(module, name: str) -> str | None:
    obj = getattr(module, name)
    target = f"{module.__name__}.{name}"
    if isinstance(obj, optax_snoo.recipes.Recipe):
        return _recipe_directive(name, obj)
    if module.__name__ != "optax_snoo" and getattr(optax_snoo, name, None) is obj:
        # Re-exported by the package: described once, on its page; named here too, so
        # that references to either name resolve.
        kind, role = (("class", "class") if inspect.isclass(obj)
                      else ("function", "func") if callable(obj) else ("data", "data"))
        signature = ""
        if callable(obj):
            try:
                signature = re.sub(r"\s+", " ", str(inspect.signature(obj)).split(" -> ")[0])
            except (TypeError, ValueError):
                signature = "(...)"
        return (f".. py:{kind}:: {name}{signature}\n   :module: {module.__name__}\n\n"
                f"   The same object as :{role}:`optax_snoo.{name}`.\n")
    if inspect.ismodule(obj):
        return None  # documented on its own page
    if inspect.isclass(obj):
        return f".. autoclass:: {target}\n   :members:\n"
    if callable(obj):
        return f".. autofunction:: {target}\n"
    doc = "\n".join("   " + line for line in _data_doc(module, name).splitlines())
    value = repr(obj)
    shown = f"   :value: {value}\n" if len(value) <= _LONGEST_VALUE else ""
    return f".. py:data:: {name}\n{shown}\n{doc}\n"  # the page's module prefixes it


def write_api_pages() -> None:
    """docs/_generated/api_<module>.rst: every name of the module's `__all__`.

    reStructuredText, not MyST: autodoc parses the docstrings with the page's parser, and
    the docstrings are reStructuredText (Google style through napoleon)."""
    for module_name, title in PUBLIC_MODULES.items():
        module = importlib.import_module(module_name)
        summary = inspect.getdoc(module).split("\n\n")[0]
        lines = [title, "=" * len(title), "", f".. module:: {module_name}", "", summary, ""]
        for name in module.__all__:
            directive = _directive(module, name)
            if directive:
                lines += [directive]
        page = GENERATED / f"api_{module_name.replace('.', '_')}.rst"
        page.write_text("\n".join(lines))


def write_cli_help() -> None:
    """docs/_generated/<tool>_help.txt: the trainer's own --help output."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for tool in ("train", "train.sample", "train.evaluate", "train.prepare"):
        result = subprocess.run([sys.executable, "-m", tool, "--help"], cwd=ROOT, env=env,
                                capture_output=True, text=True, check=False, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"python -m {tool} --help failed:\n{result.stderr}")
        (GENERATED / f"{tool.replace('.', '_')}_help.txt").write_text(result.stdout)


# The docstrings write code in single backticks, Markdown's habit (`x = p + u`,
# `jax.ShapeDtypeStruct`s); reStructuredText would read those as interpreted text, and
# rejects one followed by a letter. Read them as inline code, as their authors mean.
# Roles (:func:`x`), links (`text <url>`_) and ``literals`` are left alone.
_CODE_SPAN = re.compile(r"(?<![`:\w\\])`([^`\n<>]+)`(?![`_])(\w?)")


def _code_spans(line: str) -> str:
    return _CODE_SPAN.sub(lambda m: f"``{m[1]}``" + (f"\\ {m[2]}" if m[2] else ""), line)


def _markdown_code_to_rst(app, what, name, obj, options, lines) -> None:
    in_example = False
    for i, line in enumerate(lines):
        stripped = line.strip()
        in_example = stripped.startswith((">>>", "...")) or (in_example and stripped != "")
        if not in_example:
            lines[i] = _code_spans(line)


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _markdown_code_to_rst)


GENERATED.mkdir(exist_ok=True)
write_api_pages()
write_cli_help()
