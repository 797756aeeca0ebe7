"""modded-nanogpt Track 3 records' constants, typed in from the records' own scripts.

The recipe tests compare the library's recipes with these numbers, never with the
library's own tables, so that a wrong digit in the library fails a test. Each value names
the file and line it was read from, relative to ``records/track_3_optimization/`` of
https://github.com/KellerJordan/modded-nanogpt (snapshot of 2026-12). A log's script is
the part before its first ``====`` line; where a record's folder holds a script equal to
its logs' (or, for #46, the script whose values the logs set through the environment), it
is cited instead.
"""

from __future__ import annotations

#: Track 3's Newton-Schulz: ``a, b, c = 2, -1.5, 0.5`` for 12 iterations, after
#: ``X / (‖X‖_F + 1e-7)`` (#36, #5, #13, #15) or ``X / max(sqrt(‖XᵀX‖_F), 1e-7)`` (#44, #46).
NS_TRIPLE = (2.0, -1.5, 0.5)        # train_gpt_simple.py:172 (the same line in every record)
NS_STEPS = 12                       # train_gpt_simple.py:173
NS_COEFFICIENTS = (NS_TRIPLE,) * NS_STEPS
NS_EPS = 1e-7                       # train_gpt_simple.py:170; train_gpt_cwd_SOTA.py:282


class R36:
    """#36, the tuned Muon + AdamW baseline (3250 steps):
    ``train_gpt_simple.py`` (its log, results/20260610_tuned_baseline_3250/263ea3c4-...txt,
    holds the same script)."""

    steps = 3250                    # train_gpt_simple.py:267 train_steps
    muon_lr = 0.025                 # train_gpt_simple.py:292 Muon(..., lr=0.025,
    muon_wd = 0.05                  # train_gpt_simple.py:292 weight_decay=0.05)
    muon_mu = 0.95                  # train_gpt_simple.py:191 Muon(..., mu=0.95)
    embed_lr = 0.7                  # train_gpt_simple.py:287
    head_lr = 0.004                 # train_gpt_simple.py:288
    vector_lr = 0.015               # train_gpt_simple.py:289
    adam_betas = (0.8, 0.95)        # train_gpt_simple.py:290
    adam_eps = 1e-10                # train_gpt_simple.py:290
    adam_wd = 0.001                 # train_gpt_simple.py:290
    cooldown_frac = 0.7             # train_gpt_simple.py:301 set_hparams(step, cooldown_frac=0.7)


class R5:
    """#5, MuonH (3325 steps): results/20260430_muonh/9319c798-6643-464a-b407-b05468e468f5.txt
    (the log the README links; the folder's ``train_gpt_simple_muonh.py`` differs)."""

    log = "results/20260430_muonh/9319c798-6643-464a-b407-b05468e468f5.txt"
    steps = 3325                    # log:291 train_steps
    muon_lr = 0.018                 # log:328-331 MuonH(..., lr=0.018)
    muon_mu = 0.95                  # log:195 muon_update(..., mu=0.95); log:220
    hyperball_eps = 1e-10           # log:204 scale_invariant_update_(..., eps=1e-10)
    embed_lr = 0.3                  # log:324
    head_lr = 1 / 320               # log:325
    vector_lr = 0.01                # log:326
    adam_betas = (0.8, 0.95)        # log:327
    adam_eps = 1e-10                # log:327
    adam_wd = 0.0                   # log:327
    muon_cooldown_frac = 1.0        # log:352 cooldown_frac = 1.0 if "h" else 0.4
    adam_cooldown_frac = 0.4        # log:352


class R13:
    """#13, MuLoCo around NorMuonH (3210 steps):
    results/20260504_muloco_normuonh/train_gpt_simple_muloco_normuonh.py (= its logs'
    script); the run's environment values from the README's log
    results/20260504_muloco_normuonh/7fba9434-58d8-4166-b6a7-d62ef8d17e5d.txt."""

    script = "results/20260504_muloco_normuonh/train_gpt_simple_muloco_normuonh.py"
    log = "results/20260504_muloco_normuonh/7fba9434-58d8-4166-b6a7-d62ef8d17e5d.txt"
    steps = 3210                    # log:510 "... H=30 train_steps=3210"
    outer_lr = 0.7                  # log:510 "olr=0.7"
    outer_momentum = 0.5            # log:510 "omom=0.5"
    sync_interval = 30              # log:510 "H=30"
    muon_lr = 0.018                 # script:402-405 NorMuonH(..., lr=0.018)
    muon_mu = 0.95                  # script:234 NorMuonH(..., mu=0.95,
    muon_beta2 = 0.95               # script:234 beta2=0.95,
    normuon_eps = 1e-10             # script:234 eps=1e-10)
    embed_lr = 0.3                  # script:398
    head_lr = 1 / 320               # script:399
    vector_lr = 0.01                # script:400
    adam_betas = (0.8, 0.95)        # script:401
    adam_eps = 1e-10                # script:401
    muon_cooldown_frac = 1.0        # script:440
    adam_cooldown_frac = 0.4        # script:440


class R15:
    """#15, Newton-Muon (3300 steps):
    results/20260505_newton_muon/train_gpt_simple_newton_muon.py (= its logs' script)."""

    script = "results/20260505_newton_muon/train_gpt_simple_newton_muon.py"
    steps = 3300                    # script:423 train_steps
    # (lr, weight decay) of the four Muon groups: script:454-457
    qkv = (0.020, 0.025)
    attn_proj = (0.025, 0.025)
    mlp_fc = (0.030, 0.0375)
    mlp_proj = (0.030, 0.025)
    muon_mu = 0.95                  # script:230 Muon(..., mu=0.95,
    refresh_interval = 64           # script:230, 458 refresh_interval=64
    ema_alpha = 0.05                # script:310-311 _precond_alpha ... .mul_(0.05); cov.lerp_(K, α)
    damping = 0.2                   # script:314 reg = diag.sum(-1) / d * 0.2 + 1e-8
    damping_eps = 1e-8              # script:314
    initial_cov = 0.001             # script:287 self._eye_(s["cov"], 0.001)
    embed_lr = 0.3                  # script:443
    head_lr = 1 / 320               # script:444
    vector_lr = 0.01                # script:445
    adam_betas = (0.8, 0.95)        # script:446
    adam_eps = 1e-10                # script:446
    cooldown_frac = 0.7             # script:468 set_hparams(step, cooldown_frac=0.7)


