"""Track 3 result #43's late trajectory transforms: `delta_pulses` (TrailDelta, BroadDelta)
and `phase_readout`, against a float64 numpy transcription of #43's own hooks
(maybe_apply_trail_delta_step, maybe_apply_broad_delta, maybe_capture_broad_delta,
maybe_capture_phase_readout_anchor, maybe_apply_phase_readout and their order in its
training loop) over a scaled-down run crossing every step constant, with controls that must
fail; their properties; the optax matrix.

#43's final readout toward the step-2400 anchor (``w + 0.08 (anchor - w)`` on all but the
token embedding) is #42's reference interpolation readout, not these transforms. The whole
of #43 (#41's stack with these) is `recipes.track3_tail_phase_readout`, checked with these
hooks (`Hooks`) in test_recipes_track3_tail_phase_readout.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_matrix as m
import optax_snoo
from optax_snoo import delta_pulses, eval_params, phase_readout
from references.error import in_float64, relative_error
from references.track3_constants import R43

# The record's torch names (its scopes read them) and shapes of a small model.
SHAPES = {
    "embed.weight": (24, 8),
    "blocks.0.attn.q.weight": (8, 8),
    "blocks.0.attn.v.weight": (8, 8),
    "blocks.0.attn.proj.weight": (8, 8),
    "blocks.0.mlp.fc.weight": (16, 8),
    "blocks.0.mlp.proj.weight": (8, 16),
    "blocks.0.norm.weight": (8,),
    "head.weight": (24, 8),
}


def nonembed(name, p):  # script:1275
    return name != "embed.weight"


def muon_other(name, p):  # script:1349-1353
    return (name.startswith("blocks.") and p.ndim >= 2
            and not (name.endswith(".attn.v.weight") or name.endswith(".attn.proj.weight")))


SCOPES = {"nonembed": nonembed, "muon_other": muon_other}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """#43's step constants scaled by 1/50 around its tail (2000 -> 8, ..., 2850 -> 25)
    and its coefficients as they are."""

    steps: int = 25
    broad_capture: int = 8
    broad_apply: int = 16
    broad_gamma: float = R43.broad_gamma
    trail_start: int = 21
    trail_stop: int = 25
    trail_every: int = 2
    trail_gammas: tuple = R43.trail_gammas
    trail_momentum: float = R43.trail_momentum
    t0: int = 21
    t1: int = 23
    kappa: float = R43.phase_kappa
    velocity: float = R43.phase_velocity
    orthogonal: bool = R43.phase_mode == "orthogonal"
    normalize: bool = R43.phase_normalize
    broad_scope: str = R43.broad_scope
    order: str = "trail,broad,phase"


RECORD = Schedule()
LR = 0.05


def gradient(params, t):
    """A fixed direction, fresh noise and a small bounded weight term (well-conditioned:
    two correct programs stay together over the run)."""
    out = {}
    for i, (name, p) in enumerate(sorted(params.items())):
        rng = np.random.default_rng(1000 * t + i)
        d = np.random.default_rng(i).normal(size=p.shape)
        out[name] = d + 0.5 * rng.normal(size=p.shape) + 0.3 * np.tanh(p)
    return out


def init_params():
    rng = np.random.default_rng(7)
    return {name: rng.normal(size=shape) / np.sqrt(shape[-1]) for name, shape in SHAPES.items()}


@dataclasses.dataclass
class Hooks:
    """#43's hooks on a dict of weights by the record's names (``name -> array``, ``TORCH``
    maps other names to them): `after_update` is the loop's calls after the optimizer's
    step (script:2309-2314), `phase_readout` its final validation's (script:1472-1568)."""

    s: Schedule = RECORD
    torch: dict | None = None  # our name -> the record's (its scopes read them)

    def __post_init__(self):
        self.trail_state = self.trail_last = self.trail_mom = None
        self.trail_count = 0
        self.broad_state, self.broad_applied = None, False
        self.phase0 = self.phase1 = None

    def in_scope(self, scope, name, p):
        return SCOPES[scope](name if self.torch is None else self.torch[name], p)

    def after_update(self, params, t):
        """The hooks after update ``t`` (``step + 1``), moving ``params`` in place."""
        s = self.s
        # maybe_apply_trail_delta_step (script:1657-1774)
        if s.trail_start <= t <= s.trail_stop:
            scoped = [k for k, p in params.items() if self.in_scope("nonembed", k, p)]
            if self.trail_state is None:
                self.trail_state = {k: params[k].copy() for k in scoped}
                self.trail_last = t
            elif t - self.trail_last >= s.trail_every:
                gamma = s.trail_gammas[0] if self.trail_count == 0 else s.trail_gammas[1]
                if self.trail_mom is None:
                    self.trail_mom = {k: np.zeros_like(params[k]) for k in scoped}
                for k in scoped:
                    delta = params[k] - self.trail_state[k]
                    delta = delta + s.trail_momentum * self.trail_mom[k]
                    self.trail_mom[k] = delta.copy()
                    params[k] = params[k] + delta * gamma
                self.trail_state = {k: params[k].copy() for k in scoped}
                self.trail_last = t
                self.trail_count += 1
        # maybe_apply_broad_delta, then maybe_capture_broad_delta (script:1361-1400)
        if t == s.broad_apply and not self.broad_applied and self.broad_state is not None:
            for k, anchor in self.broad_state.items():
                params[k] = params[k] + (params[k] - anchor) * s.broad_gamma
            self.broad_applied = True
        if t == s.broad_capture and self.broad_state is None:
            self.broad_state = {k: p.copy() for k, p in params.items()
                                if self.in_scope(s.broad_scope, k, p)}
        # maybe_capture_phase_readout_anchor (script:1448-1470)
        if t == s.t0 and self.phase0 is None:
            self.phase0 = {k: p.copy() for k, p in params.items()
                           if self.in_scope("muon_other", k, p)}
        if t == s.t1 and self.phase1 is None:
            self.phase1 = {k: p.copy() for k, p in params.items()
                           if self.in_scope("muon_other", k, p)}

    def phase_readout(self, params):
        """maybe_apply_phase_readout at the final validation (script:1472-1568): the
        weights it evaluates (``params`` is left as it is)."""
        s = self.s
        evaluated = dict(params)
        for k in self.phase0:
            d_prev = self.phase1[k] - self.phase0[k]
            velocity = params[k] - self.phase1[k]
            accel = velocity - d_prev
            if s.orthogonal:
                coeff = (accel * velocity).sum() / max((velocity ** 2).sum(),
                                                      R43.phase_velocity_sq_floor)
                phase = accel - coeff * velocity
            else:
                phase = accel
            if s.normalize:
                phase = phase * (np.linalg.norm(velocity)
                                 / (np.linalg.norm(phase) + R43.phase_norm_eps))
            evaluated[k] = params[k] + velocity * s.velocity + phase * s.kappa
        return evaluated


