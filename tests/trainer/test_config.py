"""`train.config`: every bad value is one line naming the key, the value and the range,
raised when the config is built (from the command line or from Python); `--help` reads
each key's help from its field, the model's from `models.GPTConfig`."""

from __future__ import annotations

import dataclasses

import pytest

import models
from train import config as tc
from train.optimizers import OPTIMIZERS

#: (recipe, hyperparameter): every learning rate of every recipe.
LEARNING_RATES = [(name, key) for name, recipe in sorted(OPTIMIZERS.items())
                  for key in recipe.hyperparameters.names() if key.endswith("learning_rate")]
WEIGHT_DECAYS = [("adamw", "weight_decay"), ("snoo_muon", "muon_weight_decay"),
                 ("skew_adam", "weight_decay"), ("adafactor", "weight_decay"),
                 ("kfac", "weight_decay"), ("track3_baseline", "adam_weight_decay"),
                 ("track3_newton_muon", "qkv_weight_decay")]
MOMENTA = [("adamw", "b1"), ("adamw", "b2"), ("snoo_muon", "muon_momentum"),
           ("snoo_muon", "snoo_momentum"), ("snoo_muon", "adam_b1"), ("snoo_muon", "adam_b2"),
           ("normuon", "muon_beta2"), ("kfac", "kfac_momentum"), ("kfac", "kfac_ema_decay"),
           ("snoo_muon", "muon_smoothing"), ("track3_soap_muon", "soap_beta")]


def test_every_learning_rate_is_checked():
    assert len(LEARNING_RATES) > 50 and ("snoo_muon", "snoo_learning_rate") in LEARNING_RATES


@pytest.mark.parametrize("name, key", LEARNING_RATES)
@pytest.mark.parametrize("text", ["-1e-3", "0", "nan", "inf"])
def test_a_learning_rate_must_be_positive_and_finite(name, key, text):
    with pytest.raises(ValueError) as err:
        tc.parse_args([f"--optimizer={name}", f"--{key}={text}"])
    assert str(err.value) == f"recipe {name}: {key}={float(text)!r}: expected a finite number > 0"


@pytest.mark.parametrize("name, key", [*WEIGHT_DECAYS, ("snoo_muon", "grad_clip"),
                                       ("kfac", "kfac_damping"),
                                       ("skew_adam", "clip_threshold"),
                                       ("snoo_muon", "sample_temperature")])
def test_decays_clips_and_damping_must_not_be_negative(name, key):
    with pytest.raises(ValueError) as err:
        tc.parse_args([f"--optimizer={name}", f"--{key}=-0.1"])
    prefix = "" if key in tc.KEYS else f"recipe {name}: "
    assert str(err.value) == f"{prefix}{key}=-0.1: expected a finite number >= 0"
    zero = tc.flat_dict(tc.parse_args([f"--optimizer={name}", f"--{key}=0"]))
    assert zero[key] == 0  # zero: off, or none


@pytest.mark.parametrize("name, key", MOMENTA)
@pytest.mark.parametrize("value", [1.0, -0.1, 1.5])
def test_momenta_and_betas_must_lie_in_the_unit_interval(name, key, value):
    with pytest.raises(ValueError) as err:
        tc.parse_args([f"--optimizer={name}", f"--{key}={value}"])
    assert str(err.value) == f"recipe {name}: {key}={value!r}: expected a number in [0, 1)"
    assert tc.flat_dict(tc.parse_args([f"--optimizer={name}", f"--{key}=0"]))[key] == 0