class R44:
    """#44, SOAP-Muon (the 2900-step schedule):
    results/20260609_soap_f1_auxb2_clean/train_gpt_clean_SOTA.py (= its logs' script)."""

    script = "results/20260609_soap_f1_auxb2_clean/train_gpt_clean_SOTA.py"
    steps = 2900                    # script:57 FINAL_TRAIN_STEPS; :59 FINAL_SCHEDULE_STEPS
    power = 1.2                     # script:60 FINAL_LR_POWER
    embed_c = 4.976805410800738e-05   # script:61 ADAM_EMBED_POWER_C
    head_c = 5.184172302917436e-07    # script:62 ADAM_PROJ_POWER_C
    vector_c = 1.6589351369335795e-06  # script:63 ADAM_OTHER_POWER_C
    muon_c = 3.3169534699576625e-06   # script:64 MUON_POWER_C
    muon_lr = 0.0375                # script:68 MUON_LR
    soap_beta = 0.90                # script:72 SOAP_BETA2
    soap_eps = 1e-8                 # script:377 soap_precondition_momentum(..., eps=1e-8)
    soap_v_floor = 1e-8 * 1e-8      # script:384 exp_avg_sq.clamp_min(eps * eps)
    trust_floor = 0.45              # script:75 ATTN_EARLY_TRUST_FLOOR
    trust_cap = 0.85                # script:76 ATTN_EARLY_TRUST_CAP
    trust_fade_start = 1375         # script:77 ATTN_TRUST_FLOOR_END_STEP
    trust_fade_end = 1625           # script:78 ATTN_TRUST_FLOOR_FADE_END_STEP
    trust_min_agree = 0.20          # script:79
    trust_min_grad_align = 0.00     # script:80
    mu_min, mu_max = 0.85, 0.95     # script:813-814 _MU_MIN, _MU_MAX
    mu_warmup = 300                 # script:815 _MU_WARMUP_STEPS
    mu_cooldown = 200               # script:817 _MU_COOLDOWN_STEPS
    embed_lr = 0.3                  # script:762
    head_lr = 1 / 320               # script:763
    embed_head_betas = (0.8, 0.99)  # script:764 (torch AdamW: bias-corrected)
    adam_eps = 1e-10                # script:764, 779
    gains = (0.01, 0.99)            # script:775 (lr, beta2) of the bias-correction-free Adam
    vectors = (0.01, 0.997)         # script:776
    attn_proj_bias = (0.01, 0.9965)  # script:777
    adam_b1 = 0.8                   # script:764, 775-777
    # #44 as it ran: its Muon.step's radius steps and the EMA-Nesterov around it.
    target_uw = 0.3825              # script:69 TARGET_UW (= SOAP_/NONSOAP_TARGET_UW, :70-71)
    brake = 0.5                     # script:84 RADIAL_OUTWARD_SCALE (inward 1.0, :85)
    cwd = 0.0                       # script:468 "WD set to 0" (no decay at all)
    lookahead = 0.3                 # script:787 lookahead_stepsize=0.3
    lookahead_ema = 0.99            # script:789
    lookahead_prefill = 300         # script:790 prefill_steps=300
    lookahead_stop = 2900 - 950     # script:791 rest_steps=train_steps - 950
    tail_start = None               # no tail EMA in #44


class R46:
    """#46, the whole stack (2900-step schedule, loss claimed at 2690):
    results/20260619_cwd_rowfloor_tailema/train_gpt_cwd_SOTA.py (its logs run an
    environment-driven version of it with these values)."""

    script = "results/20260619_cwd_rowfloor_tailema/train_gpt_cwd_SOTA.py"
    steps = 2900                    # script:69 FINAL_TRAIN_STEPS; :71 FINAL_SCHEDULE_STEPS
    power = 1.2                     # script:72 FINAL_LR_POWER
    embed_c = 4.976805410800738e-05   # script:73 ADAM_EMBED_POWER_C
    head_c = 5.184172302917436e-07    # script:74 ADAM_PROJ_POWER_C
    vector_c = 1.6589351369335795e-06  # script:75 ADAM_OTHER_POWER_C (all three 1-D groups)
    muon_c = 3.3169534699576625e-06   # script:76 MUON_POWER_C
    muon_lr = 0.0375                # script:80 MUON_LR
    target_uw = 0.3825              # script:81 TARGET_UW (RowFloor's target)
    soap_beta = 0.90                # script:84 SOAP_BETA2
    soap_v_floor = 1e-8 * 1e-8      # script:405, 412 clamp_min(eps * eps), eps=1e-8
    trust_floor = 0.45              # script:87
    trust_cap = 0.85                # script:88
    trust_fade_start = 1375         # script:89
    trust_fade_end = 1625           # script:90
    brake = 0.5                     # script:96 RADIAL_OUTWARD_SCALE
    cwd = 0.025                     # script:108 CWD
    tail_tau = 150.0                # script:111 TAILEMA_TAU
    tail_start = 2400               # script:112 TAILEMA_START
    tail_lambda = 0.6               # script:114 TAILEMA_LAMBDA
    lookahead = 0.3                 # script:831 lookahead_stepsize=0.3
    lookahead_ema = 0.99            # script:833
    lookahead_prefill = 300         # script:834 prefill_steps=300
    lookahead_stop = 2900 - 950     # script:835 rest_steps=train_steps - 950
    mu_min, mu_max = 0.85, 0.95     # script:857-858
    mu_warmup = 300                 # script:859
    mu_cooldown = 200               # script:861
    embed_lr = 0.3                  # script:806
    head_lr = 1 / 320               # script:807
    embed_head_betas = (0.8, 0.99)  # script:808
    adam_eps = 1e-10                # script:808, 823
    gains = (0.01, 0.99)            # script:819
    vectors = (0.01, 0.997)         # script:820
    attn_proj_bias = (0.01, 0.9965)  # script:821
    adam_b1 = 0.8                   # script:808, 819-821


class R2:
    """#2, plain Adam on the matrices (5625 steps, "most likely undertuned"): the script of
    results/a63a68d1-24aa-4a22-af9a-224e43209ea4.txt (before its first ``====`` line)."""

    log = "results/a63a68d1-24aa-4a22-af9a-224e43209ea4.txt"
    steps = 5625                    # log:267 train_steps
    matrix_lr = 0.0015              # log:271 block_adamw_lr
    matrix_wd = 0.10                # log:272 block_adamw_weight_decay
    warmup_steps = 250              # log:273 block_adamw_warmup_steps (every group: log:296)
    matrix_betas = (0.9, 0.95)      # log:274 block_adamw_betas
    matrix_eps = 1e-10              # log:288
    embed_lr = 0.3                  # log:283
    head_lr = 1 / 320               # log:284
    vector_lr = 0.01                # log:285
    adam_betas = (0.8, 0.95)        # log:286
    adam_eps = 1e-10                # log:286
    adam_wd = 0.0                   # log:286
    cooldown_frac = 0.7             # log:299 set_hparams(step, cooldown_frac=0.7)


class R4:
    """#4, AdamH (4875 steps): results/20260430_adamh/7533dd87-107f-4a4f-8229-acbec0fb00ac.txt
    (the log the README links)."""

    log = "results/20260430_adamh/7533dd87-107f-4a4f-8229-acbec0fb00ac.txt"
    steps = 4875                    # log:272 train_steps
    matrix_lr = 0.018               # log:273 matrix_lr
    warmup_steps = 250              # log:274 h_warmup_steps
    matrix_betas = (0.9, 0.95)      # log:301 AdamH(..., betas=(0.9, 0.95), eps=1e-8)
    matrix_eps = 1e-8               # log:301
    hyperball_eps = 1e-10           # log:178 scale_invariant_update_(..., eps=1e-10)
    embed_lr = 0.3                  # log:296
    head_lr = 1 / 320               # log:297
    vector_lr = 0.01                # log:298
    adam_betas = (0.8, 0.95)        # log:299
    adam_eps = 1e-10                # log:299
    matrix_cooldown_frac = 1.0      # log:323
    aux_cooldown_frac = 0.4         # log:331