def record_run(s: Schedule = RECORD):
    """The record's loop (script:2239-2315) with its hooks, SGD as the optimizer: the
    weights after each update and hooks, and those the final validation evaluates before
    the final readout (phase readout applied)."""
    params = init_params()
    hooks = Hooks(s)
    history = []
    for step in range(s.steps):
        g = gradient(params, step)
        params = {k: p - LR * g[k] for k, p in params.items()}
        hooks.after_update(params, step + 1)
        history.append({k: p.copy() for k, p in params.items()})
    return history, hooks.phase_readout(params)


def masked(tx, scope):
    return optax.masked(tx, lambda params: {k: SCOPES[scope](k, p) for k, p in params.items()})


def our_tx(s: Schedule):
    parts = {
        "trail": masked(delta_pulses(s.trail_start, s.trail_every, s.trail_gammas,
                                     stop=s.trail_stop, momentum=s.trail_momentum),
                        "nonembed"),
        "broad": masked(delta_pulses(s.broad_capture, s.broad_apply - s.broad_capture,
                                     s.broad_gamma, stop=s.broad_apply), s.broad_scope),
        "phase": masked(phase_readout(s.t0, s.t1, s.steps, s.kappa,
                                      velocity_weight=s.velocity, orthogonal=s.orthogonal,
                                      normalize=s.normalize), "muon_other"),
    }
    return optax.chain(optax.sgd(LR), *(parts[name] for name in s.order.split(",")))


def our_run(s: Schedule, final=None):
    with in_float64():
        tx = our_tx(s) if final is None else optax.chain(our_tx(s), final)
        params = {k: jnp.asarray(v) for k, v in init_params().items()}
        state = tx.init(params)
        update = jax.jit(tx.update)
        history, evals = [], []
        for step in range(s.steps):
            g = gradient(jax.tree.map(np.asarray, params), step)
            updates, state = update(jax.tree.map(jnp.asarray, g), state, params)
            params = optax.apply_updates(params, updates)
            history.append(jax.tree.map(np.asarray, params))
            evals.append(jax.tree.map(np.asarray, eval_params(params, state)))
        return history, evals


def worst(ours, ref):
    return max(relative_error(ours[k], ref[k]) for k in ref)


def distance(s: Schedule, ref_history, ref_eval):
    history, evals = our_run(s)
    train = max(worst(h, r) for h, r in zip(history, ref_history, strict=True))
    return train, worst(evals[-1], ref_eval), history, evals


