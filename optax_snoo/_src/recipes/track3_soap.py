"""modded-nanogpt Track 3's SOAP-Muon records: #44 (SOAP whitening on every hidden matrix,
with the radial brake, the u/w floor, the radius pin and EMA-Nesterov; also its SOAP-Muon
part alone) and #46 (#44 with RowFloor, cautious decay and the tail-EMA readout).

Both run at ``N`` steps with every step constant a fraction of the records' 2900
(``FINAL_TRAIN_STEPS``): `Hyperparameters.scaled` gives ``round(x·N/2900)``, and each
PowerCool constant becomes ``c·(lr/lr_record)·(2900/N)^1.2`` (`optax_snoo.power_cool_scaled`),
so every group leaves its flat part at the record's fraction of the run whatever its rate
(Muon at 17.7%, Adam at 51.3%). ``track3_record()`` is #46's schedule exactly; the record
claims its loss at 2690 of the 2900-step schedule. The records' history and how each piece
was checked against their code is in ``docs/track3_recipes.md``.

References:
  Jordan et al., `modded-nanogpt Track 3 records #44 (results/20260609_soap_f1_auxb2_clean)
  and #46 (results/20260619_cwd_rowfloor_tailema)
  <https://github.com/KellerJordan/modded-nanogpt/tree/master/records/track_3_optimization>`_,
  2026
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import optax

from optax_snoo._src.averaging import ema_nesterov, tail_ema
from optax_snoo._src.labels import by_path
from optax_snoo._src.muon import scale_by_muon
from optax_snoo._src.muon_adam import group_labels, with_adam_groups
from optax_snoo._src.radius import radius_steps
from optax_snoo._src.recipes.base import Hyperparameters, Recipe, Stack, hyperparameter, register
from optax_snoo._src.recipes.track3_baseline import TRACK3_OPTIONS
from optax_snoo._src.recipes.track3_common import (
    TRACK3_RECORD_ADAM_PATTERNS,
    TRACK3_TRUST_GATE_PATTERN,
    adam_groups,
    patterns,
    steps_in_order,
)
from optax_snoo._src.schedules import (
    muon_momentum_schedule,
    power_cool_scaled,
    trust_gate_cap,
    trust_gate_floor,
)
from optax_snoo._src.soap_muon import soap_whitening

__all__ = ["SoapMuonHyperparameters", "SoapMuonRecordHyperparameters",
           "Track3RecordHyperparameters"]


@dataclasses.dataclass(frozen=True)
class SoapMuonHyperparameters(Hyperparameters):
    """Record #44's SOAP-Muon and its five Adam groups, at its 2900 steps."""

    RECORD_STEPS = 2900

    muon_learning_rate: float = hyperparameter(0.0375, "Muon's flat lr (PowerCool)",
                                               check="positive")
    embed_learning_rate: float = hyperparameter(0.3, "Adam's flat lr on the embedding",
                                                check="positive")
    head_learning_rate: float = hyperparameter(1 / 320, "Adam's flat lr on the LM head",
                                               check="positive")
    vector_learning_rate: float = hyperparameter(0.01, "Adam's flat lr of the three 1-D "
                                                 "groups", check="positive")
    power_cool_power: float = hyperparameter(1.2, "PowerCool's exponent", check="positive")
    muon_power_cool_c: float = hyperparameter(3.3169534699576625e-06, "Muon's PowerCool c "
                                              "at its record lr and 2900 steps",
                                              check="positive")
    embed_power_cool_c: float = hyperparameter(4.976805410800738e-05, "the embedding's "
                                               "PowerCool c (record lr, 2900 steps)",
                                               check="positive")
    head_power_cool_c: float = hyperparameter(5.184172302917436e-07, "the head's PowerCool c "
                                              "(record lr, 2900 steps)", check="positive")
    vector_power_cool_c: float = hyperparameter(1.6589351369335795e-06, "the 1-D groups' "
                                                "PowerCool c (record lr, 2900 steps)",
                                                check="positive")
    adam_b1: float = hyperparameter(0.8, "every Adam group's first-moment decay",
                                    check="unit_interval")
    gains_b2: float = hyperparameter(0.99, "the norm gains' second-moment decay (no bias "
                                     "correction)", check="unit_interval")
    attn_proj_bias_b2: float = hyperparameter(0.9965, "the attention output bias' second-"
                                              "moment decay (no bias correction)",
                                              check="unit_interval")
    vectors_b2: float = hyperparameter(0.997, "the other 1-D parameters' second-moment decay "
                                       "(no bias correction)", check="unit_interval")
    embed_b2: float = hyperparameter(0.99, "the embedding's second-moment decay",
                                     check="unit_interval")
    head_b2: float = hyperparameter(0.99, "the head's second-moment decay",
                                    check="unit_interval")
    adam_eps: float = hyperparameter(1e-10, "every Adam group's epsilon", check="positive")
    muon_momentum: float = hyperparameter(0.95, "Muon's momentum between its warm-up and "
                                          "cool-down", check="unit_interval")
    muon_momentum_start: float = hyperparameter(0.85, "Muon's momentum at the first and last "
                                                "update", check="unit_interval")
    muon_momentum_warmup_steps: int = hyperparameter(300, "the momentum's warm-up (steps at "
                                                     "2900)", check="at_least_0", steps=True)
    muon_momentum_cooldown_steps: int = hyperparameter(200, "the momentum's cool-down at the "
                                                       "end (steps at 2900)",
                                                       check="at_least_0", steps=True)
    soap_beta: float = hyperparameter(0.9, "SOAP's Gram and V decay", check="unit_interval")
    trust_floor: float = hyperparameter(0.45, "the trust gate's floor on attn.proj",
                                        check="fraction")
    trust_fade_start: int = hyperparameter(1375, "the floor starts fading to 0 (step at "
                                           "2900)", check="at_least_0", steps=True)
    trust_fade_end: int = hyperparameter(1625, "the floor is 0 from here (step at 2900)",
                                         check="at_least_0", steps=True)
    trust_cap: float = hyperparameter(0.85, "the trust gate's cap until trust_cap_until",
                                      check="fraction")
    trust_cap_until: int = hyperparameter(1625, "the cap is lifted here (step at 2900)",
                                          check="at_least_0", steps=True)
    ns_dtype: str = hyperparameter("bfloat16", "dtype of the Newton-Schulz iteration",
                                   choices=("bfloat16", "float32", "float64"))

    def validate(self) -> None:
        steps_in_order(self, "muon_momentum_warmup_steps")
        steps_in_order(self, "muon_momentum_cooldown_steps")
        steps_in_order(self, "trust_fade_start", "trust_fade_end")