class R7:
    """#7, Muon² (3325 steps): results/20260501_muonsq/bb903816-ea27-4f5f-8028-c963d38c6a7f.txt
    (its folder's train_gpt_simple_muonsq.py is the same optimizer)."""

    log = "results/20260501_muonsq/bb903816-ea27-4f5f-8028-c963d38c6a7f.txt"
    steps = 3325                    # log:272 train_steps
    muon_lr = 0.10                  # log:285 MuonSq(..., lr=0.10, weight_decay=0.0125)
    muon_wd = 0.0125                # log:285
    muon_mu = 0.95                  # log:198 MuonSq(..., mu=0.95, beta2=0.95, eps=1e-10)
    beta2 = 0.95                    # log:198
    eps = 1e-10                     # log:198
    embed_lr = 0.3                  # log:280
    head_lr = 1 / 320               # log:281
    vector_lr = 0.01                # log:282
    adam_betas = (0.8, 0.95)        # log:283
    adam_eps = 1e-10                # log:283
    cooldown_frac = 0.7             # log:294 set_hparams(step, cooldown_frac=0.7)


class R9:
    """#9, NorMuon-lite + u/w floor (Skylight-001, 3250 steps):
    results/20260501_skylight001/1cd721e0-add6-4613-a57e-5e32723efb07.txt."""

    log = "results/20260501_skylight001/1cd721e0-add6-4613-a57e-5e32723efb07.txt"
    steps = 3250                    # log:301 train_steps
    muon_lr = 0.0375                # log:315 Muon(..., lr=0.0375, weight_decay=0.025) (wd unread)
    muon_mu = 0.95                  # log:195 muon_update(..., mu=0.95, beta2=0.95, ...)
    beta2 = 0.95                    # log:195
    target_uw = 0.35                # log:243 TARGET_UW
    embed_lr = 0.3                  # log:309
    head_lr = 1 / 320               # log:310
    vector_lr = 0.01                # log:311
    adam_betas = (0.8, 0.95)        # log:312
    adam_eps = 1e-10                # log:312
    cooldown_frac = 0.7             # log:324 set_hparams(step, cooldown_frac=0.7)


class R11(R9):
    """#11, Contra-Muon on #9 (3225 steps):
    results/20260501_contra_muon/08cd60f9-99e2-4e28-b1ac-19136dd42a05.txt."""

    log = "results/20260501_contra_muon/08cd60f9-99e2-4e28-b1ac-19136dd42a05.txt"
    steps = 3225                    # log:345 train_steps
    contra_muon = 0.4               # log:36 CONTRA_MUON
    muon_mu = 0.95                  # log:37 MU
    muon_lr = 0.0375                # log:38 MUON_LR
    target_uw = 0.35                # log:40 TARGET_UW
    power_iterations = 5            # log:210 scale_to_unit_operator_norm
    power_eps = 1e-10               # log:207
    embed_lr = 0.3                  # log:355
    head_lr = 1 / 320               # log:356
    vector_lr = 0.01                # log:357
    adam_betas = (0.8, 0.95)        # log:358
    adam_eps = 1e-10                # log:358
    cooldown_frac = 0.7             # log:370 set_hparams(step, cooldown_frac=0.7)


class R17(R11):
    """#17, Aurora + Contra-Muon + u/w floor (3175 of 3200 steps):
    results/20260505_aurora/298f02bc-dbb4-4661-9ad8-f6429d532873.txt (no NorMuon-lite)."""

    log = "results/20260505_aurora/298f02bc-dbb4-4661-9ad8-f6429d532873.txt"
    steps = 3200                    # log:338 train_steps
    contra_muon = 0.4               # log:164 CONTRA_MUON
    target_uw = 0.35                # log:165 TARGET_UW
    muon_lr = 0.0375                # log:363 Muon(..., lr=0.0375, weight_decay=0,
    pp_iterations = 2               # log:364 pp_iterations=2,
    pp_beta = 0.5                   # log:364 pp_beta=0.5)
    aurora_eps = 1e-7               # log:187 aurora_orthogonalize(..., eps=1e-7)
    beta2 = None                    # log:228-238 muon_update: no NorMuon-lite step
    muon_mu = 0.95                  # log:250 Muon(..., mu=0.95) (not passed: the default)
    power_iterations = 5            # log:219 scale_to_unit_operator_norm
    power_eps = 1e-10               # log:214
    embed_lr = 0.3                  # log:358
    head_lr = 1 / 320               # log:359
    vector_lr = 0.01                # log:360
    adam_betas = (0.8, 0.95)        # log:361
    adam_eps = 1e-10                # log:361
    cooldown_frac = 0.7             # log:373 set_hparams(step, cooldown_frac=0.7)


class R18:
    """#18, PMuon (3225 of 3250 steps):
    results/20260507_pmuon/54fc0541-7a62-4772-a8f8-d3a46ad10dba.txt (the log the Track 3
    table links; the folder's other eight logs hold the same script)."""

    log = "results/20260507_pmuon/54fc0541-7a62-4772-a8f8-d3a46ad10dba.txt"
    steps = 3250                    # log:312 train_steps
    muon_lr = 0.035                 # log:336-337 Muon(..., lr=0.035, weight_decay=0.025)
    muon_wd = 0.025                 # log:337
    muon_mu = 0.95                  # log:218 Muon(..., mu=0.95, (the default)
    gamma = 0.3                     # log:219 gamma=0.3, beta=0.95) (the defaults)
    beta = 0.95                     # log:219
    damping = 1e-6                  # log:204 eps = 1e-6 (C_reg.diagonal().add_(eps), 208, 213)
    eps = 1e-6                      # log:183 _streaming_cov_power(..., eps=1e-6) (192, 195)
    embed_lr = 0.3                  # log:332
    head_lr = 1 / 320               # log:333
    vector_lr = 0.01                # log:334
    adam_betas = (0.8, 0.95)        # log:335
    adam_eps = 1e-10                # log:335
    adam_wd = 0.0                   # log:335
    cooldown_frac = 0.7             # log:346 set_hparams(step, cooldown_frac=0.7)


class R22:
    """#22, SpectralDescent = Muon with mu 0 (8225 of 8500 steps):
    results/20260517_ortho/d5098d67-7c1b-47b4-8833-80960d633d33.txt."""

    log = "results/20260517_ortho/d5098d67-7c1b-47b4-8833-80960d633d33.txt"
    steps = 8500                    # log:266 train_steps (the schedule's length)
    record_step = 8225              # log:461 step:8225/8500 val_loss:3.27744 (the readout)
    muon_lr = 0.03                  # log:291 Muon(..., lr=0.03, weight_decay=0.015, mu=0)
    muon_wd = 0.015                 # log:291
    muon_mu = 0.0                   # log:291
    embed_lr = 0.3                  # log:286
    head_lr = 1 / 320               # log:287
    vector_lr = 0.01                # log:288
    adam_betas = (0.8, 0.95)        # log:289
    adam_eps = 1e-10                # log:289
    cooldown_frac = 0.7             # log:300 set_hparams(step, cooldown_frac=0.7)