CONTROLS = {
    "trail first gamma x1.05": dict(trail_gammas=(R43.trail_gammas[0] * 1.05,
                                                  R43.trail_gammas[1])),
    "trail last gamma x1.05": dict(trail_gammas=(R43.trail_gammas[0],
                                                 R43.trail_gammas[1] * 1.05)),
    "trail momentum 0.95": dict(trail_momentum=0.95),
    "trail one step late": dict(trail_start=22, trail_every=2),
    "broad gamma x1.05": dict(broad_gamma=R43.broad_gamma * 1.05),
    "broad capture one step late": dict(broad_capture=9),
    "broad on nonembed": dict(broad_scope="nonembed"),
    "kappa x1.05": dict(kappa=R43.phase_kappa * 1.05),
    "t1 + 1": dict(t1=24),
    "not orthogonal": dict(orthogonal=False),
    "not normalised": dict(normalize=False),
    "phase before trail": dict(order="phase,trail,broad"),
}


def test_matches_the_record_in_float64_and_controls_fail():
    ref_history, ref_eval = record_run()
    train, readout, history, evals = distance(RECORD, ref_history, ref_eval)
    tol = 1e-13  # float64 rounding over 25 updates of a well-conditioned run
    assert train <= tol and readout <= tol, (train, readout)
    # A readout: the evaluated weights are the training weights except after the last update.
    for h, e in zip(history[:-1], evals[:-1], strict=True):
        jax.tree.map(np.testing.assert_array_equal, h, e)
    assert worst(history[-1], ref_history[-1]) <= tol  # training weights not moved by it
    assert worst(evals[-1], ref_history[-1]) > 1e-6
    for name, kw in CONTROLS.items():
        c_train, c_readout, _, _ = distance(dataclasses.replace(RECORD, **kw), ref_history,
                                            ref_eval)
        assert max(c_train, c_readout) > 1e3 * tol, (name, c_train, c_readout)


ANCHOR = 16  # #43's final-readout anchor, 2400 scaled: after update 16, BroadDelta's pulse


def record_final_readout(history, evaluated, anchor=ANCHOR, alpha=R43.anchor_alpha,
                         torch=None):
    """apply_final_readout_alpha (script:1416-1438) after the phase readout, toward the
    non-embedding weights copied after update ``anchor`` (after its hooks; ``torch``:
    our names -> the record's, as `Hooks`)."""
    out = dict(evaluated)
    for k, a in history[anchor - 1].items():
        if nonembed(k if torch is None else torch[k], a):
            out[k] = evaluated[k] + (a - evaluated[k]) * alpha
    return out


def test_with_the_final_readout():
    """#43's whole tail: its final readout toward the step-2400 anchor is #42's reference
    interpolation with gamma = -alpha, last in the chain (it runs once that readout is in
    the library)."""
    interpolation = getattr(optax_snoo, "reference_interpolation", None)
    if interpolation is None:
        pytest.skip("reference_interpolation (#42's readout) is not in this tree")
    history, evaluated = record_run()
    ref = record_final_readout(history, evaluated)
    mask = lambda params: {k: nonembed(k, p) for k, p in params.items()}

    def final_distance(anchor, gamma):
        evals = our_run(RECORD, interpolation(anchor, RECORD.steps, gamma, mask=mask))[1]
        return worst(evals[-1], ref)

    assert final_distance(ANCHOR, -R43.anchor_alpha) <= 1e-13
    assert final_distance(ANCHOR, -R43.anchor_alpha * 1.05) > 1e-10  # control: alpha
    assert final_distance(ANCHOR - 1, -R43.anchor_alpha) > 1e-10  # control: before the pulse


def test_record_pulse_steps():
    """At #43's own counts: pulses after updates 2750 and 2850 (TrailDelta), 2400
    (BroadDelta), and nothing else moves."""
    tx = delta_pulses(R43.trail_start, R43.trail_every, R43.trail_gammas,
                      stop=R43.trail_stop, momentum=R43.trail_momentum)
    broad = delta_pulses(R43.broad_capture, R43.broad_apply - R43.broad_capture,
                         R43.broad_gamma, stop=R43.broad_apply)
    params, ones = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
    for t in (R43.broad_capture, R43.trail_start, R43.steps, 2400, 2750, 2851, 2950):
        for transform, moves in ((tx, (2750, 2850)), (broad, (2400,))):
            state = transform.init(params)
            state = state._replace(count=jnp.asarray(t - 1, jnp.int32))
            u, _ = transform.update(ones, state, params)
            assert bool(jnp.any(u["w"] != 1.0)) == (t in moves), (t, moves)


