"""The GPT with ``scan_layers=True`` (blocks stacked ``(n_layer, ...)`` and run by
``nnx.scan``) against the same GPT unrolled: the same loss, and under K-FAC the same
per-layer factors and the same preconditioned update of every block kernel; the trainer's
``--scan_layers`` runs with K-FAC and Muon."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
import optax_snoo
import train
from optax_snoo import kfac
from optax_snoo.recipes import nanogpt_decay_mask as decay_mask
from references.error import assert_as_accurate, run_in_float64
from references.gpt64 import float64_model
from references.kfac import dense_factors64
from train import config as tc
from train.kfac_trainer import kfac_curvature_fn

N_LAYER = 2


def _f64(x):
    return np.asarray(x, np.float64)


def _kfac_step(model, tokens_BT, targets_BT, factors=None):
    """Loss, batch factors and one K-FAC direction (refresh at step 0) of ``model``; the
    factors and gradients go to the transform in float64, so its inversion adds no
    float32 rounding to the comparison. Of a float64 model with ``factors=dense_factors64``
    (under x64), everything is float64."""
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)

    def loss_fn(p):
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, p)
        logits_BTV = nnx.merge(graphdef, state)(tokens_BT)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()

    loss, grads, stats = jax.jit(lambda p: kfac.value_grad_and_stats(loss_fn, p))(params)
    curvature = (factors or kfac.curvature_from_stats)(stats, num_tokens=tokens_BT.size)
    with jax.enable_x64(True):
        curvature64, grads64, params64 = jax.tree.map(
            lambda x: jnp.asarray(x, jnp.float64), (curvature, grads, params))
        tx = kfac.scale_by_kfac(damping=1e-2, refresh=kfac.every(1, first=0),
                                layers=jax.eval_shape(lambda: curvature64))
        update = jax.jit(lambda g, p, c: tx.update(g, tx.init(p), p, curvature=c)[0])
        updates = update(grads64, params64, curvature64)
    return loss, stats, curvature, updates


def test_scanned_gpt_matches_the_unrolled_gpt():
    """With the unrolled weights stacked (``models.stack_blocks``): the same logits (with
    dropout, and decoding with a cache), the same loss, every
    block kernel captured as a scanned stack with its bias, its factors ``(L, ...)`` the
    unrolled layers' and its K-FAC update (kernel and bias) theirs; the parameters are
    annotated with the replicated ``"layers"`` axis. The scanned and the unrolled model
    are two float32 programs of one computation: each result is as accurate as the
    unrolled one's against the float64 (unrolled) model."""
    cfg = models.GPTConfig(n_layer=N_LAYER, n_head=2, n_embd=16, block_size=8, dropout=0.1,
                           vocab_size=13, bias=True, dtype="float32")
    unrolled = models.GPT(cfg, rngs=nnx.Rngs(0))
    scanned = models.GPT(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(1))
    state = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(
        state, models.stack_blocks(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))))
    nnx.update(scanned, state)
    assert state["blocks"]["attn"]["c_q"]["kernel"].get_metadata()["out_sharding"] == (
        "layers", "embed", "heads")
    assert dict(models.logical_rules())["layers"] is None

    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    key = jax.random.key(1)  # dropout: the scan folds in the same per-layer keys

    def run(model):
        """Logits with dropout, the full forward, and decoding 5 tokens then 3 more one by
        one through the cache (each step's logits and every layer's keys and values)."""
        logits, cache = model.decode(tokens[:, :5], model.init_cache(2), 0)
        steps = [(logits, cache)]
        for pos in range(5, 8):
            steps.append(model.decode(tokens[:, pos:pos + 1], steps[-1][1], pos))
        return model(tokens, dropout_key=key), model(tokens), steps

    ref = run_in_float64(lambda: run(float64_model(unrolled)))
    ref_kfac = run_in_float64(lambda: _kfac_step(float64_model(unrolled), tokens, targets,
                                                 factors=dense_factors64))
    got, peer = run(scanned), run(unrolled)
    assert_as_accurate(got[0], peer[0], ref[0], what="logits with dropout")
    assert len(got[2][0][1]) == N_LAYER
    # Each step's logits are the unrolled model's and the full forward's at that position,
    # and the cached keys and values (each layer's own, carried across steps) the
    # unrolled model's.
    for (logits_s, cache_s), (logits_u, cache_u), (logits_r, cache_r), pos in zip(
            got[2], peer[2], ref[2], (4, 5, 6, 7), strict=True):
        assert_as_accurate(logits_s, logits_u, logits_r, what=f"decode logits at {pos}")
        assert_as_accurate(logits_s[:, -1], peer[1][:, pos], ref[1][:, pos],
                           what=f"decode vs full logits at {pos}")
        for i in range(N_LAYER):
            for part in ("k", "v"):
                assert_as_accurate(*(getattr(c[i], part)[:, :pos + 1]
                                     for c in (cache_s, cache_u, cache_r)),
                                   what=f"cached {part} {i} at {pos}")
    with pytest.raises(ValueError, match="moe_every"):
        dataclasses.replace(cfg, scan_layers=True, moe_every=1)

    loss_u, stats_u, curv_u, upd_u = _kfac_step(unrolled, tokens, targets)
    loss_s, stats_s, curv_s, upd_s = _kfac_step(scanned, tokens, targets)
    loss_r, _, curv_r, upd_r = ref_kfac
    assert_as_accurate(loss_s, loss_u, loss_r, what="loss")

    kernels = ("attn/c_q", "attn/c_k", "attn/c_v", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")
    assert sorted(curv_s) == sorted(["wte/embedding"] + [f"blocks/{k}/kernel" for k in kernels])

    def stacked(update, path, layer=None):
        """A layer's [W; b] update (``c_k``'s bias gradient is zero up to rounding: a key
        bias shifts every logit of a query alike, which the softmax ignores, so it is
        bounded at its kernel's scale)."""
        for part in path.split("/"):
            update = update[part]
        w, b = (update[n] if layer is None else update[n][layer] for n in ("kernel", "bias"))
        return np.vstack([w, b[None]])

    for k in kernels:
        path = f"blocks/{k}/kernel"
        assert stats_s[path].has_bias and stats_s[path].inputs.shape[0] == N_LAYER
        d_in = stats_u[f"blocks/0/{k}/kernel"].inputs.shape[-1]
        assert curv_s[path].a.shape == (N_LAYER, d_in + 1, d_in + 1), path
        for i in range(N_LAYER):
            layer = f"blocks/{i}/{k}/kernel"
            for f in ("a", "g"):
                assert_as_accurate(getattr(curv_s[path], f)[i], getattr(curv_u[layer], f),
                                   getattr(curv_r[layer], f), what=f"{path} {i} factor {f}")
            assert_as_accurate(stacked(upd_s["blocks"], k, i),
                               stacked(upd_u["blocks"][i], k),
                               stacked(upd_r["blocks"][i], k),
                               what=f"{path} layer {i} update [W; b]")
    assert_as_accurate(upd_s["wte"]["embedding"], upd_u["wte"]["embedding"],
                       upd_r["wte"]["embedding"], what="wte")


def _tiny_run(corpus, tmp_path, **overrides):
    base = dict(
        n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=8, dtype="float32",
        optimizer="kfac", kfac_learning_rate=1e-2, adam_learning_rate=1e-2,
        final_lr_scale=0.1, warmup_iters=3, max_iters=12, lr_decay_iters=12,
        eval_interval=6, eval_iters=2, log_interval=5, checkpoint_every=100, mesh_data=1,
        num_samples=0, progress=False, bias=True, scan_layers=True, kfac_interval=3,
        kfac_first=1, vocab_multiple=8, data=str(corpus), out_dir=str(tmp_path / "run"))
    # as flags after a preset: another optimizer keeps the base's hyperparameters it has
    return tc.override(tc.override(tc.TrainConfig(), **base), **overrides)


def test_scanned_gpt_trains_with_kfac_and_muon(corpus, tmp_path):
    """``--scan_layers``: K-FAC keeps per-layer factors of the stacked kernels, Muon
    takes them as stacks of matrices, AdamW decays neither the stacked LayerNorm scales nor
    the biases; each run's validation loss falls, and the muon run samples (the decode loop
    traces the scanned blocks inside its own loop). QK-clip is refused."""
    cfg = models.GPTConfig(n_layer=2, n_embd=16, n_head=2, bias=True, scan_layers=True)
    params = nnx.to_pure_dict(nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    mask = decay_mask(params)
    assert mask["blocks"]["attn"]["c_q"]["kernel"] and mask["wte"]["embedding"]
    assert not mask["blocks"]["ln_1"]["scale"] and not mask["blocks"]["mlp"]["c_fc"]["bias"]
    labels = optax_snoo.labels.muon_adam_labels(params)
    assert labels["blocks"]["mlp"]["c_fc"]["kernel"] == "muon"
    assert labels["blocks"]["ln_2"]["bias"] == labels["blocks"]["attn"]["c_q"]["bias"] == "adam"
    assert kfac_curvature_fn(params).layers == tuple(sorted(
        f"blocks/{k}/kernel" for k in
        ("attn/c_q", "attn/c_k", "attn/c_v", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")))

    for optimizer, samples in (("kfac", 0), ("muon", 1)):
        config = _tiny_run(corpus, tmp_path / optimizer, optimizer=optimizer,
                           num_samples=samples, sample_max_new_tokens=8)
        result = train.run(config)
        evals = [h["val_loss"] for h in result.history if "val_loss" in h]
        assert evals[-1] < evals[0] - 0.3, (optimizer, evals)
    assert (result.out_dir / "samples.txt").read_text().strip()
    with pytest.raises(ValueError, match="scan_layers"):
        tc.model_config(_tiny_run(corpus, tmp_path, optimizer="muon", qk_clip_tau=100.0), 32)
