"""The trainer's configuration: nested frozen dataclasses, named presets, flat `--key=value`.

`TrainConfig` holds one small dataclass per group: `model` (a `models.GPTConfig`, whose
`__post_init__` is the one validation of the model's fields; its `vocab_size` is set from
the corpus by `train.run`), `optimizer` (the recipe's name and the hyperparameters given
for it, clipping, rounding), `data`, `run`, `mesh`, `sample`. Each group validates its own
fields on construction.

The command line keeps one flat key per field (`--n_layer`, `--max_iters`...): `KEYS`
maps each flat key to its `(group, field)`. The optimizer's hyperparameters are the
chosen recipe's own (`optax_snoo.recipes`, under the library's argument names:
`--muon_learning_rate`, `--snoo_k`...): a flag that is neither a key nor a hyperparameter
of the chosen recipe is refused in one line that lists the recipe's own.
`override(config, **flat)` is the same from Python. `RENAMED` holds renamed flags and
optimizer names: given, each is refused in one line naming its new name.

Example:
  >>> config = parse_args(["--preset=shakespeare_char_cpu", "--max_iters=100"])
  >>> config.run.max_iters, config.model.n_layer
  (100, 4)
  >>> override(config, muon_learning_rate=0.01, n_layer=2).optimizer.hyperparameters
  {'muon_learning_rate': 0.01}

References:
  Karpathy, "nanoGPT" (train.py, configurator.py, config/train_shakespeare_char.py),
  https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from models import GPTConfig, resolve_attention, track3_config
from optax_snoo import recipes

__all__ = [
    "CHOICES",
    "COMPUTE_KEYS",
    "GROUPS",
    "KEYS",
    "PRESETS",
    "RENAMED",
    "DataConfig",
    "MeshConfig",
    "OptimizerConfig",
    "RunConfig",
    "SampleConfig",
    "TrainConfig",
    "config_from_dict",
    "config_help",
    "config_to_dict",
    "flat_dict",
    "get_preset",
    "group_fields",
    "model_config",
    "override",
    "parse_args",
]


def _field(default: Any, help: str, *, key: str | None = None,
           choices: tuple[str, ...] | None = None) -> Any:
    """A group field: its help, its flat command-line key (default: the field's name)
    and, for strings, the allowed values."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "key": key, "choices": choices})


def _key(group: Any, name: str) -> str:
    return next(f.metadata.get("key") or f.name for f in dataclasses.fields(group)
                if f.name == name)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# The range rules of `_validate`: rule -> (test of a value, what the error says is expected).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: v >= 1, "a positive integer"),
    "non_negative": (lambda v: v >= 0, "an integer >= 0"),
    "positive_float": (lambda v: 0 < v < math.inf, "a finite number > 0"),
    "non_negative_float": (lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    "unit_interval": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "fraction": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "positive_fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
}


def _validate(group: Any, **ranges: Sequence[str]) -> None:
    """Types and choices of every field of `group`, then the ranges: `rule=(field, ...)`
    for each rule of `_RANGES` (a field set to `None` passes); errors name the flat key."""
    for f in dataclasses.fields(group):
        if not f.metadata.get("flat", True):
            continue
        value = getattr(group, f.name)
        _check_type(_key(group, f.name), _hints(type(group))[f.name], value)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{_key(group, f.name)}={value!r}: expected one of {list(choices)}")
    for rule, names in ranges.items():
        test, expected = _RANGES[rule]
        for name in names:
            value = getattr(group, name)
            if value is not None and not test(value):  # NaN fails every test
                raise ValueError(f"{_key(group, name)}={value!r}: expected {expected}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Which recipe (`optax_snoo.recipes.REGISTRY`) with which hyperparameters, and what wraps
    it."""

    name: str = _field("snoo_muon", "the recipe, a name in optax_snoo.recipes.REGISTRY "
                       "(python -m train --optimizer=NAME --help lists its hyperparameters)",
                       key="optimizer")
    hyperparameters: dict[str, Any] = dataclasses.field(
        default_factory=dict, metadata={"help": "the recipe's hyperparameters given (the "
                                        "others at its defaults)", "key": None,
                                        "choices": None, "flat": False})
    grad_clip: float = _field(1.0, "global-norm clipping (0 = off)")
    rounding: str = _field("none", "rounding of bf16 params after each update (any "
                           "optimizer; float32 params pass through)",
                           choices=("none", "stochastic", "dithered"))
    qk_clip_tau: float = _field(0.0, "QK-clip (MuonClip): after each update, scale the query "
                                "and key heads whose max attention logit exceeded this back "
                                "to it (0 = off; Kimi K2 used 100)")
    loss_reduction: str = _field("mean", "the differentiated loss: mean token cross-entropy, "
                                 "or sum, its sum over the step's whole batch (modded-"
                                 "nanogpt Track 3's reduction='sum' + all_reduce(SUM); the "
                                 "track3 presets); Adam's eps and clipping see that scale",
                                 choices=("mean", "sum"))

    def __post_init__(self):
        _validate(self, non_negative_float=("grad_clip", "qk_clip_tau"))
        if self.name in RENAMED["optimizer"]:
            raise ValueError(f"--optimizer={self.name} was renamed "
                             f"--optimizer={RENAMED['optimizer'][self.name]}")
        if not isinstance(self.hyperparameters, Mapping):
            raise ValueError(f"hyperparameters={self.hyperparameters!r}: expected a dict")
        recipe = recipes.get(f"{self.name}")
        for key in self.hyperparameters:
            _check_hyperparameter(key, recipe)
        table = recipe.resolve(**self.hyperparameters)
        # One form for equal settings: a value equal to the recipe's default is not kept.
        defaults = recipe.defaults
        kept = {k: v for k, v in self.hyperparameters.items()
                if getattr(defaults, k) != v or type(getattr(defaults, k)) is not type(v)}
        object.__setattr__(self, "hyperparameters", kept)
        object.__setattr__(self, "_table", table)

    @property
    def recipe(self) -> recipes.Recipe:
        """The registered recipe `name`."""
        return recipes.get(self.name)

    @property
    def table(self) -> recipes.Hyperparameters:
        """The recipe's hyperparameters: its defaults with the given ones in place."""
        return self._table

    def resolved(self) -> dict[str, Any]:
        """Every hyperparameter the recipe reads, with its value: what `config.json` and a
        checkpoint's compatibility check record."""
        return self._table.read()


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The dataset and the batch."""

    path: str | None = _field(None, "a text file, a nanoGPT folder (train.bin, val.bin), "
                              "modded-nanogpt shards (folder or glob) or a folder of "
                              "python -m train.prepare (None = tiny shakespeare)", key="data")
    batch_size: int = _field(12, "sequences per micro-batch (global)")
    grad_accum: int = _field(1, "micro-batches per optimizer step")
    vocab_multiple: int | None = _field(None, "pad the vocabulary size to a multiple of this "
                                        "(None: 64 above 1024 ids, as nanoGPT's 50257 -> "
                                        "50304, else none); mesh_tensor must divide it")
    prefetch: bool = _field(True, "read the next batch while the current step runs")
    order: str = _field("random", "random windows each step (nanoGPT), or sequential: the "
                        "next contiguous tokens of the sorted shards each step (modded-"
                        "nanogpt Track 3's generator)", key="data_order",
                        choices=("random", "sequential"))

    def __post_init__(self):
        _validate(self, positive=("batch_size", "grad_accum", "vocab_multiple"))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Length, evaluation, logging, checkpoints and outputs of a run."""

    max_iters: int = _field(2000, "optimizer steps")
    eval_interval: int = _field(250, "evaluate every this many steps")
    eval_iters: int = _field(20, "batches per split in an evaluation")
    eval_interval_tail: int | None = _field(None, "evaluate every this many steps in the last "
                                            "eval_tail_frac of the run (None = eval_interval)")
    eval_tail_frac: float = _field(0.1, "the tail of eval_interval_tail: steps with "
                                   "step/max_iters >= 1 - this (modded-nanogpt Track 3: 125 "
                                   "steps, then 25 from 90%)")
    val_tokens: int | None = _field(None, "val loss over the val split's first this many "
                                    "tokens, as contiguous windows, the same every evaluation "
                                    "(modded-nanogpt Track 3: 10,485,760); None = eval_iters "
                                    "random batches")
    log_interval: int = _field(10, "log train metrics every this many steps")
    checkpoint_every: int = _field(1000, "save a checkpoint every this many steps")
    seed: int = _field(1337, "seed of the init, the data windows and dropout")
    out_dir: str = _field("out/shakespeare_char_cpu", "where the run's outputs go")
    resume: bool = _field(False, "continue from the latest checkpoint in out_dir")
    progress: bool = _field(True, "show a progress bar")
    require_accelerator: bool = _field(False, "refuse to start on a machine whose devices "
                                       "are all CPUs (the GPU-sized presets set it; false "
                                       "runs them here anyway)")
    max_bad_steps: int = _field(10, "stop after this many consecutive steps with a "
                                "non-finite loss or gradient (each is skipped)")
    tensorboard: bool = _field(False, "write TensorBoard event files to out_dir/tensorboard "
                               "(process 0; needs tensorboardX)")
    wandb_project: str | None = _field(None, "log to this Weights & Biases project, the run "
                                       "named after out_dir (process 0; needs wandb)")

    def __post_init__(self):
        _validate(self, positive=("eval_interval", "eval_iters", "log_interval",
                                  "checkpoint_every", "max_bad_steps", "eval_interval_tail",
                                  "val_tokens"),
                  non_negative=("max_iters",), fraction=("eval_tail_frac",))
        if self.wandb_project is not None and not self.wandb_project.strip():
            raise ValueError(f"wandb_project={self.wandb_project!r}: expected a project name "
                             "(or None for no Weights & Biases logging)")

    def is_cadence_step(self, step: int) -> bool:
        """Whether the evaluation cadence falls on `step` (the step after `step` updates):
        every `eval_interval` steps while `step / max_iters < 1 - eval_tail_frac`, every
        `eval_interval_tail` after, and at `max_iters`. modded-nanogpt's
        train_gpt_simple.py: `freq = 125 if step / T < 0.9 else 25; step == T or step %
        freq == 0`. (The loop adds checkpoint steps and skips the step a resume starts at.)

        Example:
          >>> run = RunConfig(max_iters=3250, eval_interval=125, eval_interval_tail=25)
          >>> [s for s in range(2850, 3251) if run.is_cadence_step(s)][:5]
          [2875, 2925, 2950, 2975, 3000]
        """
        tail = self.max_iters > 0 and step / self.max_iters >= 1 - self.eval_tail_frac
        interval = self.eval_interval_tail if tail and self.eval_interval_tail else (
            self.eval_interval)
        return step == self.max_iters or step % interval == 0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes (-1 = fill with the remaining devices)."""

    data: int = _field(-1, "data-parallel axis size", key="mesh_data")
    fsdp: int = _field(1, "fully-sharded data-parallel axis size", key="mesh_fsdp")
    tensor: int = _field(1, "tensor-parallel axis size", key="mesh_tensor")
    diloco: int = _field(1, "DiLoCo replicas, a mesh axis before the others: each trains on "
                         "its own rows of the batch and they average Snoo's pseudo-gradient "
                         "every snoo_k steps (needs an optimizer wrapped in Snoo)",
                         key="mesh_diloco")

    def __post_init__(self):
        _validate(self, positive=("diloco",))  # no -1: the replicas are chosen, not filled
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == 0 or value < -1:
                raise ValueError(f"{_key(self, f.name)}={value}: expected a size >= 1 or "
                                 "-1 (fill)")
        if [self.data, self.fsdp, self.tensor].count(-1) > 1:
            raise ValueError("at most one of mesh_data, mesh_fsdp, mesh_tensor may be -1")

    @property
    def sizes(self) -> tuple[int, int, int]:
        """`(data, fsdp, tensor)`."""
        return self.data, self.fsdp, self.tensor


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """Text generated at the end of a run (`samples.txt`)."""

    num_samples: int = _field(3, "samples generated at the end (0 = none)")
    max_new_tokens: int = _field(300, "new tokens per sample", key="sample_max_new_tokens")
    temperature: float = _field(0.8, "sampling temperature", key="sample_temperature")
    top_k: int | None = _field(200, "keep the k most likely tokens", key="sample_top_k")
    start: str = _field("\n", "prompt", key="sample_start")

    def __post_init__(self):
        _validate(self, non_negative=("num_samples", "max_new_tokens"), positive=("top_k",),
                  non_negative_float=("temperature",))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run, by group. Defaults are the `shakespeare_char_cpu`
    preset."""

    model: GPTConfig = dataclasses.field(default_factory=GPTConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), _GROUP_TYPES[f.name]):
                raise ValueError(f"TrainConfig.{f.name}: expected a {_GROUP_TYPES[f.name].__name__}"
                                 f", got {getattr(self, f.name)!r}")


_GROUP_TYPES: dict[str, type] = _hints(TrainConfig)  # group -> its dataclass
GROUPS: tuple[str, ...] = tuple(_GROUP_TYPES)
#: Keys that choose how a step is computed, not what: a checkpoint resumes with any value.
COMPUTE_KEYS = ("attention",)


def _keys() -> dict[str, tuple[str, str]]:
    keys = {}
    for group, cls in _GROUP_TYPES.items():
        for f in dataclasses.fields(cls):
            if group == "model" and f.name == "vocab_size":
                continue  # from the corpus
            if f.metadata.get("flat", True):
                keys[f.metadata.get("key") or f.name] = (group, f.name)
    return keys


#: Every flat key of the trainer -> `(group, field)`: `--max_iters` is
#: `config.run.max_iters` (the optimizer's hyperparameters are the recipe's, not here).
KEYS: dict[str, tuple[str, str]] = _keys()


def _metadata(key: str) -> Mapping[str, Any]:
    """The field metadata of a flat key: its `"help"` and `"choices"` (the model's fields
    carry the same, in `models.GPTConfig`)."""
    group, name = KEYS[key]
    return next(f.metadata for f in dataclasses.fields(_GROUP_TYPES[group]) if f.name == name)


def _choices() -> dict[str, tuple[str, ...]]:
    return {key: _metadata(key)["choices"] for key in KEYS if _metadata(key)["choices"]}


#: The allowed values of every string key that has a fixed set.
CHOICES: dict[str, tuple[str, ...]] = _choices()


#: Flags and optimizer names renamed, old -> new: given now, an old one is refused in one
#: line naming its new name (`--muon_lr was renamed --muon_learning_rate`).
RENAMED: dict[str, dict[str, str]] = {
    "key": {"muon_lr": "muon_learning_rate", "snoo_lr": "snoo_learning_rate",
            "skew_lr": "learning_rate", "kfac_lr": "kfac_learning_rate",
            "kfac_ema": "kfac_ema_decay", "sample_tokens": "sample_max_new_tokens",
            "temperature": "sample_temperature", "beta1": "b1", "beta2": "b2",
            # The optimizer families became the recipes' own hyperparameters (glossary:
            # docs/design.md): one name per concept, the library's.
            "muon_beta": "muon_momentum", "muon_beta_warmup": "muon_momentum_warmup_steps",
            "newton_muon_interval": "newton_refresh_every",
            "newton_muon_ema_decay": "newton_ema_decay",
            "newton_muon_damping": "newton_damping", "skew_learning_rate": "learning_rate",
            "skew_weight_decay": "weight_decay", "skew_clip": "clip_threshold",
            "skew_policies": "policies", "min_lr": "final_lr_scale"},
    "optimizer": {"skewadam": "skew_adam", "snoo_skewadam": "snoo_skew_adam"},
}


def _check_hyperparameter(key: str, recipe: recipes.Recipe) -> None:
    """Refuse, in one line, a key that is not a hyperparameter of `recipe`: with its new
    name if renamed, close matches, the recipe's own, and the recipes that read it."""
    names = recipe.hyperparameters.names()
    if key in names:
        return
    hints = []
    if key in RENAMED["key"]:
        hints.append(f"--{key} was renamed --{RENAMED['key'][key]}")
    close = [n for n in names if n.endswith("_" + key)] or difflib.get_close_matches(
        key, [*names, *KEYS], n=3)
    if close:
        hints.append(f"did you mean {', '.join('--' + c for c in close)}?")
    readers = sorted(name for name, r in recipes.REGISTRY.items()
                     if key in r.hyperparameters.names())
    if readers:
        hints.append(f"--{key} is read by {', '.join(readers)}")
        hint = f" ({'; '.join(hints)})"
        raise ValueError(f"--{key} is not read by --optimizer={recipe.name}{hint}; its "
                         f"hyperparameters are {', '.join(names)} (python -m train "
                         f"--optimizer={recipe.name} --help)")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise ValueError(f"unknown key --{key}{hint}: neither the trainer's (python -m train "
                     f"--help) nor a hyperparameter of --optimizer={recipe.name}")


#: modded-nanogpt Track 3's baseline recipe (#36, records/track_3_optimization/
#: train_gpt_simple.py), shared by the `track3` presets: Muon (12 Newton-Schulz steps of
#: (2, -1.5, 0.5) in bf16, lr 0.025, decoupled wd 0.05, EMA-Nesterov momentum 0.95) on the
#: hidden matrices; AdamW (0.8, 0.95), eps 1e-10, wd 0.001 on the embedding (lr 0.7), the
#: head (0.004) and every bias and gain (0.015); every group flat for 30% then linear to 0;
#: no clipping; the loss summed over the step's tokens; the sequential data order; the val
#: loss over the val split's first tokens every eval_interval steps, every
#: eval_interval_tail in the last 10% and at the end; and the file's network
#: (`models.track3_config`: RMSNorm, half-truncated RoPE, QK-norm, ReLU², biases, soft-cap,
#: its init, bf16 embedding and residual stream), added below.
_TRACK3_RECIPE: dict[str, Any] = dict(
    optimizer="track3_baseline", grad_clip=0.0, loss_reduction="sum",
    data_order="sequential", eval_tail_frac=0.1, num_samples=0)
#: What the presets sized for accelerators share: refused on a CPU-only machine unless
#: --require_accelerator=false.
_GPU_SIZED: dict[str, Any] = dict(require_accelerator=True)


def _track3_network() -> dict[str, Any]:
    """The Track-3 network's options (`models.track3_config`, their one home) that differ
    from `GPTConfig`'s defaults, less the shape, which each preset sets."""
    network, default = track3_config(), GPTConfig()
    shape = {"vocab_size", "block_size", "n_layer", "n_head", "n_embd"}
    return {f.name: getattr(network, f.name) for f in dataclasses.fields(GPTConfig)
            if f.name not in shape and getattr(network, f.name) != getattr(default, f.name)}


_TRACK3_RECIPE.update(_track3_network())

PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's CPU recipe (README: --device=cpu --eval_iters=20 --block_size=64 ...).
    # bf16 compute, also on a CPU: XLA:CPU runs bf16 matmuls on the CPU's bf16 units
    # (AMX / AVX512-BF16; see models.layers.matmul; figures in benchmarks/README.md). A CPU
    # without bf16 units emulates them: pass --dtype=float32 there.
    # No vocabulary padding of the 65 characters, as nanoGPT (data.vocab_multiple None):
    # step-0 loss ln 65 = 4.17, not ln 72; the same speed on CPU.
    "shakespeare_char_cpu": dict(),
    # nanoGPT's config/train_shakespeare_char.py (one GPU); its README: best val 1.4697.
    "shakespeare_char": dict(
        **_GPU_SIZED, n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2,
        max_iters=5000, lr_decay_iters=5000, eval_iters=200, checkpoint_every=1000,
        out_dir="out/shakespeare_char"),
    # A small mixture-of-experts GPT on the same corpus, sized for a CPU.
    "moe_tiny": dict(
        moe_every=2, n_experts=8, top_k=2, expert_hidden=256, out_dir="out/moe_tiny"),
    # GPT-2 small's shape (12 x 768, T = 1024) for one GPU; char vocabulary, so ~85M params.
    "gpt2_small": dict(
        **_GPU_SIZED, n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=32,
        grad_accum=1,
        dropout=0.0, adam_learning_rate=6e-4, final_lr_scale=0.1, adam_b2=0.95,
        warmup_iters=200, max_iters=5000, lr_decay_iters=5000, eval_interval=500,
        eval_iters=50, checkpoint_every=1000, vocab_multiple=64, out_dir="out/gpt2_small"),
    # nanoGPT's config/train_gpt2.py: GPT-2 (124M) on OpenWebText's GPT-2 tokens (nanoGPT's
    # data/openwebtext/prepare.py writes train.bin/val.bin); for GPUs (its recipe: 8 x A100
    # 40GB, 4 days, val loss ~2.85). 12 x 40 x 1024 = 491,520 tokens per step; on N
    # devices keep the product, e.g. --batch_size=96 --grad_accum=5 on 8.
    "gpt2_owt": dict(
        **_GPU_SIZED, n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=False, dropout=0.0,
        batch_size=12, grad_accum=40, optimizer="adamw", learning_rate=6e-4,
        final_lr_scale=0.1, b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=1.0, warmup_iters=2000,
        max_iters=600000, lr_decay_iters=600000, eval_interval=1000, eval_iters=200,
        log_interval=10, checkpoint_every=1000, vocab_multiple=64,
        data="data/openwebtext", out_dir="out/gpt2_owt", sample_start="\n"),
    # GPT-2 Medium's shape (24 x 1024, 16 heads) with the optimizer of modded-nanogpt's
    # Snoo record (2025-09-16, PR #128: Snoo 0.68/0.37/k=28 around Muon lr 0.027, wd 0.01,
    # momentum warm-up; Adam betas (0.8, 0.95), eps 1e-10; stable then a 70% linear
    # cooldown; 5640 steps of 524,288 tokens) on FineWeb's GPT-2 shards (modded-nanogpt's
    # data/cached_fineweb10B.py). For GPUs (8 x H100 class). The record's own model is
    # not nanoGPT's GPT (rotary embeddings, QK-norm, ReLU^2, value embeddings, U-net skips,
    # per-group Adam lrs): this preset is its optimizer on our GPT, so its val loss is not
    # the record's 2.92.
    "gpt2_medium_fineweb": dict(
        **_GPU_SIZED, n_layer=24, n_head=16, n_embd=1024, block_size=1024, bias=False, dropout=0.0,
        batch_size=64, grad_accum=8, optimizer="snoo_muon", muon_learning_rate=0.027,
        muon_weight_decay=0.01, adam_learning_rate=3e-3, adam_b1=0.8, adam_b2=0.95,
        adam_eps=1e-10, schedule="stable_cooldown", cooldown_frac=0.7, final_lr_scale=0.0,
        max_iters=5640, eval_interval=250, eval_iters=160, log_interval=10,
        checkpoint_every=500, vocab_multiple=128, data="data/fineweb10B",
        out_dir="out/gpt2_medium_fineweb"),
    # modded-nanogpt Track 3 (the optimizer benchmark) at its baseline #36: 3250 steps of
    # 8 x 64 x 1024 = 524,288 tokens (here 64 sequences x 8 accumulated micro-batches; on
    # N devices keep the product), FineWeb's GPT-2 shards (data/cached_fineweb10B.py of
    # modded-nanogpt; the vocabulary padded to 50,304), val loss over the first 10,485,760
    # val tokens every 125 steps, every 25 from step 2925, and at 3250. For GPUs (the file
    # ran 8 x H100; about 1.7B tokens); its target: mean val loss < 3.28.
    "track3": dict(
        **_TRACK3_RECIPE, **_GPU_SIZED, block_size=1024, n_layer=12, n_head=6, n_embd=768,
        batch_size=64,
        grad_accum=8, vocab_multiple=64, max_iters=3250, eval_interval=125,
        eval_interval_tail=25, val_tokens=10_485_760, eval_iters=4, log_interval=25,
        checkpoint_every=250, data="data/fineweb10B", out_dir="out/track3"),
    # Its twin for a 2-core CPU (benchmarks/README.md, "Track 3 on a CPU"): the same recipe,
    # data order, validation and cadence on the shipped tiny shakespeare as characters
    # (vocabulary 65), 4 x 128 wide (4 heads of 32), context 128, 8 x 2 accumulated
    # sequences = 2,048 tokens a step, 300 steps (of the 490 one pass holds); val over the
    # first 16,384 val characters every 25 steps, every 5 from step 270.
    "track3_cpu": dict(
        **_TRACK3_RECIPE, block_size=128, n_layer=4, n_head=4, n_embd=128, batch_size=8,
        grad_accum=2, max_iters=300, eval_interval=25, eval_interval_tail=5,
        val_tokens=16_384, eval_iters=2, log_interval=25, checkpoint_every=300,
        out_dir="out/track3_cpu"),
}