class R26:
    """#26, SinkSOAP (3090 of 3125 steps, mean of 10 runs):
    results/20260514_sinksoap/d0155dd0-f77d-48a9-8eb4-453f894b9476.txt."""

    log = "results/20260514_sinksoap/d0155dd0-f77d-48a9-8eb4-453f894b9476.txt"
    steps = 3125                    # log:629 train_steps (the schedule's length)
    record_step = 3090              # log:691 the extra val at 3090; README row 26: 3090
    muon_lr = 0.04                  # log:654 SinkSOAP(..., lr=0.04, weight_decay=0.025)
    muon_wd = 0.025                 # log:654
    muon_mu = 0.95                  # log:459 mu=0.95 (the default)
    gram_beta = 0.95                # log:460 gram_beta=0.95
    normuon_beta = 0.95             # log:461 normuon_beta=0.95
    sinkhorn_steps = 10             # log:462 sinkhorn_steps=10
    eps = 1e-8                      # log:464 eps=1e-8 (Grams' diagonal, Sinkhorn, norm floor)
    normuon_eps = 1e-10             # log:465 normuon_eps=1e-10
    normuon_square = False          # log:428 `if apply_normuon and (m != n)`
    embed_lr = 0.3                  # log:649
    head_lr = 1 / 320               # log:650
    vector_lr = 0.01                # log:651
    adam_betas = (0.8, 0.95)        # log:652
    adam_eps = 1e-10                # log:652
    cooldown_frac = 0.7             # log:663 set_hparams(step, cooldown_frac=0.7)


class R28:
    """#28, DynMuon (3175 of 3200 steps): results/20260519_dynmuon/train_gpt_simple_dynmuon.py
    (its log, 50172610-...txt, runs the same script)."""

    script = "results/20260519_dynmuon/train_gpt_simple_dynmuon.py"
    steps = 3200                    # script:427 train_steps
    gradient_scale = 1 / (8 * 64 * 1024)  # script:280 grad = grad / (8 * 64 * 1024)
    muon_mu = 0.95                  # script:322 DynMuon(..., mu=0.95) (the default)
    muon_lr = 0.02                  # script:455
    muon_wd = 0.025                 # script:456
    spectral_eps = 1e-7             # script:229 fast_spectral(..., epsilon=1e-7)
    order = 2                       # script:287 fast_spectral(update, p=p, order=2)
    p_max = 0.25                    # script:468 get_dynmuon_p(..., p_max=0.25,
    p_min = -0.25                   # script:468 p_min=-0.25,
    tau_ratio = 0.04                # script:468 tau_ratio=0.04,
    width_ratio = 0.04              # script:468 width_ratio=0.04)
    embed_lr = 0.3                  # script:448
    head_lr = 1 / 320               # script:449
    vector_lr = 0.01                # script:450
    adam_betas = (0.8, 0.95)        # script:451
    adam_eps = 1e-10                # script:451
    cooldown_frac = 0.7             # script:475 set_hparams(step, cooldown_frac=0.7)


class R33:
    """#33, PSGD (3400 steps): results/20260527_psgd/train_psgd.py (the folder's logs run
    it)."""

    log = "results/20260527_psgd/train_psgd.py"
    steps = 3400                    # log:332 train_steps
    psgd_lr = 0.025                 # log:331 psgd_steady_lr
    cooldown_frac = 1.0             # log:333 (get_psgd_lr, log:344-349: linear to 0)
    precond_lr = 1.0                # log:334
    b1 = 0.95                       # log:341 PSGDKron(..., beta1=0.95)
    damping = 2.0**-23              # log:247 torch.finfo(torch.float32).eps
    init_floor = 1e-24              # log:168 .clamp(min=1e-24)
    init_power = -1 / 32            # log:168 .pow(-1/32)
    norm_eps = 1e-10                # log:260, 262 (u_norm + 1e-10), (new_p_norm + 1e-10)
    embed_lr = 0.3                  # log:336 adam_base_lrs
    head_lr = 1 / 320               # log:336
    vector_lr = 0.01                # log:336
    adam_betas = (0.8, 0.95)        # log:340
    adam_eps = 1e-10                # log:340
    adam_cooldown_frac = 0.5        # log:352 int(train_steps * (1 - 0.5))
    adam_final_scale = 0.1          # log:356 1.0 - t * 0.9


class R32:
    """#32, SODA fade (3000 of 3040 steps): the script of
    results/20260518_soda_fade_3000_n9/code_logs/0fdbe617-...txt (the nine logs hold the
    same script), on #20's stack (its Muon group: the hidden matrices)."""

    log = "results/20260518_soda_fade_3000_n9/code_logs/0fdbe617-37dd-470d-b033-b6ec24fc13fc.txt"
    steps = 3040                    # log:81 FINAL_TRAIN_STEPS (claim: 3000, README)
    strength = 1.0                  # log:64 SODA_LAMBDA_SCALE
    fade_start = 2000               # log:65 SODA_FADE_START_STEP
    fade_end = 2750                 # log:66 SODA_FADE_END_STEP
    fade_shape = "cosine"           # log:67, 77: 0.5 * (1 + cos(pi * x))
    offset = 2                      # log:649 lam = min(max(soda_scale / (step_count + 2), 0), 1)


class R30:
    """#30, Aurora on mlp.proj + the extended Contra-Muon ramp on PR #294's radial-brake stack
    (2930 of a 3020-step run, PowerCool to 3050):
    results/20260514_aurora_proj_pruned_extended_contra/d198124d-5e7f-4743-a683-0eb936a40dbe.txt
    (seed 0; the sixteen logs run one script)."""

    log = ("results/20260514_aurora_proj_pruned_extended_contra/"
           "d198124d-5e7f-4743-a683-0eb936a40dbe.txt")
    train_steps = 3020              # log:63 FINAL_TRAIN_STEPS (claim: 2930, README)
    schedule_steps = 3050           # log:64 FINAL_SCHEDULE_STEPS (PowerCool's t_end)
    power = 1.2                     # log:65 FINAL_LR_POWER
    embed_c = 4.976805410800738e-05   # log:66 ADAM_EMBED_POWER_C
    head_c = 5.184172302917436e-07    # log:67 ADAM_PROJ_POWER_C
    vector_c = 1.6589351369335795e-06  # log:68 ADAM_OTHER_POWER_C
    muon_c = 3.3169534699576625e-06    # log:69 MUON_POWER_C
    contra_coeff = -0.2             # log:73 CONTRA_MUON_COEFF
    contra_hold_end = 0             # log:78 CONTRA_HOLD_END_STEP
    contra_end = 2500               # log:79 CONTRA_TO_NORMAL_END_STEP
    muon_lr = 0.0375                # log:83 MUON_LR
    target_uw = 0.3825              # log:85 TARGET_UW (SOAP and non-SOAP alike, :86-87)
    nor_beta2 = 1.0                 # log:88 NOR_BETA2 (NorMuon-lite's statistic stays 0)
    soap_beta = 0.9                 # log:89 SOAP_BETA2 (Grams and V)
    soap_frequency = 10             # log:90 SOAP_PRECONDITION_FREQUENCY
    soap_denom_power = 0.5          # log:91 SOAP_DENOM_POWER
    soap_eps = 1e-8                 # log:527 soap_precondition_momentum(..., eps=1e-8)
    v_denom_floor = 0.55            # log:95 ATTN_SOAP_DENOM_FLOOR (attention SOAP = attn.v)
    v_blend = 0.95                  # log:97 V_SOAP_BLEND
    brake = 0.5                     # log:112 RADIAL_OUTWARD_SCALE
    inward = 1.0                    # log:113 RADIAL_INWARD_SCALE
    aurora_k = 3                    # log:275 _AURORA_K
    aurora_beta = 0.25              # log:276 _AURORA_BETA
    aurora_eps = 1e-7               # log:277 _AURORA_EPS
    gram_eps = 1e-10                # log:261 gram_frobenius_norm_estimate(eps=1e-10)
    embed_lr = 0.3                  # log:818
    head_lr = 1 / 320               # log:819
    vector_lr = 0.01                # log:820
    adam_betas = (0.8, 0.99)        # log:821
    adam_eps = 1e-10                # log:821
    mu_min = 0.85                   # log:844 _MU_MIN
    mu_max = 0.95                   # log:845 _MU_MAX
    mu_warmup = 300                 # log:846 _MU_WARMUP_STEPS
    mu_cooldown = 100               # log:847 _MU_COOLDOWN_STEPS (of FINAL_TRAIN_STEPS, :862)
    di_fc_alpha = 0.30              # log:800 _DI_FC_ALPHA
    cgi_alpha = 0.14                # log:809 _CGI_ALPHA


