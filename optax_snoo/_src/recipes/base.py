"""The recipe object: a named optimizer stack, its hyperparameters and what a trainer reads.

A `Recipe` is one home for everything a library user, a trainer and a benchmark need of an
optimizer stack:

- its hyperparameters: a frozen `Hyperparameters` dataclass, one field per constant, each
  with its default, one line of help and its valid range (the record's constants as data);
  step constants are written at the record's length and `Hyperparameters.scaled` rescales
  them to a run of ``total_steps``;
- `Recipe.stack`: for ``total_steps`` and any hyperparameters, a `Stack`: the
  transformation, the learning-rate schedule a trainer logs, Snoo's (or MuLoCo's) sync
  period and phase, the parameter groups (`Stack.groups`) and whether the evaluated
  weights are a readout of the state (`optax_snoo.eval_params`);
- calling the recipe, ``recipe(total_steps, **hyperparameters)``, gives the
  transformation alone.

A name a recipe does not know, a value out of range, or a hyperparameter that the chosen
settings do not read (``cooldown_frac`` with ``schedule="cosine"``) is refused in one line
that names it. `REGISTRY` holds every recipe of the library by name; `with_snoo` wraps
a recipe in Snoo's outer step as a new recipe.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import optax

from optax_snoo._src.snoo import snoo

__all__ = [
    "REGISTRY",
    "Hyperparameters",
    "Recipe",
    "Stack",
    "get",
    "hyperparameter",
    "register",
    "with_snoo",
]

# rule -> (test of a value, what an error says was expected); `None` always passes.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: 0 < v < math.inf, "a finite number > 0"),
    "non_negative": (lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    "unit_interval": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "fraction": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "positive_fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "at_least_1": (lambda v: v >= 1, "an integer >= 1"),
    "at_least_0": (lambda v: v >= 0, "an integer >= 0"),
}


def hyperparameter(default: Any, help: str, *, check: str | None = None,
                   choices: tuple[str, ...] | None = None, steps: bool = False,
                   read_when: tuple[str, Any] | None = None) -> Any:
    """A field of a `Hyperparameters` table.

    Args:
      default: the value (the record's, for a record's recipe).
      help: one line: what it is, in the source's words.
      check: a range rule (``"positive"``, ``"non_negative"``, ``"unit_interval"``,
        ``"fraction"``, ``"positive_fraction"``, ``"at_least_1"``, ``"at_least_0"``).
      choices: the allowed strings.
      steps: a step count (or horizon) at the table's ``RECORD_STEPS``:
        `Hyperparameters.scaled` rescales it to the run's length.
      read_when: ``(field, value)``: the stack reads this hyperparameter only while
        ``field == value`` (setting it otherwise is refused, see `Recipe.resolve`).
    """
    if check is not None and check not in _CHECKS:
        raise ValueError(f"check={check!r}: expected one of {sorted(_CHECKS)}")
    return dataclasses.field(default=default, metadata=dict(
        help=help, check=check, choices=choices, steps=steps, read_when=read_when))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _allowed(tp: Any) -> tuple[Any, ...]:
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return typing.get_args(tp) if union else (tp,)


def _type_name(tp: Any) -> str:
    return " | ".join("None" if a is type(None) else a.__name__ for a in _allowed(tp))


def _fits(tp: Any, value: Any) -> bool:
    for a in _allowed(tp):
        if a is type(None) and value is None:
            return True
        if a is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if a in (bool, str) and isinstance(value, a):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """A recipe's constants: subclass as a frozen dataclass of `hyperparameter` fields.

    Construction checks every field's type (an ``int`` passes for a ``float``), range and
    choices, then `validate` (cross-field rules). Step fields (``steps=True``) hold the
    values at ``RECORD_STEPS``; `scaled` rescales them.
    """

    #: The run length the step fields are written at (``None``: they are absolute).
    RECORD_STEPS: ClassVar[int | None] = None

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if not _fits(hints[f.name], value):
                raise ValueError(f"{f.name}={value!r}: expected {_type_name(hints[f.name])}")
            if meta.get("choices") and value not in meta["choices"]:
                raise ValueError(f"{f.name}={value!r}: expected one of {list(meta['choices'])}")
            if meta.get("check") and value is not None:
                test, expected = _CHECKS[meta["check"]]
                if not test(value):  # NaN fails every test
                    raise ValueError(f"{f.name}={value!r}: expected {expected}")
        self.validate()

    def validate(self) -> None:
        """Cross-field rules of the table (raise ``ValueError`` naming the values)."""

    def scaled(self, total_steps: int) -> Hyperparameters:
        """The table for a run of ``total_steps``: each step field ``x`` becomes
        ``round(x·total_steps/RECORD_STEPS)`` (a float field ``x·total_steps/RECORD_STEPS``),
        so every phase keeps its fraction of the run. Unchanged without ``RECORD_STEPS``."""
        if self.RECORD_STEPS is None or total_steps == self.RECORD_STEPS:
            return self
        return dataclasses.replace(self, **self.scaled_steps(total_steps))

    def scaled_steps(self, total_steps: int) -> dict[str, Any]:
        """The step fields' values at ``total_steps`` (what `scaled` sets, before the
        table's checks): each ``x`` as ``round(x·total_steps/RECORD_STEPS)``. A table
        whose step constants must stay on a common grid overrides it."""
        hints, ratio = _hints(type(self)), total_steps / self.RECORD_STEPS
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("steps") and value is not None:
                values[f.name] = value * ratio if float in _allowed(hints[f.name]) else round(
                    value * ratio)
        return values

    def read(self) -> dict[str, Any]:
        """Every hyperparameter the stack reads with these settings, with its value: what
        a run's configuration records."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if _is_read(self, f)}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The hyperparameters' names, in the table's order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str]]:
        """``(name, type, default, help)`` of every hyperparameter (for ``--help``)."""
        hints = _hints(cls)
        return [(f.name, _type_name(hints[f.name]), f.default, f.metadata["help"])
                for f in dataclasses.fields(cls)]


