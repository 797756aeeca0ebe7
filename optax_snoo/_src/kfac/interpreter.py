"""The interpreter half of K-FAC's capture: re-evaluates a loss's jaxpr by its plan.

`run_jaxpr` evaluates the jaxpr equation by equation, binding each primitive as jax
would, except where the plan (`optax_snoo._src.kfac.jaxpr_analysis.Analysis.walk`) has
an `Action`: there it records the product's input ``x`` and adds the zero perturbation
``p`` to its output, so that one backward pass gives ``∂L/∂y = ∂L/∂p`` per layer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend as jex

from optax_snoo._src.kfac.jaxpr_analysis import Action, open_jaxpr


def run_jaxpr(jaxpr: Any, consts: list, args: list, plan: dict, perts: list,
              records: list) -> list:
    """The outputs of ``jaxpr`` on ``consts`` and ``args``; writes the input of captured
    product ``i`` to ``records[i]`` and adds ``perts[i]`` to its output."""
    env: dict = {}
    read = lambda v: v.val if isinstance(v, jex.core.Literal) else env[v]
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for n, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        action = plan.get(n)
        if action is not None and action.kind == "scan":
            ans = _run_scan(eqn, invals, action, perts, records)
        elif action is not None and action.kind == "inline":
            body = eqn.params[action.inner]
            body_consts = body.consts if isinstance(body, jex.core.ClosedJaxpr) else []
            with eqn.ctx.manager:
                ans = run_jaxpr(open_jaxpr(body), list(body_consts), invals, action.plan,
                                perts, records)
            if not eqn.primitive.multiple_results:
                ans = ans[0]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **params)
            if action is not None:
                site = action.site
                if action.kind == "site":
                    records[site.index] = invals[1 - site.kernel_pos]
                    ans = ans + perts[site.index]
                else:                                       # "fast": keep the call
                    records[site.index] = invals[action.x_input].astype(site.x_dtype)
                    ans = [ans[0] + perts[site.index], *ans[1:]]
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, ans, strict=True):
                env[v] = x
        else:
            env[eqn.outvars[0]] = ans
    return [read(v) for v in jaxpr.outvars]


def _run_scan(eqn: Any, invals: list, action: Action, perts: list, records: list) -> list:
    """A scan with captured products in its body: their perturbations enter as extra
    ``xs`` (one slice per iteration) and their inputs leave as extra ``ys``."""
    p = eqn.params
    body = p["jaxpr"]
    nc, ncar = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]

    def step(carry, inputs):
        xs_i, perts_i = inputs
        local_perts = list(perts)
        for i, pert in zip(action.indices, perts_i, strict=True):
            local_perts[i] = pert
        local_records = [None] * len(records)
        out = run_jaxpr(open_jaxpr(body), list(body.consts), [*consts, *carry, *xs_i],
                        action.plan, local_perts, local_records)
        return out[:ncar], (out[ncar:], [local_records[i] for i in action.indices])

    with eqn.ctx.manager:
        carry, (ys, recorded) = jax.lax.scan(
            step, list(init), (list(xs), [perts[i] for i in action.indices]),
            length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    for i, x in zip(action.indices, recorded, strict=True):
        records[i] = x
    return [*carry, *ys]