class R40(R30):
    """#40, #30's stack inside EMA-Nesterov (2890 of a 2900-step run, PowerCool to 2980):
    results/20260522_ema_nesterov_aurora_proj/345b51b2-38ee-4a78-af2c-bb96cb68470d.txt (seed 0;
    the folder's logs run one script). Its script is #30's but for the two step constants
    and the EMA_Nesterov class around both optimizers (``diff`` of the two scripts): every
    other constant is R30's (at #30's line + 2 past log:51)."""

    log = ("results/20260522_ema_nesterov_aurora_proj/"
           "345b51b2-38ee-4a78-af2c-bb96cb68470d.txt")
    claim = 2890                    # README (Track 3's table, row 40)
    train_steps = 2900              # log:65 FINAL_TRAIN_STEPS (also train_steps, :893)
    schedule_steps = 2980           # log:66 FINAL_SCHEDULE_STEPS (PowerCool's t_end)
    lookahead = 0.3                 # log:932 lookahead_stepsize=0.3
    lookahead_scheduled = True      # log:933 (beta0 * lr/initial_lr, :736-737)
    lookahead_ema = 0.99            # log:934 (buf.lerp_(look, 1 - lookahead_ema), :765)
    lookahead_prefill = 300         # log:935 (it + 1 > prefill_steps, :773)
    lookahead_stop = 2900 - 950     # log:936 rest_steps=train_steps - 950 (it < rest_steps)
    lookahead_group = "embed"       # log:728 inner_optimizer[0].param_groups[0] (:921)


class R34:
    """#34, capped RRE extrapolation (2925 of 3020 steps):
    results/20260520_rre_extrapolation_pr300_2925/train_gpt_simple_rre_pr300_2925.py (the
    folder's eight logs run a longer script whose extra options the environment leaves off:
    each prints ``vector_extrapolation=rre every=5 start_step=2820 checkpoints=4
    regularization=1e-06 damping=0.875 reset_momentum=False stop_step=2925
    after_stop_every=0 param_filter=all``, and its ``rre_extrapolate`` is the same), on #30's
    stack (its Muon group: the hidden matrices)."""

    script = ("results/20260520_rre_extrapolation_pr300_2925/"
              "train_gpt_simple_rre_pr300_2925.py")
    steps = 3020                    # script:66 FINAL_TRAIN_STEPS (claim: 2925, README)
    every = 5                       # script:118 EXTRAPOLATION_EVERY
    start = 2820                    # script:119 EXTRAPOLATION_START_STEP
    history = 4                     # script:120 EXTRAPOLATION_NUM_CHECKPOINTS
    regularization = 1e-6           # script:121 EXTRAPOLATION_REGULARIZATION
    damping = 0.875                 # script:122 EXTRAPOLATION_DAMPING
    max_rel = 0.001                 # script:123 EXTRAPOLATION_MAX_REL
    reset_momentum = False          # script:127 EXTRAPOLATION_RESET_MOMENTUM
    stop = 2925                     # script:128 EXTRAPOLATION_STOP_STEP
    after_stop_every = 0            # script:129 EXTRAPOLATION_AFTER_STOP_EVERY
    ridge_floor = 1e-10             # script:670 reg = regularization * trace(G) / k + 1e-10
    coefficient_floor = 1e-12       # script:677 coeff_sum.abs() < 1e-12
    norm_floor = 1e-12              # script:1164 current_f32.norm().clamp_min(1e-12)
class R21:
    """#21, Shampoo (a 4150-step schedule, 3.28 crossed at 4100):
    results/20260513_shampoo_1_4_power/503575c5-6dde-425a-b461-2df4d99db974.txt (its script,
    the folder's train_gpt_shampoo.py, imports the folder's ``distributed_shampoo/`` copy:
    "pkg:" lines are in that package)."""

    log = "results/20260513_shampoo_1_4_power/503575c5-6dde-425a-b461-2df4d99db974.txt"
    steps = 4150                    # log:232 train_steps
    lr = 0.0015                     # log:259 lr=0.0015
    betas = (0.9, 0.95)             # log:256, 260 betas=(0.9, shampoo_beta2)
    epsilon = 1e-12                 # pkg: distributed_shampoo.py:356 (the default; log sets none)
    weight_decay = 0.2              # log:261-262 weight_decay=0.2, DECOUPLED
    frequency = 5                   # log:264-265 precondition_frequency=5, start -1 (= 5)
    pseudo_inverse = False          # log:257 (default RootInvShampooPreconditionerConfig)
    root = 4                        # pkg: preconditioner/shampoo_preconditioner_list.py:1567
    #                                 1 / (2 * order): L^(-1/4), R^(-1/4)
    graft_b2 = 0.95                 # log:266-267 AdamPreconditionerConfig(beta2=shampoo_beta2
    graft_eps = 1e-10               # log:268 epsilon=1e-10)
    graft_norm_eps = 1e-16          # pkg: distributed_shampoo.py:1009
    cooldown_frac = 0.7             # log:280 set_hparams(step, cooldown_frac=0.7)
    embed_lr = 0.3                  # log:252
    head_lr = 1 / 320               # log:253
    vector_lr = 0.01                # log:254
    adam_betas = (0.8, 0.95)        # log:255
    adam_eps = 1e-10                # log:255