def _is_read(table: Hyperparameters, f: dataclasses.Field) -> bool:
    condition = f.metadata.get("read_when")
    return condition is None or getattr(table, condition[0]) == condition[1]


@dataclasses.dataclass(frozen=True)
class Stack:
    """What a recipe builds for one run: the transformation and what a trainer needs of it.

    Attributes:
      tx: the transformation (``update`` needs ``params``; see `update_args`).
      learning_rate: the schedule of the main group's applied learning rate (the one a
        trainer logs: Muon's for the Muon stacks).
      sync_every: Snoo's (MuLoCo's) period ``k`` when the stack is wrapped in it, else
        ``None``; pass ``snoo_sync=optax_snoo.snoo_is_sync_step(t, k, sync_phase)`` to
        ``update`` for a static sync.
      sync_phase: Snoo's ``sync``: ``"start"`` or ``"end"`` (MuLoCo).
      groups: ``params -> tree of group names`` (``None``: one group), what
        `optax_snoo.recipes.describe` prints.
      readout: whether the weights to evaluate and save are
        ``optax_snoo.eval_params(params, state)`` rather than ``params`` (a tail EMA or
        EMA-Nesterov in the stack).
      update_args: keyword arguments ``update`` needs besides ``params`` (Newton-Muon's
        ``input_covariance``, K-FAC's ``curvature``).
    """

    tx: optax.GradientTransformationExtraArgs
    learning_rate: optax.Schedule
    sync_every: int | None = None
    sync_phase: str = "start"
    groups: Callable[[Any], Any] | None = None
    readout: bool = False
    update_args: tuple[str, ...] = ()


#: `build(hyperparameters, total_steps, **options) -> Stack`.
Builder = Callable[..., Stack]