def override(config: TrainConfig, **values: Any) -> TrainConfig:
    """`config` with flat keys replaced: `override(config, max_iters=100, n_layer=2)`.

    A key that is not the trainer's (`KEYS`) is a hyperparameter of the recipe
    `config` ends up with (its `optimizer`, or the one given here). A new `optimizer`
    starts from its recipe's defaults; of the hyperparameters `config` was given (by its
    preset), it keeps those the new recipe also has and reads. Every changed group is
    rebuilt, so its validation runs (the model's is `models.GPTConfig`'s, the
    hyperparameters' the recipe's).

    Raises:
      ValueError: an unknown key (with close matches; for a hyperparameter, the recipe's
        own), a wrong type or a bad value.
    """
    by_group: dict[str, dict[str, Any]] = {}
    given: dict[str, Any] = {}
    for key, value in values.items():
        if key in RENAMED["key"] and key not in KEYS:
            raise ValueError(f"--{key} was renamed --{RENAMED['key'][key]}")
        if key not in KEYS:
            given[key] = value
            continue
        group, name = KEYS[key]
        if group == "model":  # GPTConfig validates values, not every type
            _check_type(key, _hints(GPTConfig)[name], value)
        by_group.setdefault(group, {})[name] = value
    name = by_group.get("optimizer", {}).get("name", config.optimizer.name)
    if name in RENAMED["optimizer"]:
        raise ValueError(f"--optimizer={name} was renamed --optimizer={RENAMED['optimizer'][name]}")
    recipe = recipes.get(name)
    kept = dict(config.optimizer.hyperparameters)
    if name != config.optimizer.name:
        kept = _carried(kept, recipe)
    for key, value in given.items():
        _check_hyperparameter(key, recipe)
        _check_type(key, _hints(recipe.hyperparameters)[key], value)
    if given or name != config.optimizer.name:
        by_group.setdefault("optimizer", {})["hyperparameters"] = {**kept, **given}
    return dataclasses.replace(config, **{
        group: dataclasses.replace(getattr(config, group), **fields)
        for group, fields in by_group.items()})