@dataclasses.dataclass(frozen=True)
class SoapMuonRecordHyperparameters(SoapMuonHyperparameters):
    """Record #44 as it ran: its SOAP-Muon with the radial brake, the u/w floor of each
    matrix, the radius pin and EMA-Nesterov."""

    brake: float | None = hyperparameter(0.5, "the radial brake on outward steps (None = "
                                         "off)", check="fraction")
    floor: float | None = hyperparameter(0.3825, "the u/w floor: each matrix's step is at "
                                         "least this times its norm (None = off)",
                                         check="non_negative")
    lookahead: float = hyperparameter(0.3, "EMA-Nesterov's beta0 (0 = no lookahead)",
                                      check="non_negative")
    lookahead_ema: float = hyperparameter(0.99, "EMA-Nesterov's gamma",
                                          check="unit_interval")
    lookahead_start: int = hyperparameter(300, "EMA-Nesterov's first lookahead (step at 2900)",
                                          check="at_least_0", steps=True)
    lookahead_stop: int = hyperparameter(1950, "EMA-Nesterov's last lookahead + 1 (step at "
                                         "2900)", check="at_least_0", steps=True)

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "lookahead_start", "lookahead_stop")


@dataclasses.dataclass(frozen=True)
class Track3RecordHyperparameters(SoapMuonRecordHyperparameters):
    """Record #46's stack: #44's with RowFloor, cautious decay and the tail-EMA readout."""

    floor: float | None = hyperparameter(0.3825, "RowFloor's target of each output neuron's "
                                         "relative step (None = off)", check="non_negative")
    cautious_weight_decay: float = hyperparameter(0.025, "cautious weight decay after the "
                                                  "radius pin (0 = off)", check="non_negative")
    tail_start: int = hyperparameter(2400, "the tail EMA's first update (step at 2900)",
                                     check="at_least_0", steps=True)
    tail_horizon: float = hyperparameter(150.0, "the tail EMA's horizon (steps at 2900; at "
                                         "least 1)", check="positive", steps=True)
    tail_blend: float = hyperparameter(0.6, "the EMA's weight in the evaluated weights",
                                       check="fraction")

    def validate(self) -> None:
        super().validate()
        steps_in_order(self, "lookahead_start", "lookahead_stop", "tail_start")


