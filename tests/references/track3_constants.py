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