def _carried(values: Mapping[str, Any], recipe: recipes.Recipe) -> dict[str, Any]:
    """Of a preset's hyperparameters, those ``recipe`` has and reads with them."""
    kept = {k: v for k, v in values.items() if k in recipe.hyperparameters.names()}
    try:
        table = recipe.hyperparameters(**kept)
    except ValueError:
        return {}
    return {k: v for k, v in kept.items() if k in table.read()}


def get_preset(name: str) -> TrainConfig:
    """Return the named preset (see `PRESETS`).

    Raises:
      ValueError: for an unknown name, listing the presets.
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"; did you mean {close}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} Presets: {sorted(PRESETS)}")
    return override(TrainConfig(), **PRESETS[name])


def group_fields(group: str) -> tuple[str, ...]:
    """The flat keys a checkpoint's config must match in, for `group`.

    `"model"`: the GPT's keys plus `vocab_multiple` (it sets the padded vocabulary);
    `"optimizer"`: the recipe's name, clipping, rounding and loss reduction (its
    hyperparameters are compared by `train.checkpoint.check_compatible` as well); any
    other group of `GROUPS`: its own keys. Never the `COMPUTE_KEYS` (`attention`).
    """
    if group not in GROUPS:
        raise ValueError(f"unknown group {group!r}; expected one of {GROUPS}")
    keys = tuple(key for key, (g, _) in KEYS.items() if g == group and key not in COMPUTE_KEYS)
    return (*keys, "vocab_multiple") if group == "model" else keys


def model_config(config: TrainConfig, vocab_size: int) -> GPTConfig:
    """`config.model` with `vocab_size` padded to `data.vocab_multiple` (None: to 64 above
    1024 ids, nanoGPT's 50257 -> 50304, else unpadded as nanoGPT's character recipes) and
    `attention` resolved for this backend (`models.resolve_attention`; QK-clip takes the
    handwritten attention, whose forward pass returns the max logits).

    Raises:
      ValueError: a `mesh_tensor` that does not divide the padded vocabulary (the vocab
        axis is sharded over it), naming the `--vocab_multiple` to pass; an `--attention`
        that cannot run here (`cudnn` off a GPU, `xla` or `cudnn` with QK-clip);
        `scan_layers` with QK-clip (a scan cannot return each layer's max logits).
    """
    multiple = config.data.vocab_multiple
    if multiple is None:
        multiple = 64 if vocab_size > 1024 else 1
    padded = -(-vocab_size // multiple) * multiple
    tensor = config.mesh.tensor
    if tensor > 1 and padded % tensor:
        raise ValueError(f"mesh_tensor={tensor} does not divide the vocabulary of {padded} "
                         f"(--vocab_multiple={config.data.vocab_multiple}); pass "
                         f"--vocab_multiple={math.lcm(multiple, tensor)}")
    if config.model.scan_layers and config.optimizer.qk_clip_tau > 0:
        raise ValueError(f"--scan_layers cannot run with --qk_clip_tau="
                         f"{config.optimizer.qk_clip_tau}: QK-clip needs each layer's max "
                         f"logits, which the scanned blocks do not return; drop one of them")
    attention = resolve_attention(config.model, max_logits=config.optimizer.qk_clip_tau > 0)
    return dataclasses.replace(config.model, vocab_size=padded, attention=attention)


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """A JSON-ready nested dict, `{group: {field: value}}`; `"recipe"` holds every
    hyperparameter the recipe reads with its value (`OptimizerConfig.resolved`), beside
    the given ones in `optimizer.hyperparameters`."""
    out = dataclasses.asdict(config)
    out["recipe"] = config.optimizer.resolved()
    return out


def hyperparameter_keys(values: Mapping[str, Any]) -> list[str]:
    """The keys of a flat dict that are a recipe's hyperparameters (not `KEYS`)."""
    return [k for k in values if k not in KEYS]


def flat_dict(config: TrainConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Every flat key with its value, from a config or a dict of `config_to_dict` (a flat
    dict passes through): the trainer's keys and every hyperparameter the recipe reads
    (resolved from the name and the given ones), what
    `train.checkpoint.check_compatible` compares."""
    config = config_to_dict(config) if isinstance(config, TrainConfig) else dict(config)
    if not any(isinstance(v, Mapping) for v in config.values()):
        return dict(config)
    flat = {key: config[group][name] for key, (group, name) in KEYS.items()
            if name in config.get(group, {})}
    optimizer = config.get("optimizer", {})
    name = optimizer.get("name", OptimizerConfig().name)
    flat.update(recipes.get(name).resolve(**optimizer.get("hyperparameters", {})).read())
    return flat


def config_from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """Inverse of `config_to_dict` (a flat dict of keys also works); unknown keys and
    wrong types raise ValueError."""
    if not any(isinstance(v, Mapping) for v in values.values()):
        return override(TrainConfig(), **values)
    groups = {}
    for group, fields in values.items():
        if group == "recipe":  # the resolved hyperparameters: what the given ones imply
            continue
        if group not in _GROUP_TYPES:
            raise ValueError(f"unknown config group {group!r}; expected one of {GROUPS}")
        cls = _GROUP_TYPES[group]
        names = [f.name for f in dataclasses.fields(cls)]
        for name in fields:
            if name not in names:
                raise ValueError(f"unknown field {group}.{name}; {group} has {names}")
        groups[group] = cls(**fields)
    return TrainConfig(**groups)


# ----------------------------------------------------------------------------- parsing


def _key_type(key: str) -> Any:
    group, name = KEYS[key]
    return _hints(_GROUP_TYPES[group])[name]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return "None" if tp is type(None) else tp.__name__


def _check_type(key: str, tp: Any, value: Any) -> None:
    allowed = typing.get_args(tp) if typing.get_origin(tp) in (
        typing.Union, types.UnionType) else (tp,)
    for a in allowed:
        if a is type(None) and value is None:
            return
        if a is float and isinstance(value, int | float) and not isinstance(value, bool):
            return
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if a in (bool, str) and isinstance(value, a):
            return
    raise ValueError(f"{key}={value!r}: expected {_type_name(tp)}")


def _parse_value(key: str, text: str, tp: Any = None) -> Any:
    tp = _key_type(key) if tp is None else tp
    allowed = typing.get_args(tp) if typing.get_origin(tp) in (
        typing.Union, types.UnionType) else (tp,)
    if type(None) in allowed and text.lower() in ("none", "null"):
        return None
    for a in allowed:
        if a is bool and text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return text.lower() in ("1", "true", "yes", "on")
        if a is int:
            try:
                return int(text)
            except ValueError:
                pass
        if a is float:
            try:
                return float(text)
            except ValueError:
                pass
        if a is str:
            return _unescape(text) if key == "sample_start" else text
    raise ValueError(f"--{key}={text!r}: expected {_type_name(tp)}")


def _unescape(text: str) -> str:
    """`text` with its backslash escapes (`\\n`, `\\t`, `\\u2713`) decoded and every other
    character kept: `unicode_escape` reads bytes as Latin-1, so the characters beyond it
    go in as escapes of their own rather than as UTF-8 bytes (which would come back as
    mojibake, "é" as "Ã©")."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def parse_args(argv: Sequence[str]) -> TrainConfig:
    """Build a config from `--preset=NAME` and flat `--key=value` (or `--key value`).

    The preset (default `shakespeare_char_cpu`) applies first, whatever its position; a
    bare `--flag` sets a bool key to true. Values are type-checked against the field; a
    key that is not the trainer's is a hyperparameter of the chosen recipe
    (`--optimizer`, else the preset's), typed and checked by it.

    Raises:
      ValueError: naming the key for an unknown key (with close matches; for a
        hyperparameter, the recipe's own), a value of the wrong type or out of range, or
        an unknown preset or recipe.
    """
    preset, pairs, args = "shakespeare_char_cpu", [], list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; expected --key=value")
        key, eq, text = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            # A bare flag (None): true for a bool key.
            text = args.pop(0) if args and not args[0].startswith("--") else None
        if key == "preset":
            if text is None:
                raise ValueError("--preset needs a value (--preset=NAME)")
            preset = text
            continue
        pairs.append((key, text))
    base = get_preset(preset)
    names = [text for key, text in pairs if key == "optimizer"]
    if names and names[-1] is None:
        raise ValueError("--optimizer needs a value (--optimizer=NAME)")
    name = names[-1] if names else base.optimizer.name
    if name in RENAMED["optimizer"]:
        raise ValueError(f"--optimizer={name} was renamed --optimizer={RENAMED['optimizer'][name]}")
    recipe = recipes.get(name)
    overrides = {}
    for key, text in pairs:
        if key in KEYS:
            tp = _key_type(key)
        elif key in RENAMED["key"] and key not in recipe.hyperparameters.names():
            raise ValueError(f"--{key} was renamed --{RENAMED['key'][key]}")
        else:
            _check_hyperparameter(key, recipe)
            tp = _hints(recipe.hyperparameters)[key]
        if text is None:
            if tp is not bool:
                raise ValueError(f"--{key} needs a value (--{key}=VALUE)")
            text = "true"
        overrides[key] = _parse_value(key, text, tp)
    return override(base, **overrides)


def recipe_help(config: TrainConfig) -> str:
    """The `--help` section of the chosen recipe: each hyperparameter with its type, its
    value in `config` and its help."""
    recipe, values = config.optimizer.recipe, config.optimizer.table
    lines = [f"--optimizer={recipe.name}: {recipe.summary}", f"{recipe.name}'s hyperparameters "
             "(flags of this recipe only; each recipe has its own):"]
    for name, tp, _, help_ in recipe.hyperparameters.describe():
        value = getattr(values, name)
        shown = "None" if value is None else json.dumps(value)
        lines.append(f"  --{name:<28} {tp:<12} default {shown:<22} {help_}")
    return "\n".join(lines)


def config_help(config: TrainConfig | None = None, optimizers: Sequence[str] = ()) -> str:
    """The `--help` text: every flat key with its type and (preset) default, by group,
    then the chosen recipe's hyperparameters.

    Args:
      config: whose values are shown as defaults (default `TrainConfig()`).
      optimizers: the recipe names to list (`optax_snoo.recipes.REGISTRY`).
    """
    config = config or TrainConfig()
    values = flat_dict(config)
    lines = ["usage: python -m train [--preset=NAME] [--optimizer=NAME] [--key=value ...]",
             "", f"presets: {', '.join(PRESETS)} (default shakespeare_char_cpu)"]
    if optimizers:
        lines.append(f"optimizers (recipes; --optimizer=NAME --help lists NAME's "
                     f"hyperparameters): {', '.join(optimizers)}")
    for group, cls in _GROUP_TYPES.items():
        lines += ["", f"{group}:" + (f" {cls.__doc__.splitlines()[0]}" if group != "model"
                                      else " models.GPTConfig")]
        for key in (key for key, (g, _) in KEYS.items() if g == group):
            shown = f" {{{', '.join(CHOICES[key])}}}" if key in CHOICES else ""
            value = values[key]
            default = "None" if value is None else json.dumps(value)
            lines.append(f"  --{key:<18} {_type_name(_key_type(key)):<12} "
                         f"default {default:<14} {_metadata(key)['help']}{shown}")
    return "\n".join([*lines, "", recipe_help(config)])