class Recipe:
    """A named optimizer stack with its hyperparameters (see the module docstring).

    Args:
      name: the registry name (the trainer's ``--optimizer``).
      hyperparameters: the `Hyperparameters` subclass; its defaults are the recipe's.
      build: ``build(table, total_steps, **options) -> Stack`` with the table already
        `scaled` to ``total_steps``.
      summary: one line saying what the recipe is and where it comes from.
      options: the keyword arguments that place the stack on a tree, not hyperparameters
        (``labels``, ``adam_patterns``, ``newton_schulz_plan``...), with their defaults.
      min_steps: the fewest ``total_steps`` it accepts; ``None``: the smallest run whose
        scaled table still passes its checks (its step constants >= 1 and in order).
      record_steps: the length of the source's own run, the default ``total_steps``
        (``None``: ``total_steps`` must be given).

    Example:
      >>> from optax_snoo import recipes
      >>> recipe = recipes.get("track3_baseline")
      >>> stack = recipe.stack(3250, muon_learning_rate=0.03)
      >>> round(float(stack.learning_rate(0)), 4), stack.sync_every
      (0.03, None)
      >>> recipe.resolve(muon_learning_rate=0.03).muon_weight_decay
      0.05
    """

    def __init__(self, name: str, hyperparameters: type[Hyperparameters], build: Builder, *,
                 summary: str, options: Mapping[str, Any] | None = None,
                 min_steps: int | None = None, record_steps: int | None = None):
        if not (isinstance(hyperparameters, type) and issubclass(hyperparameters, Hyperparameters)):
            raise ValueError(f"recipe {name!r}: hyperparameters must be a Hyperparameters "
                             f"subclass, got {hyperparameters!r}")
        self.name, self.hyperparameters, self._build = name, hyperparameters, build
        self.summary = summary
        self.options = dict(options or {})
        clash = set(self.options) & set(hyperparameters.names())
        if clash:
            raise ValueError(f"recipe {name!r}: {sorted(clash)} are both options and "
                             "hyperparameters")
        self._min_steps = min_steps
        self.record_steps = record_steps or hyperparameters.RECORD_STEPS

    def __repr__(self) -> str:
        return f"Recipe({self.name!r})"

    @property
    def defaults(self) -> Hyperparameters:
        """The table of defaults."""
        return self.hyperparameters()

    def resolve(self, **values: Any) -> Hyperparameters:
        """The table with ``values`` in place of defaults, checked.

        Raises:
          ValueError: in one line, an unknown name (with close matches and the recipe's
            own), a bad value, or a value given for a hyperparameter these settings do
            not read (``read_when``).
        """
        names = self.hyperparameters.names()
        for name in values:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ValueError(f"{name!r} is not a hyperparameter of recipe {self.name}"
                                 f"{hint}; its hyperparameters: {', '.join(names)}")
        try:
            table = self.hyperparameters(**values)
        except ValueError as err:
            raise ValueError(f"recipe {self.name}: {err}") from None
        fields = {f.name: f for f in dataclasses.fields(table)}
        for name in values:
            condition = fields[name].metadata.get("read_when")
            if condition and not _is_read(table, fields[name]):
                field, wanted = condition
                raise ValueError(
                    f"recipe {self.name}: {name} is read only with {field}={wanted!r}, not "
                    f"{field}={getattr(table, field)!r}; drop {name} or set {field}")
        return table

    @functools.cached_property
    def min_steps(self) -> int:
        """The fewest ``total_steps`` `stack` accepts."""
        if self._min_steps is not None:
            return self._min_steps
        defaults = self.defaults
        if defaults.RECORD_STEPS is None:
            return 1
        for n in range(1, defaults.RECORD_STEPS + 1):
            try:
                defaults.scaled(n).validate()
                return n
            except ValueError:
                continue
        return defaults.RECORD_STEPS

    def _split(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        options = {k: v for k, v in kwargs.items() if k in self.options}
        values = {k: v for k, v in kwargs.items() if k not in self.options}
        return values, {**self.options, **options}

    def check_steps(self, total_steps: Any, table: Hyperparameters | None = None) -> None:
        """Refuse a run shorter than the recipe's minimum, in one line."""
        if not isinstance(total_steps, int) or isinstance(total_steps, bool):
            raise ValueError(f"recipe {self.name}: total_steps={total_steps!r}: expected an "
                             "integer")
        minimum = self.min_steps
        if total_steps < minimum:
            why = (f"its step constants, written at {self.defaults.RECORD_STEPS} steps, are "
                   f"scaled by total_steps/{self.defaults.RECORD_STEPS} and must stay >= 1 "
                   f"and in order" if self.defaults.RECORD_STEPS else "its schedule")
            raise ValueError(f"recipe {self.name}: total_steps={total_steps} is below its "
                             f"minimum of {minimum} ({why})")
        if table is not None and table.RECORD_STEPS is not None:
            try:
                table.scaled(total_steps).validate()
            except ValueError as err:
                raise ValueError(f"recipe {self.name}: at total_steps={total_steps}: {err}"
                                 ) from None

    def stack(self, total_steps: int | None = None, **kwargs: Any) -> Stack:
        """The `Stack` for a run of ``total_steps`` updates.

        Args:
          total_steps: the run's length (its schedules end there); ``None``: the source's
            own (`record_steps`).
          **kwargs: hyperparameters (see `hyperparameters`) and options (see `options`).

        Raises:
          ValueError: see `resolve`; a ``total_steps`` below `min_steps`.
        """
        values, options = self._split(kwargs)
        table = self.resolve(**values)
        if total_steps is None:
            if self.record_steps is None:
                raise ValueError(f"recipe {self.name}: give total_steps (the run's length)")
            total_steps = self.record_steps
        self.check_steps(total_steps, table)
        return self._build(table.scaled(total_steps), total_steps, **options)

    def __call__(self, total_steps: int | None = None, **kwargs: Any
                 ) -> optax.GradientTransformationExtraArgs:
        """``stack(total_steps, **kwargs).tx``: the transformation alone."""
        return self.stack(total_steps, **kwargs).tx


#: Every recipe of the library by name (the trainer's ``--optimizer`` names).
REGISTRY: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to `REGISTRY` (names are unique); returns it."""
    if recipe.name in REGISTRY:
        raise ValueError(f"recipe {recipe.name!r} is already registered")
    REGISTRY[recipe.name] = recipe
    return recipe


def get(name: str) -> Recipe:
    """The registered recipe ``name``.

    Raises:
      ValueError: an unknown name, with close matches and the registry.
    """
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, REGISTRY, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"recipe {name!r} is unknown{hint}; the recipes are "
                         f"{', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class SnooHyperparameters(Hyperparameters):
    """Snoo's outer Nesterov step (`optax_snoo.snoo`)."""

    snoo_learning_rate: float = hyperparameter(0.68, "Snoo's outer learning rate eta",
                                               check="positive")
    snoo_momentum: float = hyperparameter(0.37, "Snoo's outer Nesterov momentum mu",
                                          check="unit_interval")
    snoo_k: int = hyperparameter(28, "Snoo's sync period: updates between outer steps",
                                 check="at_least_1")


def _combined(name: str, inner: type[Hyperparameters], outer: type[Hyperparameters],
              defaults: Mapping[str, Any]) -> type[Hyperparameters]:
    """``inner``'s fields, then ``outer``'s, with ``defaults`` replacing theirs."""
    hints = {**_hints(inner), **_hints(outer)}
    fields = []
    for f in (*dataclasses.fields(inner), *dataclasses.fields(outer)):
        default = defaults.get(f.name, f.default)
        fields.append((f.name, hints[f.name], dataclasses.field(default=default,
                                                                metadata=f.metadata)))
    unknown = set(defaults) - {f[0] for f in fields}
    if unknown:
        raise ValueError(f"{name}: defaults for unknown hyperparameters {sorted(unknown)}")

    def validate(self):
        inner.validate(self)
        outer.validate(self)

    cls = dataclasses.make_dataclass(name, fields, bases=(Hyperparameters,), frozen=True,
                                     namespace={"RECORD_STEPS": inner.RECORD_STEPS,
                                                "validate": validate,
                                                "__doc__": f"{inner.__doc__} Then Snoo."})
    cls.__module__ = __name__
    return cls


def with_snoo(inner: Recipe, name: str | None = None, *, sync: str = "start",
              summary: str | None = None, **defaults: Any) -> Recipe:
    """``inner`` wrapped in Snoo's outer step, as a recipe of its own.

    The hyperparameters are ``inner``'s plus ``snoo_learning_rate``, ``snoo_momentum`` and
    ``snoo_k`` (`optax_snoo.snoo`'s ``learning_rate``, ``momentum``, ``k``);
    ``defaults`` replace any of their defaults. ``sync="end"`` syncs after every k-th
    update (MuLoCo); the option ``replica_axis`` is Snoo's (DiLoCo's replicas).

    Args:
      inner: the recipe to wrap.
      name: the new recipe's name (default ``"snoo_" + inner.name``).
      sync: Snoo's ``sync`` phase.
      summary: its one line (default: ``inner``'s, wrapped in Snoo).
      **defaults: new defaults of any hyperparameter.

    Returns:
      A `Recipe` (not registered).
    """
    name = name or f"snoo_{inner.name}"
    table = _combined(f"{name}_hyperparameters", inner.hyperparameters, SnooHyperparameters,
                      defaults)
    snoo_names = set(SnooHyperparameters.names())

    def build(table: Hyperparameters, total_steps: int, *, replica_axis: str | None = None,
              **options: Any) -> Stack:
        values = {f.name: getattr(table, f.name) for f in dataclasses.fields(table)
                  if f.name not in snoo_names}
        # The table is scaled already: build the inner stack from its scaled values.
        stack = inner._build(inner.hyperparameters(**values), total_steps, **options)
        tx = snoo(stack.tx, table.snoo_learning_rate, table.snoo_momentum, table.snoo_k,
                  replica_axis=replica_axis, sync=sync)
        return dataclasses.replace(stack, tx=tx, sync_every=table.snoo_k, sync_phase=sync)

    return Recipe(name, table, build,
                  summary=summary or f"Snoo's outer Nesterov step around {inner.name}: "
                  f"{inner.summary}",
                  options={**inner.options, "replica_axis": None},
                  min_steps=inner._min_steps, record_steps=inner.record_steps)