@pytest.mark.parametrize("values, message", [
    ({"optimizer": "adamw", "eps": 0.0}, "recipe adamw: eps=0.0: expected a finite number > 0"),
    ({"optimizer": "kfac", "kfac_refresh": "lr_ratio", "kfac_tau": -0.5},
     "recipe kfac: kfac_tau=-0.5: expected a finite number > 0"),
    ({"schedule": "stable_cooldown", "cooldown_frac": 0.0},
     r"recipe snoo_muon: cooldown_frac=0.0: expected a number in (0, 1]"),
    ({"final_lr_scale": 1.5}, r"recipe snoo_muon: final_lr_scale=1.5: expected a number in [0, 1]"),
    ({"optimizer": "kfac", "kfac_interval": 0},
     "recipe kfac: kfac_interval=0: expected an integer >= 1"),
    ({"optimizer": "kfac", "kfac_first": -1},
     "recipe kfac: kfac_first=-1: expected an integer >= 0"),
    ({"sample_top_k": 0}, "sample_top_k=0: expected a positive integer"),
    # a setting the chosen schedule does not read: refused, naming what reads it
    ({"schedule": "stable_cooldown", "warmup_iters": 5},
     "recipe snoo_muon: warmup_iters is read only with schedule='cosine', not "
     "schedule='stable_cooldown'; drop warmup_iters or set schedule"),
])
def test_other_ranges_name_the_key_value_and_range(values, message):
    with pytest.raises(ValueError) as err:
        tc.override(tc.TrainConfig(), **values)
    assert str(err.value) == message


def test_the_edges_of_each_range_are_accepted():
    config = tc.override(
        tc.TrainConfig(), muon_smoothing=None, sample_top_k=None, final_lr_scale=1.0,
        sample_temperature=0.0, lr_decay_iters=0)
    assert (config.optimizer.table.final_lr_scale, config.optimizer.table.lr_decay_iters) == (
        1.0, 0)
    assert tc.override(config, optimizer="kfac", kfac_first=0).optimizer.table.kfac_first == 0
    # lr_decay_iters is the cosine's: set before (a preset's), stable_cooldown drops it
    cooled = tc.override(config, schedule="stable_cooldown", cooldown_frac=1.0)
    assert cooled.optimizer.hyperparameters == {"final_lr_scale": 1.0,
                                                "schedule": "stable_cooldown",
                                                "cooldown_frac": 1.0}
    assert "lr_decay_iters" not in cooled.optimizer.resolved()


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


#: The flags of earlier versions and their names now: one name per concept, the library's.
OLD_FLAGS = {"muon_beta": "muon_momentum", "muon_beta_warmup": "muon_momentum_warmup_steps",
             "min_lr": "final_lr_scale", "newton_muon_interval": "newton_refresh_every",
             "newton_muon_ema_decay": "newton_ema_decay",
             "newton_muon_damping": "newton_damping", "skew_learning_rate": "learning_rate",
             "skew_weight_decay": "weight_decay", "skew_clip": "clip_threshold",
             "skew_policies": "policies", "muon_lr": "muon_learning_rate"}


def test_the_renamed_flags_are_known():
    assert OLD_FLAGS.items() <= tc.RENAMED["key"].items()


@pytest.mark.parametrize("old, new", sorted(tc.RENAMED["key"].items()))
def test_an_old_key_is_refused_naming_its_new_name(old, new, capsys):
    from train.__main__ import main

    readers = [n for n, r in OPTIMIZERS.items() if new in r.hyperparameters.names()]
    assert (new in tc.KEYS or readers) and old not in tc.KEYS
    assert not any(old in r.hyperparameters.names() for r in OPTIMIZERS.values())
    for build in (lambda: tc.parse_args([f"--{old}=0.5"]), lambda: tc.parse_args([f"--{old}"]),
                  lambda: tc.override(tc.TrainConfig(), **{old: 0.5}),
                  lambda: tc.parse_args([f"--optimizer={(readers or ['adamw'])[0]}",
                                         f"--{old}=0.5"])):
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value) == tc.renamed(old)
        assert str(err.value).startswith(f"--{old} was renamed --{new}")
    assert main([f"--{old}=0.5"]) == 2
    assert capsys.readouterr().err == f"error: {tc.renamed(old)}\n"


def test_a_renamed_key_whose_meaning_changed_says_so():
    with pytest.raises(ValueError, match=r"--min_lr was renamed --final_lr_scale \(a fraction "
                       r"of each group's peak now, not a learning rate"):
        tc.parse_args(["--min_lr=1e-4"])


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
