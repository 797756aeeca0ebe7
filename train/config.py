"""The trainer's configuration: one typed dataclass, named presets, `--key=value` overrides.

`TrainConfig` is flat (every field is one command-line key) and grouped by the `group`
entry of each field's metadata: `model` (becomes a `models.GPTConfig`), `optimizer`,
`schedule`, `data`, `run`, `mesh` and `sample`. The model and optimizer groups must match
when a run resumes from a checkpoint (see `train.checkpoint`).

Example:
  >>> config = parse_args(["--preset=shakespeare_char_cpu", "--max_iters=100"])
  >>> config.max_iters, config.n_layer
  (100, 4)

References:
  Karpathy, "nanoGPT" (train.py, configurator.py, config/train_shakespeare_char.py),
  https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CHOICES",
    "GROUPS",
    "PRESETS",
    "TrainConfig",
    "config_from_dict",
    "config_help",
    "config_to_dict",
    "get_preset",
    "group_fields",
    "model_config",
    "parse_args",
]

GROUPS = ("model", "optimizer", "schedule", "data", "run", "mesh", "sample")


def _field(default: Any, group: str, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"group": group, "help": help})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run. Defaults are the `shakespeare_char_cpu` preset,
    except `vocab_multiple` (8 here, so a tensor-parallel mesh divides the vocabulary)."""

    # model (fields named as in models.GPTConfig; the vocabulary comes from the data)
    block_size: int = _field(64, "model", "context length T in tokens")
    n_layer: int = _field(4, "model", "transformer blocks L")
    n_head: int = _field(4, "model", "attention heads H")
    n_kv_head: int | None = _field(None, "model", "key/value heads (None = n_head)")
    n_embd: int = _field(128, "model", "residual width D")
    mlp: str = _field("gelu", "model", "MLP kind")
    mlp_hidden: int | None = _field(None, "model", "MLP hidden width (None = model default)")
    bias: bool = _field(False, "model", "biases in linear layers and norms")
    dropout: float = _field(0.0, "model", "dropout rate while training")
    tie_embeddings: bool = _field(True, "model", "share the token embedding with the LM head")
    dtype: str = _field("bfloat16", "model", "compute dtype (params stay in param_dtype)")
    param_dtype: str = _field("float32", "model", "parameter dtype")
    moe_every: int = _field(0, "model", "every k-th block is mixture-of-experts (0 = dense)")
    n_experts: int = _field(8, "model", "experts per MoE block")
    top_k: int = _field(2, "model", "experts per token")
    expert_hidden: int | None = _field(None, "model", "expert MLP width (None = default)")
    capacity_factor: float = _field(1.25, "model", "MoE expert capacity factor")
    aux_loss_coef: float = _field(0.01, "model", "MoE load-balancing loss coefficient")
    z_loss_coef: float = _field(0.0, "model", "MoE router z-loss coefficient")
    vocab_multiple: int = _field(8, "model", "pad the vocabulary size to a multiple of this "
                                 "(the vocab axis is sharded over mesh_tensor)")

    # optimizer
    optimizer: str = _field("snoo_muon", "optimizer", "name in train.optimizers.OPTIMIZERS")
    learning_rate: float = _field(1e-3, "optimizer", "peak lr of AdamW (Adam group for Muon)")
    beta1: float = _field(0.9, "optimizer", "Adam beta1")
    beta2: float = _field(0.99, "optimizer", "Adam beta2")
    eps: float = _field(1e-8, "optimizer", "Adam epsilon")
    weight_decay: float = _field(0.1, "optimizer", "AdamW weight decay on >= 2-D params "
                                 "(adamw stacks; Muon's Adam group has none)")
    grad_clip: float = _field(1.0, "optimizer", "global-norm clipping (0 = off)")
    # K-FAC (kfac, snoo_kfac): hidden Dense kernels (+ biases); AdamW on the rest
    kfac_lr: float | None = _field(None, "optimizer", "peak lr of the K-FAC group "
                                   "(None = learning_rate)")
    kfac_damping: float = _field(1e-3, "optimizer", "K-FAC damping lambda")
    kfac_ema: float = _field(0.95, "optimizer", "K-FAC factor EMA decay rho")
    kfac_momentum: float = _field(0.9, "optimizer", "K-FAC group heavy-ball momentum")
    kfac_mode: str = _field("pi", "optimizer", "K-FAC damping: factored (pi) or exact (eigen)")
    kfac_graft: str = _field("adam", "optimizer", "per-layer update norm of the K-FAC group")
    kfac_refresh: str = _field("every", "optimizer", "K-FAC inverse refresh policy")
    kfac_interval: int = _field(100, "optimizer", "every: steps between refreshes; "
                                "lr_ratio: the max interval")
    kfac_first: int | None = _field(None, "optimizer", "every: first refresh step "
                                    "(None = kfac_interval)")
    kfac_phases: str = _field("none,150,300,600", "optimizer", "by_lr_phase: intervals for "
                              "warmup,peak,decay,tail (an int, none or once)")
    kfac_tau: float = _field(0.15, "optimizer", "lr_ratio: relative lr change that refreshes")
    kfac_min_interval: int = _field(10, "optimizer", "lr_ratio: fewest steps between refreshes")
    kfac_skip_warmup: bool = _field(False, "optimizer", "lr_ratio: no refresh in the warmup")
    kfac_warm_start: int = _field(0, "optimizer", "batches estimating the factors before "
                                  "step 0 (0 = none)")
    kfac_stats_stride: int = _field(1, "optimizer", "factors from every n-th position of "
                                    "each sequence (rotating; 1 = all tokens)")
    muon_lr: float = _field(0.02, "optimizer", "peak lr of the Muon group")
    muon_beta: float = _field(0.95, "optimizer", "Muon momentum")
    muon_beta_warmup: int = _field(300, "optimizer", "steps warming Muon's momentum up from "
                                   "0.85 (0 = constant)")
    muon_weight_decay: float = _field(0.0, "optimizer", "Muon decoupled weight decay")
    muon_smoothing: float | None = _field(None, "optimizer", "Muon update smoothing sigma "
                                          "(SPEC §2.4, PR #137 EMA form; None = off)")
    snoo_lr: float = _field(0.68, "optimizer", "Snoo outer learning rate")
    snoo_momentum: float = _field(0.37, "optimizer", "Snoo outer Nesterov momentum")
    snoo_k: int = _field(28, "optimizer", "Snoo sync period in steps")
    skew_lr: float = _field(1e-3, "optimizer", "peak lr of SkewAdam (SPEC's 3e-4 is for its "
                            "6.8B model; 1e-3 is AdamW's lr for the CPU presets)")
    skew_weight_decay: float = _field(0.05, "optimizer", "SkewAdam decoupled weight decay "
                                      "(backbone and experts; never the router)")
    skew_clip: float = _field(1.0, "optimizer", "SkewAdam per-tensor RMS clip (0 = off)")
    skew_policies: str = _field("skew_adam", "optimizer", "SkewAdam per-role state table")
    rounding: str = _field("none", "optimizer", "rounding of bf16 params after each update "
                           "(any optimizer; float32 params pass through)")

    # schedule
    schedule: str = _field("cosine", "schedule", "learning-rate schedule")
    warmup_iters: int = _field(100, "schedule", "linear warmup steps (cosine)")
    lr_decay_iters: int | None = _field(None, "schedule", "cosine end step (None = max_iters)")
    min_lr: float = _field(1e-4, "schedule", "cosine final lr (scaled for the Muon group)")
    cooldown_frac: float = _field(0.7, "schedule", "stable_cooldown: fraction spent decaying")
    final_lr_scale: float = _field(0.0, "schedule", "stable_cooldown: final lr multiplier")

    # data
    data: str | None = _field(None, "data", "corpus text file (None = tiny shakespeare)")
    batch_size: int = _field(12, "data", "sequences per micro-batch (global)")
    grad_accum: int = _field(1, "data", "micro-batches per optimizer step")

    # run
    max_iters: int = _field(2000, "run", "optimizer steps")
    eval_interval: int = _field(250, "run", "evaluate every this many steps")
    eval_iters: int = _field(20, "run", "batches per split in an evaluation")
    log_interval: int = _field(10, "run", "log train metrics every this many steps")
    checkpoint_every: int = _field(1000, "run", "save a checkpoint every this many steps")
    seed: int = _field(1337, "run", "seed of the init, the data windows and dropout")
    out_dir: str = _field("out/shakespeare_char_cpu", "run", "where the run's outputs go")
    resume: bool = _field(False, "run", "continue from the latest checkpoint in out_dir")
    progress: bool = _field(True, "run", "show a progress bar")
    max_bad_steps: int = _field(10, "run", "stop after this many consecutive steps with a "
                                "non-finite loss or gradient (each is skipped)")

    # mesh (-1 = fill with the remaining devices)
    mesh_data: int = _field(-1, "mesh", "data-parallel axis size")
    mesh_fsdp: int = _field(1, "mesh", "fully-sharded data-parallel axis size")
    mesh_tensor: int = _field(1, "mesh", "tensor-parallel axis size")

    # sample (written to samples.txt at the end)
    num_samples: int = _field(3, "sample", "samples generated at the end (0 = none)")
    sample_tokens: int = _field(300, "sample", "new tokens per sample")
    temperature: float = _field(0.8, "sample", "sampling temperature")
    sample_top_k: int | None = _field(200, "sample", "keep the k most likely tokens")
    sample_start: str = _field("\n", "sample", "prompt")

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            _check_type(name, value)
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {list(allowed)}")
        from train.optimizers import OPTIMIZERS  # late: optimizers imports this module

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: unknown; registered optimizers "
                             f"are {sorted(OPTIMIZERS)}")
        positive = ("block_size", "n_layer", "n_head", "n_embd", "batch_size", "grad_accum",
                    "eval_interval", "eval_iters", "log_interval", "checkpoint_every",
                    "snoo_k", "vocab_multiple", "n_experts", "top_k", "max_bad_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a positive integer")
        for name in ("max_iters", "warmup_iters", "moe_every", "muon_beta_warmup",
                     "num_samples", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer >= 0")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout}: expected a value in [0, 1)")
        for name in ("mesh_data", "mesh_fsdp", "mesh_tensor"):
            if getattr(self, name) == 0 or getattr(self, name) < -1:
                raise ValueError(f"{name}={getattr(self, name)}: expected a size >= 1 or -1 (fill)")
        if [self.mesh_data, self.mesh_fsdp, self.mesh_tensor].count(-1) > 1:
            raise ValueError("at most one of mesh_data, mesh_fsdp, mesh_tensor may be -1")