class R35(R21):
    """#35, Shampoo with a pseudo-inverse root (3375 steps):
    results/sh-origpinv-s3375-lr1em2-wd010-b9em1-ge15-pf1-near1-record-130563a2-b40b-43c1-8fb4-
    b7a3bbfa5969.txt (lines of its script; the package: #21's copy, the only one in the
    record). Its aux AdamW and schedule are #21's (log:255-258, 289)."""

    log = ("results/sh-origpinv-s3375-lr1em2-wd010-b9em1-ge15-pf1-near1-record-"
           "130563a2-b40b-43c1-8fb4-b7a3bbfa5969.txt")
    steps = 3375                    # log:235 train_steps
    lr = 1e-2                       # log:262
    betas = (0.9, 0.9)              # log:259, 263 shampoo_beta2 = 9e-1
    epsilon = 0.0                   # log:264
    weight_decay = 0.1              # log:265
    frequency = 1                   # log:268-269 precondition_frequency=1, start -1 (= 1)
    pseudo_inverse = True           # log:270-274 EigenConfig(PseudoInverseConfig()):
    #                                 pkg: matrix_functions_types.py:61-62 atol 0, rtol 0
    graft_b2 = 0.9                  # log:275-276
    graft_eps = 1e-15               # log:277
class R42:
    """#42, fixed reference interpolation on #40's Aurora/EMA-Nesterov stack (2900-step
    schedule, loss claimed at 2860): results/20260525_aurora_ema_ref/
    train_gpt_simple_aurora_ema_ref.py (its logs run it, ``--seed`` only)."""

    script = "results/20260525_aurora_ema_ref/train_gpt_simple_aurora_ema_ref.py"
    steps = 2900                    # script:45 TRAIN_STEPS
    claim = 2860                    # script:46 RUN_STOP_STEP
    schedule_steps = 2980           # script:47 SCHEDULE_STEPS (PowerCool's t_end, :690)
    power = 1.2                     # script:48 LR_POWER
    embed_c = 4.976805410800738e-05   # script:53 ADAM_EMBED_POWER_C
    embed_lr = 0.3                  # script:661 (the group EMA_Nesterov reads its lr ratio
                                    # from, :524)
    ref_capture = 2375              # script:49 REF_CAPTURE_STEP (after update step + 1, :843)
    ref_start = 2850                # script:50 REF_APPLY_START_STEP (step >= it, :741)
    ref_gamma = -0.075              # script:51 REF_GAMMA (p + (p - ref) * gamma, :755)
    val_every = 125                 # script:639 val_regular_interval
    val_extra = (2850, 2860)        # script:640 extra_val_steps
    lookahead = 0.3                 # script:80 EMA_NESTEROV_STEPSIZE
    lookahead_ema = 0.99            # script:81
    lookahead_prefill = 300         # script:82
    lookahead_stop = 2900 - 950     # script:83 EMA_NESTEROV_REST_STEP
    cgi_alpha = 0.0                 # script:76 CGI_ALPHA (the gains stay one, :658)
    zero_biases = True              # script:77 ZERO_NONPROJ_BIASES (:648-652, "proj" zero)
    fc_depth_alpha = 0.30           # script:78 DI_FC_ALPHA (fc times 1 - a l/(L-1), :654-656)


class R38:
    """#38, tail reference interpolation at 2900 on PR #300's Aurora-on-mlp.proj stack
    (3020-step schedule, loss claimed at 2900): results/20260520_tail_refinterp_2900/
    train_gpt_tail_refinterp_2900.py (its run.sh sets these same values)."""

    script = "results/20260520_tail_refinterp_2900/train_gpt_tail_refinterp_2900.py"
    steps = 2900                    # script:67 FINAL_TRAIN_STEPS
    schedule_steps = 3020           # script:68 FINAL_SCHEDULE_STEPS
    power = 1.2                     # script:69 FINAL_LR_POWER
    muon_c = 3.3169534699576625e-06   # script:73 MUON_POWER_C
    muon_lr = 0.0375                # script:87 MUON_LR
    vel_start = 2500                # script:192 TAIL_VEL_START_STEP (update_tail_velocity
                                    # after update step + 1, :1736; applied at step >= it)
    vel_beta = 0.90                 # script:193 TAIL_VEL_BETA
    vel_gamma = -6.0                # script:194 TAIL_VEL_GAMMA
    vel_max_ratio = 0.01            # script:195 TAIL_VEL_MAX_DELTA_RATIO
    vel_norm_eps = 1e-12            # script:1366-1367 clamp_min(1e-12)
    ref_capture = 2375              # script:211 REF_EXTRAP_CAPTURE_STEP (:1737)
    ref_gamma = -0.075              # script:212 REF_EXTRAP_GAMMA
    ref_start = 2900                # script:213 REF_EXTRAP_APPLY_START_STEP
    tempered_rho = 0.05             # script:155 TEMPERED_POLAR_RHO
    tempered_max_delta = 0.25       # script:156 TEMPERED_POLAR_MAX_DELTA
    tempered_ramp = (2600, 2800)    # script:160-161 TEMPERED_POLAR_RAMP_{START,END}_STEP
    tempered_eps = 1e-10            # script:920, 922 clamp_min(1e-10)
    brake = 0.5                     # script:137 RADIAL_OUTWARD_SCALE
    brake_late = 0.4                # script:139 RADIAL_OUTWARD_SCALE_LATE
    brake_ramp = (2400, 2900)       # script:140-141 RADIAL_DECAY_{START,END}_STEP
    floor = 0.3825                  # script:95 TARGET_UW
    floor_late = 0.400              # script:96 TARGET_UW_LATE
    floor_ramp = (2400, 2800)       # script:97-98 TARGET_UW_RAMP_{START,END}_STEP
    contra_end = 2750               # script:83 CONTRA_TO_NORMAL_END_STEP (#30: 2500)
    mu_late = 0.85                  # script:218, 220 _MU_LATE = _MU_MIN (#30's cool-down end)
    # Otherwise #30's constants (R30): the script differs from #30's log by the lines
    # above and by switches left off (script:89-94 lr multipliers 1, :102 deficit gate 0,
    # :144 radial adapt 0, :150 agreement shrink 0, :158 tempered decay 0, :162 no skip of
    # mlp.proj, :163 Aurora relax 0, :170 Aurora beta decay 0, :182 tail EMA 0, :223-224
    # momentum reheat 0).
class R27:
    """#27, SOAP-H (3125 steps): results/20260518_soaph/train_gpt_simple_soaph.py (the
    script of its logs SOAPH_run1..6.txt, equal to it up to their first ``====`` line)."""

    log = "results/20260518_soaph/train_gpt_simple_soaph.py"
    steps = 3125                    # log:456 train_steps
    lr_steps = 3200                 # log:457 lr_steps (the matrices' schedule_steps, :509)
    lr = 0.018                      # log:458
    lr_power = 1.25                 # log:459 (the matrices' lr_power, :510; _eta :520-525)
    lr_floor = 0.0                  # log:460
    momentum = 0.95                 # log:243 SOAPH(momentum=0.95): lerp_(grad, 1 - momentum)
    ema_beta = 0.9                  # log:242: L, R (:205-217) and the square buffer (:224-228)
    eps = 1e-8                      # log:245; :231 sqrt(V).add(eps)
    q_freq = 1                      # log:244; :355 step % q_freq == 0 (step from 1, :339)
    hyperball_eps = 1e-10           # log:246; :167-168 torch.clamp(norm, min=eps)
    embed_lr = 0.3                  # log:490
    head_lr = 1 / 320               # log:491
    vector_lr = 0.01                # log:492
    adam_betas = (0.8, 0.95)        # log:493
    adam_eps = 1e-10                # log:493
    adam_cooldown_frac = 0.4        # log:514 (schedule_steps train_steps, :515)
    adam_lr_power = 1.0             # log:516
    adam_lr_floor = 0.0             # log:517