def test_properties():
    # gammas: the last repeats; momentum 0 keeps no buffer; a masked leaf is untouched.
    tx = optax.chain(optax.sgd(1.0), optax.masked(delta_pulses(1, 1, (-0.5, 0.25)),
                                                  {"a": True, "b": False}))
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    state = tx.init(params)
    assert state[1].inner_state.momentum is None
    seen = []
    for _ in range(4):
        u, state = tx.update({"a": jnp.ones(2), "b": jnp.ones(2)}, state, params)
        params = optax.apply_updates(params, u)
        seen.append(float(params["a"][0]))
    # -1 (copied); -2 -> -2 - .5(-1) = -1.5; -2.5 -> -2.5 + .25(-1) = -2.75; -3.75 - .25
    assert seen == [-1.0, -1.5, -2.75, -4.0]
    assert float(params["b"][0]) == -4.0
    # The phase readout is of update `end` only: before and after, the params.
    tx = optax.chain(optax.sgd(1.0), phase_readout(1, 2, 3, 0.5))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    for i, g in enumerate(([1.0, 0.0], [1.0, 1.0], [1.0, 3.0], [1.0, 1.0])):
        u, state = tx.update({"w": jnp.array(g)}, state, params)
        params = optax.apply_updates(params, u)
        ev = eval_params(params, state)["w"]
        assert np.allclose(ev, [-1.5, -4.5]) if i == 2 else np.array_equal(ev, params["w"])


PARAMS = {"a": 0.5 * jax.random.normal(jax.random.key(3), (8, 4)),
          "b": 0.3 * jax.random.normal(jax.random.key(7), (6,))}


def pulses(gamma=-0.3):
    return optax.chain(optax.sgd(0.05), delta_pulses(1, 1, gamma, momentum=0.5))


def readout():
    return optax.chain(optax.sgd(0.05), phase_readout(1, 2, 3, 0.5))


@pytest.mark.parametrize("make", [pulses, readout])
def test_optax_matrix(make, tmp_path):
    tx = make()
    f64 = dict(float64=tx)  # state dtypes follow the params
    m.check_jit_matches_eager(tx, PARAMS, steps=3, **f64)
    m.check_state_stable(tx, PARAMS, steps=3)
    m.check_dtype_preserved(tx, PARAMS, steps=3)
    m.check_multisteps(tx, PARAMS, steps=3, **f64)
    m.check_partition(tx, PARAMS, steps=3, **f64)
    m.check_sharded_state(tx, PARAMS, steps=3, **f64)
    m.check_orbax_roundtrip(tx, PARAMS, tmp_path, steps_before=1, steps_after=2)
    m.check_nnx_optimizer(tx, steps=3)


def test_inject_hyperparams():
    state = m.check_inject_hyperparams(pulses, PARAMS, dict(gamma=-0.2), steps=3, float64=True)
    assert float(state.hyperparams["gamma"]) == pytest.approx(-0.2)


@pytest.mark.parametrize("make, message", [
    (lambda: delta_pulses(0, 1, -0.1), "start must be an integer >= 1"),
    (lambda: delta_pulses(1, 0, -0.1), "every must be an integer >= 1"),
    (lambda: delta_pulses(5, 1, -0.1, stop=4), "stop must be an integer >= 5"),
    (lambda: delta_pulses(1, 1, ()), "gammas must be a number or a non-empty tuple"),
    (lambda: delta_pulses(1, 1, lambda t: 0.1), "gammas must be"),
    (lambda: delta_pulses(1, 1, -0.1, momentum=-1.0), "momentum must be a number >= 0"),
    (lambda: phase_readout(0, 2, 3), "t0 must be an integer >= 1"),
    (lambda: phase_readout(2, 2, 3), "t1 must be an integer >= 3"),
    (lambda: phase_readout(1, 3, 2), "end must be an integer >= 3"),
    (lambda: phase_readout(1, 2, 3, kappa=float("nan")), "kappa must be a finite number"),
])
def test_bad_input(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("tx", [delta_pulses(1, 1, -0.1), phase_readout(1, 2, 3)])
def test_update_needs_params(tx):
    with pytest.raises(ValueError, match="needs params"):
        tx.update(PARAMS, tx.init(PARAMS))


@pytest.mark.parametrize("tx", [delta_pulses(1, 1, -0.1, momentum=1.0),
                                phase_readout(1, 2, 3)])
def test_each_state_leaf_is_its_own_buffer(tx):
    """A trainer donates the state: one buffer in two places is refused at run time (the
    copies and momentum once shared their zeros)."""
    state = tx.init(PARAMS)
    buffers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state) if x.size]
    assert len(buffers) == len(set(buffers))