CHOICES: dict[str, tuple[str, ...]] = {
    "mlp": ("gelu", "swiglu"),
    "dtype": ("bfloat16", "float32"),
    "param_dtype": ("bfloat16", "float32"),
    "schedule": ("cosine", "stable_cooldown"),
    "skew_policies": ("skew_adam", "expert_momentum", "factored_router", "uniform"),
    "rounding": ("none", "stochastic", "dithered"),
    "kfac_mode": ("pi", "eigen"),
    "kfac_graft": ("adam", "sgd", "none"),
    "kfac_refresh": ("every", "by_lr_phase", "lr_ratio"),
}

PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's CPU recipe (README: --device=cpu --eval_iters=20 --block_size=64 ...).
    # bf16 compute, also on a CPU: XLA:CPU runs bf16 matmuls on the CPU's bf16 units
    # (AMX / AVX512-BF16; see models.layers.matmul), and a train step took 0.7-0.8x the CPU
    # time of float32 on the project's Xeon (benchmarks/throughput.py). A CPU without
    # bf16 units emulates them: pass --dtype=float32 there.
    # No vocabulary padding, as nanoGPT: step-0 loss ln 65 = 4.17 (SPEC §5: 4.1649), not
    # ln 72; the same speed on CPU (one device, so nothing to shard the vocab over).
    "shakespeare_char_cpu": dict(vocab_multiple=1),
    # nanoGPT's config/train_shakespeare_char.py (one GPU); SPEC §5: best val 1.4697.
    "shakespeare_char": dict(
        n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2,
        max_iters=5000, lr_decay_iters=5000, eval_iters=200, checkpoint_every=1000,
        out_dir="out/shakespeare_char"),
    # A small mixture-of-experts GPT on the same corpus, sized for a CPU.
    "moe_tiny": dict(
        moe_every=2, n_experts=8, top_k=2, expert_hidden=256, out_dir="out/moe_tiny"),
    # GPT-2 small's shape (12 x 768, T = 1024) for one GPU; char vocabulary, so ~85M params.
    "gpt2_small": dict(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=32, grad_accum=1,
        dropout=0.0, learning_rate=6e-4, min_lr=6e-5, beta2=0.95,
        warmup_iters=200, max_iters=5000, lr_decay_iters=5000, eval_interval=500,
        eval_iters=50, checkpoint_every=1000, vocab_multiple=64, out_dir="out/gpt2_small"),
}


