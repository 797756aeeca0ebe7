"""K-FAC as optax transformations, with learning-rate-aware refresh schedules.

- `value_grad_and_stats`, `curvature_from_stats`, `describe`: layer statistics of any JAX
  model (read from the loss's jaxpr), the factors they give, and what is captured;
- `layer_factors`: batch Kronecker factors ``(A, G)`` of a dense layer or expert stack;
  `factor_spec`: where a factor lives on a mesh (rows split over the batch axes);
- `refresh_inverse` / `apply_inverse` / `precondition`: one layer's damped inverse;
- `every`, `by_lr_phase`, `lr_ratio`, `refresh_steps`: when to refresh;
- `scale_by_kfac`, `kfac`: the transformation and the optimizer alias;
- `kfac_states`, `event_row`, `refresh_events`, `warm_start`, `estimate_factors`: host
  helpers for trainers.
"""

from optax_snoo._src.kfac.blocks import layers_from_params
from optax_snoo._src.kfac.capture import (
    LayerStats,
    curvature_from_stats,
    describe,
    value_grad_and_stats,
)
from optax_snoo._src.kfac.factors import LayerCurvature, factor_spec, layer_factors
from optax_snoo._src.kfac.grafting import GraftState, graft
from optax_snoo._src.kfac.host import (
    estimate_factors,
    event_row,
    kfac_states,
    refresh_events,
    warm_start,
)
from optax_snoo._src.kfac.precondition import (
    EigenInverse,
    PiInverse,
    SpectrumStats,
    apply_inverse,
    clipped_eigh,
    identity_inverse,
    pi_adjustment,
    precondition,
    refresh_inverse,
)
from optax_snoo._src.kfac.refresh import (
    PHASES,
    ByLrPhase,
    Every,
    LrRatio,
    RefreshPolicy,
    by_lr_phase,
    every,
    lr_ratio,
    policy_step,
    refresh_steps,
)
from optax_snoo._src.kfac.transform import (
    KfacRefreshEvent,
    ScaleByKfacState,
    kfac,
    scale_by_kfac,
)

__all__ = [
    "PHASES",
    "ByLrPhase",
    "EigenInverse",
    "Every",
    "GraftState",
    "KfacRefreshEvent",
    "LayerCurvature",
    "LayerStats",
    "LrRatio",
    "PiInverse",
    "RefreshPolicy",
    "ScaleByKfacState",
    "SpectrumStats",
    "apply_inverse",
    "by_lr_phase",
    "clipped_eigh",
    "curvature_from_stats",
    "describe",
    "estimate_factors",
    "event_row",
    "every",
    "factor_spec",
    "graft",
    "identity_inverse",
    "kfac",
    "kfac_states",
    "layer_factors",
    "layers_from_params",
    "lr_ratio",
    "pi_adjustment",
    "policy_step",
    "precondition",
    "refresh_events",
    "refresh_inverse",
    "refresh_steps",
    "scale_by_kfac",
    "value_grad_and_stats",
    "warm_start",
]
