"""`train.config`: every bad value is one line naming the key, the value and the range,
raised when the config is built (from the command line or from Python); `--help` reads
each key's help from its field, the model's from `models.GPTConfig`."""

from __future__ import annotations

import dataclasses

import pytest

import models
from train import config as tc

LEARNING_RATES = ("learning_rate", "muon_learning_rate", "skew_learning_rate",
                  "kfac_learning_rate", "snoo_learning_rate")
WEIGHT_DECAYS = ("weight_decay", "muon_weight_decay", "skew_weight_decay")
MOMENTA = ("b1", "b2", "muon_beta", "snoo_momentum", "kfac_momentum", "kfac_ema_decay",
           "muon_smoothing")


@pytest.mark.parametrize("key", LEARNING_RATES)
@pytest.mark.parametrize("text", ["-1e-3", "0", "nan", "inf"])
def test_a_learning_rate_must_be_positive_and_finite(key, text):
    with pytest.raises(ValueError) as err:
        tc.parse_args([f"--{key}={text}"])
    assert str(err.value) == f"{key}={float(text)!r}: expected a finite number > 0"


@pytest.mark.parametrize("key", [*WEIGHT_DECAYS, "min_lr", "grad_clip", "kfac_damping",
                                 "skew_clip", "sample_temperature"])
def test_decays_clips_damping_and_min_lr_must_not_be_negative(key):
    with pytest.raises(ValueError) as err:
        tc.parse_args([f"--{key}=-0.1"])
    assert str(err.value) == f"{key}=-0.1: expected a finite number >= 0"
    assert tc.flat_dict(tc.parse_args([f"--{key}=0"]))[key] == 0  # zero: off, or none


@pytest.mark.parametrize("key", MOMENTA)
@pytest.mark.parametrize("value", [1.0, -0.1, 1.5])
def test_momenta_and_betas_must_lie_in_the_unit_interval(key, value):
    with pytest.raises(ValueError) as err:
        tc.parse_args([f"--{key}={value}"])
    assert str(err.value) == f"{key}={value!r}: expected a number in [0, 1)"
    assert tc.flat_dict(tc.parse_args([f"--{key}=0"]))[key] == 0


@pytest.mark.parametrize("values, message", [
    ({"eps": 0.0}, "eps=0.0: expected a finite number > 0"),
    ({"kfac_tau": -0.5}, "kfac_tau=-0.5: expected a finite number > 0"),
    ({"cooldown_frac": 0.0}, r"cooldown_frac=0.0: expected a number in (0, 1]"),
    ({"final_lr_scale": 1.5}, r"final_lr_scale=1.5: expected a number in [0, 1]"),
    ({"kfac_interval": 0}, "kfac_interval=0: expected a positive integer"),
    ({"kfac_first": -1}, "kfac_first=-1: expected an integer >= 0"),
    ({"sample_top_k": 0}, "sample_top_k=0: expected a positive integer"),
    ({"min_lr": 2e-3}, "min_lr=0.002: expected at most learning_rate=0.001 (the cosine "
                       "decays from learning_rate to min_lr)"),
])
def test_other_ranges_name_the_key_value_and_range(values, message):
    with pytest.raises(ValueError) as err:
        tc.override(tc.TrainConfig(), **values)
    assert str(err.value) == message


def test_the_edges_of_each_range_are_accepted():
    config = tc.override(
        tc.TrainConfig(), kfac_learning_rate=None, muon_smoothing=None, sample_top_k=None,
        kfac_first=0, min_lr=1e-3, learning_rate=1e-3, cooldown_frac=1.0, final_lr_scale=1.0,
        sample_temperature=0.0, lr_decay_iters=0)
    assert config.schedule.min_lr == config.adamw.learning_rate
    # min_lr is the cosine's: stable_cooldown ignores it, so it may exceed the peak there
    assert tc.override(config, schedule="stable_cooldown", min_lr=1.0).schedule.min_lr == 1.0


def test_an_unknown_attention_is_refused_naming_the_choices():
    with pytest.raises(ValueError) as err:
        tc.parse_args(["--attention=flash"])
    assert str(err.value) == ("GPTConfig.attention must be one of ('auto', 'handwritten', "
                              "'xla', 'cudnn'), got 'flash'.")
    assert tc.CHOICES["attention"] == ("auto", "handwritten", "xla", "cudnn")


def test_the_help_of_the_model_keys_is_read_from_gpt_config():
    lines = {line.split()[0]: line for line in tc.config_help().splitlines()
             if line.startswith("  --")}
    for f in dataclasses.fields(models.GPTConfig):
        if f.name == "vocab_size":  # set from the corpus: not a key
            assert f"--{f.name}" not in lines
            continue
        choices = f.metadata["choices"]
        shown = f" {{{', '.join(choices)}}}" if choices else ""
        assert f.metadata["help"] and lines[f"--{f.name}"].endswith(f.metadata["help"] + shown)
    assert lines["--mlp"].endswith("MLP kind {gelu, swiglu, relu2}")


@pytest.mark.parametrize("old, new", sorted(tc.RENAMED["key"].items()))
def test_an_old_key_is_refused_naming_its_new_name(old, new):
    assert new in tc.KEYS and old not in tc.KEYS
    for build in (lambda: tc.parse_args([f"--{old}=0.5"]), lambda: tc.parse_args([f"--{old}"]),
                  lambda: tc.override(tc.TrainConfig(), **{old: 0.5})):
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value) == f"--{old} was renamed --{new}"


@pytest.mark.parametrize("old, new", sorted(tc.RENAMED["optimizer"].items()))
def test_an_old_optimizer_name_is_refused_naming_its_new_name(old, new):
    from train.optimizers import OPTIMIZERS

    assert new in OPTIMIZERS and old not in OPTIMIZERS
    with pytest.raises(ValueError) as err:
        tc.parse_args([f"--optimizer={old}"])
    assert str(err.value) == f"--optimizer={old} was renamed --optimizer={new}"


def test_sample_start_keeps_its_characters_and_decodes_backslash_escapes():
    # A prompt beyond Latin-1 once came back as mojibake ("héllo" -> "hÃ©llo").
    for text, want in [("héllo ✓ ", "héllo ✓ "), ("ROMEO:\\n", "ROMEO:\n"),
                       ("a\\tb\\u2713 é", "a\tb✓ é"), ("日本\\n", "日本\n")]:
        assert tc.parse_args([f"--sample_start={text}"]).sample.start == want, text