class R19:
    """#19, KL-SOAP-H (3125 steps): results/20260508_klsoap_h_clean_tuple_sweep/b1095_sh090/
    klsoap-h-b1095_sh090-K3125-seed-1.full.txt (the README's log; seeds 2-6 run the same
    script)."""

    log = ("results/20260508_klsoap_h_clean_tuple_sweep/b1095_sh090/"
           "klsoap-h-b1095_sh090-K3125-seed-1.full.txt")
    steps = 3125                    # log:362 train_steps
    lr = 0.018                      # log:271, :396 KLSOAPH(..., lr=0.018)
    beta1 = 0.95                    # log:271
    beta2 = 0.9                     # log:271
    shampoo_beta = 0.9              # log:272
    eps = 1e-8                      # log:272
    precondition_frequency = 1      # log:272; :297-300 step += 1, step % freq == 0
    init_factor = 0.1               # log:294 init_factor=0.1; :208 inv = init_factor ** -0.5
    eigen_floor = 1e-30             # log:222 clamp_min(1e-30)
    max_inverse_root = 4000.0       # log:222 clamp(max=4000.0)
    cooldown_frac = 1.0             # log:410 (set_hparams :414-424: linear over train_steps)
    hyperball_eps = 1e-10           # log:164-168 scale_invariant_update_ eps
    embed_lr = 0.3                  # log:392
    head_lr = 1 / 320               # log:393
    vector_lr = 0.01                # log:394
    adam_betas = (0.8, 0.95)        # log:395
    adam_eps = 1e-10                # log:395
    adam_cooldown_frac = 0.4        # log:412


class R25(R19):
    """#25, KL-SOAP-H with a power decay and lr floors (3040 steps):
    results/20260511_klsoap_h_lr_power_decay/train_gpt_simple_klsoap_h_lr_power_decay.py
    (its logs ran the environment-configured version of it and print the same values, e.g.
    01906576-8b3d-4bd2-a73f-23997f602ec1.txt:539-552); the optimizer code is #19's."""

    log = ("results/20260511_klsoap_h_lr_power_decay/"
           "train_gpt_simple_klsoap_h_lr_power_decay.py")
    steps = 3040                    # log:362 train_steps
    schedule_steps = 3125           # log:363 (progress = step / schedule_steps, :423)
    lr_power = 1.5                  # log:364 (every group, :432)
    adam_lr_floor = 0.04            # log:365, :420
    klsoap_lr_floor = 0.017         # log:366, :417


class R41:
    """#41, Circuit-Muon on #40's stack (2875 of 2900 steps): its log
    results/20260523_circuit_muon/616cccc8-affa-46b1-b36d-a832685d8d3c.txt (the script
    before the first ``====`` line; ``log:N`` is its line N)."""

    log = "results/20260523_circuit_muon/616cccc8-affa-46b1-b36d-a832685d8d3c.txt"
    steps = 2900                    # log:47 FINAL_TRAIN_STEPS (claim: 2875, README)
    head_dim = 128                  # log:103 HEAD_DIM
    damping = 1e-3                  # log:104 CIRCUIT_OV_DAMPING
    guard = 1e-12                   # log:617-628 clamp_min(1e-12) on scalars, norms, x
    value_pattern = ".attn.v.weight"     # log:652 n.endswith(".attn.v.weight")
    output_pattern = ".attn.proj.weight"  # log:653 ... + ".attn.proj.weight"


class R43:
    """#43, tail phase readout on #41's stack (2850 steps): its trainer
    results/20260529_tail_phase_readout_2850/train_gpt_tail_phase_readout_2850.py
    (``script:N``), run with run.sh's environment, which its log
    tail_phase_readout_2850_seed0.txt prints (``log:N``; the log's script is the trainer)."""

    log = "results/20260529_tail_phase_readout_2850/tail_phase_readout_2850_seed0.txt"
    steps = 2850                    # run.sh TRAIN_STEPS; log:2464 step:2850/2850
    schedule_steps = 2950           # log:2337 schedule_steps (run.sh SCHEDULE_STEPS)
    tail_switch = 2600              # log:2338 tail_schedule_switch_step (script:2177-2178:
                                    # t_end is the tail's from step >= it)
    tail_schedule_steps = 3010      # log:2339 tail_schedule_steps
    power = 1.2                     # script:52 FINAL_LR_POWER
    embed_c = 4.976805410800738e-05   # script:53 ADAM_EMBED_POWER_C
    head_c = 5.184172302917436e-07    # script:54 ADAM_PROJ_POWER_C
    vector_c = 1.6589351369335795e-06  # script:55 ADAM_OTHER_POWER_C
    muon_c = 3.3169534699576625e-06    # script:56 MUON_POWER_C
    contra_end = 2500               # log:2346 contra_to_normal_end_step
    muon_lr = 0.0375                # log:2350
    target_uw = 0.3825              # log:2352
    damping = 1e-3                  # log:2379 circuit_ov_damping (head_dim 128)
    lookahead = 0.3                 # script:1236 lookahead_stepsize
    lookahead_ema = 0.99            # script:1238
    lookahead_prefill = 300         # script:1239 prefill_steps
    lookahead_stop = 1900           # log:2384 ema_nesterov_rest_steps (script:1240)
    mu_cooldown = 100               # log:2385 mu_cooldown_steps (of FINAL_TRAIN_STEPS,
                                    # script:2206)
    trail_start = 2650              # log:2386 trail_delta_start_step
    trail_stop = 2850               # log:2387 trail_delta_end_step
    trail_every = 100               # log:2388 trail_delta_interval
    trail_gammas = (-0.04, -0.12)   # log:2390-2391 gamma_first, gamma_final (script:1682)
    trail_momentum = 1.0            # log:2395 trail_delta_momentum_beta
    trail_scope = "nonembed"        # log:2393 (script:1275 name != "embed.weight")
    broad_capture = 2000            # log:2426 broad_delta_capture_step
    broad_apply = 2400              # log:2427 broad_delta_apply_step
    broad_gamma = -0.005            # log:2428 broad_delta_gamma
    broad_scope = "muon_other"      # log:2429 (script:1349-1353)
    anchor_step = 2400              # log:2413 final_readout_anchor_step
    anchor_alpha = 0.08             # log:2414 final_readout_alpha
    phase_t0 = 2650                 # log:2417 phase_readout_t0_step
    phase_t1 = 2750                 # log:2418 phase_readout_t1_step
    phase_velocity = 0.0            # log:2419 phase_readout_gamma
    phase_kappa = 0.01              # log:2420 phase_readout_kappa
    phase_mode = "orthogonal"       # log:2421
    phase_scope = "muon_other"      # log:2422
    phase_normalize = True          # log:2425
    phase_velocity_sq_floor = 1e-20  # script:1497 eps
    phase_norm_eps = 1e-12          # script:1521 (phase_norm + 1e-12)
