"""modded-nanogpt Track 3 result #40 (#30's Aurora stack inside EMA-Nesterov) and the
results built on it.

#40 (``results/20260522_ema_nesterov_aurora_proj``, 2890 steps of a 2900-step run whose
PowerCool ends at 2980) runs #30's optimizer (`optax_snoo.recipes.track3_aurora_proj`:
Aurora on ``mlp.proj``, SOAP on the MLP and ``attn.v``, the Gram-norm Contra-Muon ramp,
the radial brake, the u/w floor and the radius pin, AdamW on PowerCool) with two of its
schedule constants moved, its momentum cool-down ending at 2900 (``FINAL_TRAIN_STEPS``)
and PowerCool's ``t_end`` at 2980 (``FINAL_SCHEDULE_STEPS``), and wraps both optimizers in
EMA-Nesterov (`optax_snoo.ema_nesterov`, its class ``EMA_Nesterov``): every gradient is
taken at ``W + β_t b`` with ``b`` an EMA (γ 0.99) of the weights' displacement per step,
``β_t = 0.3 · lr_t/lr_0`` of the embedding's AdamW group (the lr set on the previous
step) while ``300 <= t < 2900 - 950``, and the inner step is taken from that point.
The weights to evaluate are ``params - β b`` (`optax_snoo.eval_params`; equal to the
params from update 1950 on). The network is #30's (``--init=cgi``).

Where ours differs from the log's arithmetic: #30's (see `track3_aurora_proj`), and the
lookahead buffer ``b`` is float32 where the log keeps it in the parameter's dtype (bfloat16
for the embedding).

#42 (``results/20260525_aurora_ema_ref``, 2860 steps of #40's schedule; its script is a
cleaned #40 with the same optimizer and constants) adds a fixed reference interpolation
(`optax_snoo.reference_interpolation`, last in EMA-Nesterov's inner chain so that it copies
and evaluates the weights without the lookahead, as the record's copy after
``EMA_Nesterov.step``): the weights after update 2375 are kept, and from update 2850 on
the weights to evaluate are ``w - 0.075 (w - w_2375)``, on every parameter. Its network
keeps #30's depth-scaled ``fc`` but drops the Rademacher gains and zeroes the biases (an
init none of the model's ``init`` kinds is; its table row runs ``--init=cgi``).

#41 (``results/20260523_circuit_muon``, 2875 steps of #40's schedule, the same constants)
adds Circuit-Muon's OV coupling (`optax_snoo.scale_by_circuit_ov`, damping 1e-3) of each
block's ``attn.v`` and ``attn.proj`` directions per head, where its log places it: after
each leg's direction (momentum, SOAP, the polar, Contra-Muon) and before the radial
brake, the u/w floor, the lr and the radius pin, on the weights the step starts from (the
lookahead point). The log's heads are 128 wide (``HEAD_DIM``, the network's 6 heads of
768); the recipe takes the network's head count (``num_heads``, the trainer's
``--n_head``).

Every step constant is written at 2980 steps (``RECORD_STEPS``, PowerCool's ``t_end``)
and scaled to the run: `Hyperparameters.scaled` gives ``round(x·N/2980)``, each PowerCool
constant becomes ``c·(lr/lr_record)·(2980/N)^1.2`` (`optax_snoo.power_cool_scaled`).

References:
  OscarYau525, `modded-nanogpt Track 3 result #40, EMA-Nesterov + Aurora
  (results/20260522_ema_nesterov_aurora_proj)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  chenchenygu, `modded-nanogpt Track 3 result #42, fixed reference interpolation
  (results/20260525_aurora_ema_ref)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  liyang2019, `modded-nanogpt Track 3 result #41, Circuit-Muon
  (results/20260523_circuit_muon)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026

  EMA-Nesterov: `arXiv:2605.25395 <https://arxiv.org/abs/2605.25395>`_, 2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import optax

from optax_snoo._src.averaging import ema_nesterov, reference_interpolation
from optax_snoo._src.circuit import circuit_ov_heads, scale_by_circuit_ov
from optax_snoo._src.recipes.base import Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_aurora_proj import (
    AuroraProjHyperparameters,
    _aurora_proj,
    _power_cool,
)
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import steps_in_order

__all__ = ["AuroraEmaRefHyperparameters", "CircuitMuonHyperparameters",
           "EmaNesterovAuroraHyperparameters"]


@dataclasses.dataclass(frozen=True)
class EmaNesterovAuroraHyperparameters(AuroraProjHyperparameters):
    """Result #40's constants (its log's, at PowerCool's 2980 steps): #30's, its momentum
    cool-down ending at 2900, and EMA-Nesterov's."""

    RECORD_STEPS = 2980

    train_steps: int = hyperparameter(2900, "where the momentum's cool-down ends (the "
                                      "log's FINAL_TRAIN_STEPS)", check="at_least_1",
                                      steps=True)
    lookahead: float = hyperparameter(0.3, "EMA-Nesterov's beta0 (0 = no lookahead)",
                                      check="non_negative")
    lookahead_ema: float = hyperparameter(0.99, "EMA-Nesterov's gamma",
                                          check="unit_interval")
    lookahead_start: int = hyperparameter(300, "EMA-Nesterov's first lookahead",
                                          check="at_least_0", steps=True)
    lookahead_stop: int = hyperparameter(1950, "EMA-Nesterov's last lookahead + 1 (the "
                                         "log's train_steps - 950)", check="at_least_0",
                                         steps=True)

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "lookahead_start", "lookahead_stop")


