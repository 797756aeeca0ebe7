"""The records' radius steps in float64 numpy, in PyTorch's (out, in) layout, written from
modded-nanogpt Track 3's logs (#29 `scale_radial_update`, `target_radius_after_update`,
`rescale_to_radius`; #9/#46 the scalar u/w floor and the `ROWFLOOR` branch of
`Muon.step`; #46 `CWD_POST`; #5 `scale_invariant_update_`), shared by
`library.test_radius` and `library.test_recipes_track3_records`."""

from __future__ import annotations

import numpy as np

# Line numbers: records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/
# train_gpt_cwd_SOTA.py of modded-nanogpt (#46).


def ref_scale_radial_update(update, param, outward=0.5, inward=1.0, stats=None):  # :354-368
    denom = max(float(np.sum(param * param)), 1e-12)
    coeff = float(np.sum(update * param)) / denom
    radial = coeff * param
    if stats is not None:
        stats["outward" if coeff < 0 else "inward"] += 1
    return (update - radial) + (outward if coeff < 0 else inward) * radial


def ref_scalar_floor(update, param, target, stats=None):
    p_fro = max(np.linalg.norm(param), 1e-8)
    u_fro = max(np.linalg.norm(update), 1e-8)
    binds = u_fro / p_fro < target
    if stats is not None:
        stats["bind" if binds else "free"] += 1
    return update * (target * p_fro / u_fro if binds else 1.0)


def ref_row_floor(update, param, target, stats=None):  # :497-500
    r_row = np.maximum(np.linalg.norm(param, axis=1, keepdims=True), 1e-8)
    s_row = np.maximum(np.linalg.norm(update, axis=1, keepdims=True), 1e-8)
    f_row = np.maximum(target * r_row / s_row, 1.0)  # ROWFLOOR_RHO = 1, no Frobenius renorm
    if stats is not None:
        stats["bind"] += int(np.sum(f_row > 1.0))
        stats["free"] += int(np.sum(f_row == 1.0))
    return update * f_row


def ref_target_radius(param, update, lr):  # :370-377
    before = max(np.linalg.norm(param), 1e-8)
    return max(before - lr * float(np.sum(update * param)) / before, 1e-8)


def ref_rescale_to_radius(param, target):  # :379-381
    return param * (target / max(np.linalg.norm(param), 1e-8))


def ref_muon_step(p, update, lr, *, brake, floor, floor_per, pin, cwd, stats):
    """One matrix of #46's `Muon.step` after `muon_update` (record layout)."""
    if brake is not None:
        update = ref_scale_radial_update(update, p, outward=brake, stats=stats)
    if floor is not None:
        update = (ref_row_floor if floor_per == "fan_out" else ref_scalar_floor)(
            update, p, floor, stats)
    target = ref_target_radius(p, update, lr)
    mask = (update * p > 0).astype(np.float64)
    p = p - lr * update
    if pin == "first_order":
        p = ref_rescale_to_radius(p, target)
    return p * (1.0 - lr * cwd * mask)


def ref_scale_invariant_update(param, update, lr, eps=1e-10):
    """#5 MuonH (results/20260430_muonh/9319c798-6643-464a-b407-b05468e468f5.txt:204-213)."""
    p_norm = np.linalg.norm(param)
    new = param - lr * update * p_norm / max(np.linalg.norm(update), eps)
    return new / max(np.linalg.norm(new), eps) * p_norm