class R20:
    """#20, Contra-Muon to Soft-Muon with SOAP on MLP+V, NorMuon-lite, the u/w floor and
    PowerCool (claim 3030 of 3040 steps): results/20260509_contra_soft_muon/
    03c36e81-e2e5-4916-bf16-0141999b1dbb.txt (the README's 30 logs share one script)."""

    log = "results/20260509_contra_soft_muon/03c36e81-e2e5-4916-bf16-0141999b1dbb.txt"
    steps = 3040                    # log:64 FINAL_TRAIN_STEPS
    claim = 3030                    # README: the step 3030 mean 3.27901
    t_end = 3105                    # log:65 FINAL_SCHEDULE_STEPS
    power = 1.2                     # log:66 FINAL_LR_POWER
    embed_c = 4.976805410800738e-05   # log:67 ADAM_EMBED_POWER_C
    head_c = 5.184172302917436e-07    # log:68 ADAM_PROJ_POWER_C
    vector_c = 1.6589351369335795e-06  # log:69 ADAM_OTHER_POWER_C
    muon_c = 3.3169534699576625e-06   # log:70 MUON_POWER_C
    contra_coeff = -0.2             # log:74 CONTRA_MUON_COEFF (= -CONTRA_MUON/2)
    soft_p = 0.1                    # log:75 SOFT_MUON_P
    soft_ceil = 0.8                 # log:78 SOFT_MUON_CEIL
    contra_hold_end = 0             # log:79 CONTRA_HOLD_END_STEP
    contra_end = 2000               # log:80 CONTRA_TO_NORMAL_END_STEP
    soft_start = 2500               # log:81 NORMAL_TO_SOFT_START_STEP
    soft_end = 3010                 # log:82 NORMAL_TO_SOFT_END_STEP
    muon_mu = 0.95                  # log:83 MU
    muon_lr = 0.0375                # log:84 MUON_LR
    target_uw = 0.3825              # log:86 TARGET_UW (SOAP and non-SOAP alike, :87-88)
    beta2 = 0.95                    # log:89 NOR_BETA2
    soap_beta = 0.9                 # log:90 SOAP_BETA2 (Grams and V)
    soap_frequency = 10             # log:91 SOAP_PRECONDITION_FREQUENCY
    soap_denom_power = 0.5          # log:92 SOAP_DENOM_POWER
    soap_eps = 1e-8                 # log:471 soap_precondition_momentum(..., eps=1e-8)
    v_denom_floor = 0.55            # log:96 ATTN_SOAP_DENOM_FLOOR (attn.v is an attn SOAP param)
    v_blend = 0.95                  # log:98 V_SOAP_BLEND
    gram_eps = 1e-10                # log:260 gram_frobenius_norm_estimate(..., eps=1e-10)
    ns_eps = 1e-7                   # log:273, :302 (eps=1e-7)
    soft_weights = (0.1091613623, 0.07085664498, 0.05210528973, 0.05457295795,  # log:289
                    0.05011334061, 0.03334622198, 0.05022104481, 0.1053727358,
                    0.1187323776, 0.1185061091, 0.1185059576, 0.1185059576)
    soft_constant = 0.0             # log:289 (the weight of the last iterate)
    embed_lr = 0.3                  # log:737
    head_lr = 1 / 320               # log:738
    vector_lr = 0.01                # log:739
    adam_betas = (0.8, 0.95)        # log:740
    adam_eps = 1e-10                # log:740 (weight_decay=0)


class R23:
    """#23, Muown (3.28 at 3125 of 3200 steps):
    results/20260508_muown/97782bd6-1339-430f-b870-0c7309fa5004.txt (its two logs share
    one script)."""

    log = "results/20260508_muown/97782bd6-1339-430f-b870-0c7309fa5004.txt"
    steps = 3200                    # log:410 train_steps
    claim = 3125                    # README: first significant step
    polar_express = ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),  # log:170-179
                     (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                     (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                     (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750))
    ns_steps = 12                   # log:477 ns_steps=12 (the last triple repeats, log:188)
    ns_eps = 1e-7                   # log:182 eps=1e-7, X / (‖X‖_F + eps) (log:187)
    muown_lr = 0.0035               # log:396 LR_MUOWN
    momentum = 0.95                 # log:476 momentum=0.95 (summed: m.mul_(μ).add_(g))
    direction_scale = 0.2           # log:479 direction_scale=0.2
    gain_betas = (0.9, 0.95)        # log:239 betas (Adam on the gains)
    gain_eps = 1e-8                 # log:240 adam_eps
    v_norm_eps = 1e-12              # log:244 v_norm_eps
    zero_row_norm = 0.33**0.5       # log:276
    v_norm_target = 2.688           # log:399 V_NORM_TARGET_SCALE
    mlp_proj_mult = 3.33333333333   # log:406 V_NORM_FAMILY_MULT["mlp.proj.weight"]
    embed_lr = 0.9                  # log:393 LR_EMBED
    head_lr = 0.009375              # log:394 LR_HEAD
    vector_lr = 0.03                # log:395 LR_1D
    adam_betas = (0.8, 0.95)        # log:472
    adam_eps = 1e-10                # log:472
    cooldown_frac = 0.7             # log:397-398 LR_COOLDOWN_FRAC_ADAM, _MUOWN


class R31:
    """#31, Muown with Contra-Muon and NorMuon-lite (2995 of 3000 steps):
    results/20260515_contranormuown/0f117ad6-2342-40f0-9e00-20cec55f6021.txt (its 20 logs
    share one script but for SEED)."""

    log = "results/20260515_contranormuown/0f117ad6-2342-40f0-9e00-20cec55f6021.txt"
    steps = 3000                    # log:483 train_steps
    claim = 2995                    # README
    muown_lr = 0.0045               # log:458 LR_MUOWN
    cooldown_frac = 0.7             # log:459 LR_COOLDOWN_FRAC
    lr_power = 0.9                  # log:460 LR_POWER
    lr_schedule_steps = 3045        # log:461 LR_SCHEDULE_STEPS
    v_norm_steps = 3005             # log:462 V_NORM_SCHEDULE_STEPS
    v_norm_power = 0.9              # log:463 V_NORM_SCHEDULE_POWER
    v_norm_target = 2.496           # log:464 V_NORM_TARGET_SCALE
    attn_proj_mult = 1.5            # log:469 V_NORM_FAMILY_MULT["attn.proj.weight"]
    mlp_fc_mult = 1.5               # log:470 ["mlp.fc.weight"]
    mlp_proj_mult = 3.33333333333   # log:471 ["mlp.proj.weight"] (q, k, v: 1.0)
    contra_muon = 0.65              # log:473 CONTRA_MUON
    contra_end = 1925               # log:475 CONTRA_TO_NORMAL_END_STEP (hold end 0, :474)
    normuon_beta2 = 0.8             # log:477 NOR_MUON_BETA2
    momentum = 0.946                # log:478 MUOWN_MOMENTUM
    gain_betas = (0.9, 0.95)        # log:479 BETA1, log:554 betas=(BETA1, 0.95)
    gain_eps = 1e-8                 # log:279 adam_eps (MuownDP's default)
    power_iterations = 5            # log:194 scale_to_unit_operator_norm
    power_eps = 1e-10               # log:190
    embed_lr = 0.6                  # log:455 LR_EMBED
    head_lr = 0.009375              # log:456 LR_HEAD
    vector_lr = 0.03                # log:457 LR_1D
    adam_betas = (0.8, 0.95)        # log:546
    adam_eps = 1e-10                # log:546