@dataclasses.dataclass(frozen=True)
class AuroraEmaRefHyperparameters(EmaNesterovAuroraHyperparameters):
    """Result #42's constants: #40's, and its fixed reference interpolation."""

    reference_capture: int = hyperparameter(2375, "the update after which the weights are "
                                            "kept as the reference", check="at_least_1",
                                            steps=True)
    reference_start: int = hyperparameter(2850, "the first update whose evaluated weights "
                                          "are interpolated", check="at_least_1",
                                          steps=True)
    reference_gamma: float = hyperparameter(-0.075, "the interpolation's gamma: evaluate "
                                            "w + gamma (w - reference)")

    def validate(self) -> None:
        super().validate()
        if self.reference_start < self.reference_capture:
            raise ValueError(f"reference_start={self.reference_start} must be >= "
                             f"reference_capture={self.reference_capture}")


@dataclasses.dataclass(frozen=True)
class CircuitMuonHyperparameters(EmaNesterovAuroraHyperparameters):
    """Result #41's constants: #40's, and Circuit-Muon's damping."""

    circuit_damping: float = hyperparameter(1e-3, "Circuit-Muon's floor on each head's "
                                            "||W_h||^2/hd (the log's CIRCUIT_OV_DAMPING)",
                                            check="non_negative")


def _ema_nesterov_aurora(t: EmaNesterovAuroraHyperparameters, total_steps: int, *,
                         num_heads: int | None = None, **options: Any) -> Stack:
    if isinstance(t, CircuitMuonHyperparameters):  # #41: between directions and steps
        options["coupling"] = scale_by_circuit_ov(circuit_ov_heads(num_heads),
                                                  t.circuit_damping)
    stack = _aurora_proj(t, total_steps, **options)
    inner = stack.tx
    if isinstance(t, AuroraEmaRefHyperparameters):  # #42: on the weights without lookahead
        inner = optax.chain(inner, reference_interpolation(
            t.reference_capture, t.reference_start, t.reference_gamma))
    embed_lr = _power_cool(t, "embed", total_steps)
    # The log reads the embedding group's lr ratio as set on the previous update.
    ratio = lambda count: embed_lr(jnp.maximum(count - 1, 0)) / t.embed_learning_rate
    tx = ema_nesterov(inner, t.lookahead, t.lookahead_ema, prefill=t.lookahead_start,
                      stop=t.lookahead_stop, lr_ratio=ratio)
    return dataclasses.replace(stack, tx=tx, readout=True)


track3_ema_nesterov_aurora = register(Recipe(
    "track3_ema_nesterov_aurora", EmaNesterovAuroraHyperparameters, _ema_nesterov_aurora,
    options=TRACK3_OPTIONS,
    summary="Track 3 result #40 (2890 of a 2980-step PowerCool): #30's stack (Aurora on "
    "mlp.proj, SOAP on MLP + attn.v, Contra-Muon ramp, radial brake, u/w floor, radius pin, "
    "AdamW; momentum cool-down ending at 2900) inside EMA-Nesterov (beta 0.3 lr/lr0, "
    "gamma 0.99, updates 300-1949; evaluate optax_snoo.eval_params)"))
track3_aurora_ema_ref = register(Recipe(
    "track3_aurora_ema_ref", AuroraEmaRefHyperparameters, _ema_nesterov_aurora,
    options=TRACK3_OPTIONS,
    summary="Track 3 result #42 (2860 of #40's 2980-step PowerCool): #40's stack with a "
    "fixed reference interpolation (the weights after update 2375 kept; from 2850 evaluate "
    "w - 0.075 (w - w_2375); evaluate optax_snoo.eval_params)"))
track3_circuit_muon = register(Recipe(
    "track3_circuit_muon", CircuitMuonHyperparameters, _ema_nesterov_aurora,
    options={**TRACK3_OPTIONS, "num_heads": 6},
    summary="Track 3 result #41 (2875 of #40's 2980-step PowerCool): #40's stack with "
    "Circuit-Muon's OV coupling (per-head partner post-whitening and trace-only gauge, "
    "damping 1e-3) of attn.v and attn.proj between their directions and the radius steps"))