def _power_cool(t: SoapMuonHyperparameters, group: str, total_steps: int) -> optax.Schedule:
    """``group``'s PowerCool: its c is the record's at the record's lr (the table's
    default), rescaled to this lr and run."""
    lr = getattr(t, f"{group}_learning_rate")
    return power_cool_scaled(
        lr, c=getattr(t, f"{group}_power_cool_c"),
        lr0_record=_DEFAULTS_44[f"{group}_learning_rate"],
        record_steps=t.RECORD_STEPS, total_steps=total_steps, power=t.power_cool_power)


_DEFAULTS_44 = {f.name: f.default for f in dataclasses.fields(SoapMuonHyperparameters)}


def _soap_partition(t: SoapMuonHyperparameters, total_steps: int, radius: dict[str, Any], *,
                    labels: Any, adam_patterns: dict[str, str] | None,
                    trust_gate_pattern: str, newton_schulz_plan: Any,
                    shard_newton_schulz: bool
                    ) -> tuple[optax.GradientTransformationExtraArgs, Stack, dict[str, str]]:
    """#44/#46's SOAP-Muon + Adam partition; also its stack fields and the patterns."""
    names = patterns(TRACK3_RECORD_ADAM_PATTERNS, adam_patterns)
    momentum = muon_momentum_schedule(
        t.muon_momentum_start, t.muon_momentum, warmup=t.muon_momentum_warmup_steps,
        cooldown=t.muon_momentum_cooldown_steps, total=total_steps)
    gate = by_path([(trust_gate_pattern, True)], default=False, what="trust gate")
    whitening = soap_whitening(
        t.soap_beta, precondition_frequency=1, trust_gate=gate.value,
        trust_floor=trust_gate_floor(t.trust_floor, t.trust_fade_start, t.trust_fade_end),
        trust_cap=trust_gate_cap(t.trust_cap, t.trust_cap_until))
    muon_lr = _power_cool(t, "muon", total_steps)
    muon_tx = optax.chain(
        scale_by_muon(momentum, precondition=whitening, ns_normalization="gram_frobenius",
                      coefficients="track3", ns_dtype=t.ns_dtype,
                      newton_schulz_plan=newton_schulz_plan,
                      shard_newton_schulz=shard_newton_schulz),
        radius_steps(muon_lr, **radius))
    vec = _power_cool(t, "vector", total_steps)
    groups = adam_groups(names, [
        ("gains", vec, t.adam_b1, t.gains_b2, t.adam_eps, 0.0, False),
        ("attn_proj_bias", vec, t.adam_b1, t.attn_proj_bias_b2, t.adam_eps, 0.0, False),
        ("vectors", vec, t.adam_b1, t.vectors_b2, t.adam_eps, 0.0, False),
        ("embed", _power_cool(t, "embed", total_steps), t.adam_b1, t.embed_b2, t.adam_eps,
         0.0, True),
        ("head", _power_cool(t, "head", total_steps), t.adam_b1, t.head_b2, t.adam_eps, 0.0,
         True)])
    partition = with_adam_groups(muon_tx, groups, labels=labels)
    return partition, Stack(partition, muon_lr, groups=group_labels(groups, labels)), names