def get_preset(name: str) -> TrainConfig:
    """Return the named preset (see `PRESETS`).

    Raises:
      ValueError: for an unknown name, listing the presets.
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"; did you mean {close}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} Presets: {sorted(PRESETS)}")
    return TrainConfig(**PRESETS[name])


def group_fields(group: str) -> tuple[str, ...]:
    """Names of the config fields in `group` (one of `GROUPS`)."""
    if group not in GROUPS:
        raise ValueError(f"unknown group {group!r}; expected one of {GROUPS}")
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["group"] == group)


def model_config(config: TrainConfig, vocab_size: int):
    """The `models.GPTConfig` of `config`, with `vocab_size` padded to `vocab_multiple`."""
    from models import GPTConfig

    padded = -(-vocab_size // config.vocab_multiple) * config.vocab_multiple
    kwargs = {name: getattr(config, name) for name in group_fields("model")}
    kwargs.pop("vocab_multiple")
    return GPTConfig(vocab_size=padded, **kwargs)


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """A JSON-ready dict of every field."""
    return dataclasses.asdict(config)


def config_from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """Inverse of `config_to_dict`; unknown keys and wrong types raise ValueError."""
    for key in values:
        _check_known(key)
    return TrainConfig(**values)


# ----------------------------------------------------------------------------- parsing


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return "None" if tp is type(None) else tp.__name__


def _check_known(key: str) -> None:
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    if key not in names:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown config key {key!r}{hint} (see --help for all keys)")


def _check_type(name: str, value: Any) -> None:
    tp = _hints()[name]
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
    raise ValueError(f"{name}={value!r}: expected {_type_name(tp)}")


def _parse_value(name: str, text: str) -> Any:
    tp = _hints()[name]
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
            return text.encode().decode("unicode_escape") if name == "sample_start" else text
    raise ValueError(f"--{name}={text!r}: expected {_type_name(tp)}")


def parse_args(argv: Sequence[str]) -> TrainConfig:
    """Build a config from `--preset=NAME` and `--key=value` (or `--key value`) arguments.

    The preset (default `shakespeare_char_cpu`) applies first, whatever its position; a
    bare `--flag` sets a bool field to true. Values are type-checked against the field.

    Raises:
      ValueError: naming the key for an unknown key (with close matches), a value of the
        wrong type, or an unknown preset/optimizer.
    """
    preset, overrides, args = "shakespeare_char_cpu", {}, list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; expected --key=value")
        key, eq, text = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            is_flag = key != "preset" and key in _hints() and _hints()[key] is bool and (
                not args or args[0].startswith("--"))
            if is_flag:
                text = "true"
            elif args and not args[0].startswith("--"):
                text = args.pop(0)
            else:
                if key != "preset":
                    _check_known(key)
                raise ValueError(f"--{key} needs a value (--{key}=VALUE)")
        if key == "preset":
            preset = text
            continue
        _check_known(key)
        overrides[key] = _parse_value(key, text)
    base = get_preset(preset)
    return dataclasses.replace(base, **overrides)


def config_help(config: TrainConfig | None = None) -> str:
    """The `--help` text: every key with its type and (preset) default, by group."""
    from train.optimizers import OPTIMIZERS

    config = config or TrainConfig()
    hints = _hints()
    lines = ["usage: python -m train [--preset=NAME] [--key=value ...]", "",
             f"presets: {', '.join(PRESETS)} (default shakespeare_char_cpu)",
             f"optimizers: {', '.join(OPTIMIZERS)}"]
    for group in GROUPS:
        lines += ["", f"{group}:"]
        for f in dataclasses.fields(TrainConfig):
            if f.metadata["group"] != group:
                continue
            choices = f" {{{', '.join(CHOICES[f.name])}}}" if f.name in CHOICES else ""
            value = getattr(config, f.name)
            default = "None" if value is None else json.dumps(value)
            lines.append(f"  --{f.name:<18} {_type_name(hints[f.name]):<12} "
                         f"default {default:<14} {f.metadata['help']}{choices}")
    return "\n".join(lines)