_NO_RADIUS = dict(brake=None, floor=None, pin=None, cautious_weight_decay=0.0)


def _soap_muon(t: SoapMuonHyperparameters, total_steps: int, **options: Any) -> Stack:
    return _soap_partition(t, total_steps, _NO_RADIUS, **options)[1]


def _with_lookahead(t: SoapMuonRecordHyperparameters, total_steps: int, floor_per: str,
                    cautious_weight_decay: float, **options: Any
                    ) -> tuple[optax.GradientTransformationExtraArgs, Stack, dict[str, str]]:
    """#44/#46's SOAP-Muon with the radius steps, inside EMA-Nesterov."""
    radius = dict(brake=t.brake, floor=t.floor, floor_per=floor_per, pin="first_order",
                  cautious_weight_decay=cautious_weight_decay)
    partition, stack, names = _soap_partition(t, total_steps, radius, **options)
    embed_lr = _power_cool(t, "embed", total_steps)
    # The records read the embedding group's lr ratio as set on the previous update.
    ratio = lambda count: embed_lr(jnp.maximum(count - 1, 0)) / t.embed_learning_rate
    tx = ema_nesterov(partition, t.lookahead, t.lookahead_ema, prefill=t.lookahead_start,
                      stop=t.lookahead_stop, lr_ratio=ratio)
    return tx, stack, names


def _soap_muon_record(t: SoapMuonRecordHyperparameters, total_steps: int,
                      **options: Any) -> Stack:
    # #44 has no weight decay: "u/w target replaces wd's role" (its Muon.step).
    tx, stack, _ = _with_lookahead(t, total_steps, "matrix", 0.0, **options)
    return dataclasses.replace(stack, tx=tx)


def _track3_record(t: Track3RecordHyperparameters, total_steps: int, **options: Any) -> Stack:
    tx, stack, names = _with_lookahead(t, total_steps, "fan_out", t.cautious_weight_decay,
                                       **options)
    not_embedding = by_path([(names["embed"], False)], default=True, what="tail-EMA mask")
    tx = optax.chain(tx, tail_ema(t.tail_start, max(1.0, t.tail_horizon), t.tail_blend,
                                  end=total_steps, mask=not_embedding))
    return dataclasses.replace(stack, tx=tx, readout=True)


_OPTIONS = {**TRACK3_OPTIONS, "trust_gate_pattern": TRACK3_TRUST_GATE_PATTERN}

track3_soap_muon = register(Recipe(
    "track3_soap_muon", SoapMuonHyperparameters, _soap_muon, options=_OPTIONS,
    summary="Track 3 record #44's SOAP-Muon alone (SOAP whitening of every hidden matrix's "
    "momentum, frequency 1, trust gate on attn.proj; plain W - lr O on PowerCool; five Adam "
    "groups), without #44's radius controls and EMA-Nesterov"))
track3_soap_muon_record = register(Recipe(
    "track3_soap_muon_record", SoapMuonRecordHyperparameters, _soap_muon_record,
    options=_OPTIONS,
    summary="Track 3 record #44 as it ran (2750 steps): SOAP-Muon with the radial brake, the "
    "u/w floor of each matrix and the radius pin, no weight decay, five Adam groups on "
    "PowerCool, EMA-Nesterov"))
track3_record = register(Recipe(
    "track3_record", Track3RecordHyperparameters, _track3_record, options=_OPTIONS,
    summary="Track 3 record #46 (2690 steps): SOAP-Muon with the radial brake, RowFloor, the "
    "radius pin and cautious decay, five Adam groups on PowerCool, EMA-Nesterov, and the "
    "tail-EMA readout (evaluate optax_snoo.eval_params)"))
