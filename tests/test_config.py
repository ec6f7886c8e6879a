"""`DHPOConfig` defaults follow the paper, bad values fail early naming the field, settings that would not act are
refused naming the setting that would make them act, on-policy DHPO warns, presets map the seven rows."""

import inspect
import warnings

from datetime import timedelta

import pytest
import torch
from trl import GRPOConfig, TrlParser

from dhpo_trl import DHPOConfig
from dhpo_trl.core.config import from_grpo_config, selection_note
from dhpo_trl.core.losses import dhpo_per_token_loss
from dhpo_trl.core.objectives import OBJECTIVE_SETTINGS, OBJECTIVES, SETTING_SCOPES
from dhpo_trl.core.presets import PAPER_ALGORITHMS, config_for

CPU = dict(use_cpu=True, bf16=False, report_to="none")
OFF_POLICY = dict(gradient_accumulation_steps=1, steps_per_generation=2)


def make_config(tmp_path, **kwargs):
    return DHPOConfig(output_dir=str(tmp_path), **CPU, **{**OFF_POLICY, **kwargs})


def test_defaults_follow_the_paper(tmp_path):
    config = make_config(tmp_path)
    assert config.algorithm == "dhpo"
    assert config.mixing == "entropy"  # DHPO-E, eq. 10
    assert config.clipping == "branch"  # eq. 11
    assert config.token_weight == 0.5  # DHPO-A's arithmetic mean
    for branch in ("token", "seq"):
        assert getattr(config, f"epsilon_low_{branch}") == 0.2
        assert getattr(config, f"epsilon_high_{branch}") == 0.28
    assert config.loss_type == "grpo"  # eq. 7: mean over responses of the per-response token mean
    assert config.beta == 0.0  # no KL term
    assert config.scale_rewards == "group"  # eq. 1
    assert config.importance_sampling_level == "token"
    assert config.entropy_norm_scope == "batch"
    assert (config.gmpo_epsilon_low, config.gmpo_epsilon_high) == (0.4, 0.4)
    assert config.delta is None  # the paper's equations: no dual clip


@pytest.mark.parametrize(
    ("field", "value", "extra"),
    [
        ("algorithm", "ppo", {}),
        ("mixing", "geometric", {}),
        ("clipping", "none", {}),
        ("entropy_norm_scope", "token", {}),
        ("importance_sampling_level", "tokens", {}),
        ("token_weight", 1.01, dict(mixing="averaged")),
        ("token_weight", -0.5, dict(mixing="averaged")),
        ("token_weight", "0.5", dict(mixing="averaged")),  # a string is not coerced
        ("token_weight", True, dict(mixing="averaged")),  # nor is a bool taken for 1
        ("token_weight", float("nan"), dict(mixing="averaged")),
        ("epsilon_low_token", -0.1, {}),
        ("epsilon_high_token", -0.1, {}),
        ("epsilon_low_seq", -0.1, {}),
        ("epsilon_high_seq", -0.1, {}),
        ("epsilon_low_token", 1.0, {}),  # 1 - 1 = 0: no lower clip left
        ("epsilon_low_seq", 1.5, {}),
        ("epsilon_high_seq", "0.28", {}),
        ("gmpo_epsilon_low", -0.4, dict(algorithm="gmpo")),
        ("gmpo_epsilon_high", -0.4, dict(algorithm="gmpo")),
        ("gmpo_epsilon_high", False, dict(algorithm="gmpo")),
        ("epsilon", 1.0, dict(algorithm="grpo")),
        ("epsilon_high", "0.3", dict(algorithm="grpo")),
        ("epsilon_high", 0.0, dict(algorithm="cispo")),  # a cap of 0 zeroes every weight
        ("delta", 1.0, dict(algorithm="grpo")),  # a dual clip at or below 1 cuts into the trust region
        ("delta", 0.5, {}),
        ("delta", "3", dict(algorithm="gspo")),
        ("loss_type", "sapo", dict(algorithm="grpo")),  # TRL's SAPO objective against an explicit other row
        ("loss_type", "cispo", dict(algorithm="gmpo")),
        ("loss_type", "luspo_v2", {}),
        ("sapo_temperature_pos", 0.0, dict(algorithm="sapo")),  # the gate divides by it
        ("sapo_temperature_neg", -1.0, dict(algorithm="sapo")),
        ("sapo_temperature_neg", "1", dict(algorithm="sapo")),
        ("vespo_lambda_pos", 0.0, dict(algorithm="vespo")),  # TRL floors lambda at 1e-4: a smaller one is not acted on
        ("vespo_k_neg", float("inf"), dict(algorithm="vespo")),
    ],
)
def test_validation_error_names_the_field(tmp_path, field, value, extra):
    with pytest.raises(ValueError, match=rf"DHPOConfig\.{field}="):
        make_config(tmp_path, **extra, **{field: value})


# (settings, refused field, where it would act)
REFUSED = [
    (dict(algorithm="dhpo", epsilon=0.3), "epsilon", "algorithm='grpo', 'gspo' or 'luspo'"),
    (dict(algorithm="dhpo", epsilon_high=0.28), "epsilon_high", "'cispo' (the weight cap)"),
    (dict(algorithm="gmpo", epsilon=0.1), "epsilon", "algorithm='grpo', 'gspo' or 'luspo'"),
    (dict(algorithm="gmpo", epsilon_high=0.3), "epsilon_high", "algorithm='grpo', 'gspo' or 'luspo'"),
    (dict(algorithm="cispo", epsilon=0.3), "epsilon", "algorithm='grpo', 'gspo' or 'luspo'"),
    (dict(algorithm="sapo", epsilon=0.3), "epsilon", "algorithm='grpo', 'gspo' or 'luspo'"),
    (dict(algorithm="vespo", delta=3.0), "delta", "'luspo'"),
    (dict(algorithm="grpo", epsilon_low_token=0.1), "epsilon_low_token", "algorithm='dhpo'"),
    (dict(algorithm="gspo", epsilon_high_seq=0.3), "epsilon_high_seq", "clipping='branch'"),
    (dict(algorithm="cispo", epsilon_high_token=0.3), "epsilon_high_token", "algorithm='dhpo'"),
    (dict(algorithm="grpo", mixing="averaged"), "mixing", "algorithm='dhpo'"),
    (dict(algorithm="gmpo", clipping="unified"), "clipping", "algorithm='dhpo'"),
    (dict(algorithm="grpo", token_weight=0.7), "token_weight", "mixing='averaged'"),
    (dict(algorithm="gspo", entropy_norm_scope="sequence"), "entropy_norm_scope", "mixing='entropy'"),
    (dict(algorithm="dhpo", gmpo_epsilon_low=0.3), "gmpo_epsilon_low", "algorithm='gmpo'"),
    (dict(algorithm="grpo", gmpo_epsilon_high=0.3), "gmpo_epsilon_high", "algorithm='gmpo'"),
    (dict(mixing="entropy", token_weight=0.7), "token_weight", "mixing='averaged'"),
    (dict(clipping="unified", epsilon_low_seq=0.1), "epsilon_low_seq", "clipping='branch'"),
    (dict(clipping="unified", epsilon_high_seq=0.5), "epsilon_high_seq", "clipping='branch'"),
    (dict(mixing="averaged", entropy_norm_scope="global"), "entropy_norm_scope", "mixing='entropy'"),
    (dict(mixing="averaged", entropy_norm_scope="sequence"), "entropy_norm_scope", "mixing='entropy'"),
    (dict(algorithm="gmpo", delta=3.0), "delta", "'dhpo'"),
    (dict(algorithm="cispo", delta=3.0), "delta", "'dhpo'"),
    (dict(algorithm="gmpo", importance_sampling_level="sequence"), "importance_sampling_level", "algorithm='gspo'"),
    # VESPO's weight is its sequence's whatever the level: the level acts on the bias-corrected KL only
    (dict(algorithm="vespo", importance_sampling_level="sequence"), "importance_sampling_level", "bias-corrected KL"),
    (dict(algorithm="vespo", importance_sampling_level="sequence", beta=0.1, use_bias_correction_kl=False),
     "importance_sampling_level", "bias-corrected KL"),
    (dict(algorithm="grpo", sapo_temperature_pos=2.0), "sapo_temperature_pos", "algorithm='sapo'"),
    (dict(algorithm="luspo", sapo_temperature_neg=2.0), "sapo_temperature_neg", "algorithm='sapo'"),
    (dict(algorithm="sapo", vespo_k_pos=1.0), "vespo_k_pos", "algorithm='vespo'"),
    (dict(algorithm="dhpo", vespo_lambda_pos=1.0), "vespo_lambda_pos", "algorithm='vespo'"),
    (dict(algorithm="cispo", vespo_k_neg=1.0), "vespo_k_neg", "algorithm='vespo'"),
    (dict(algorithm="gspo", vespo_lambda_neg=1.0), "vespo_lambda_neg", "algorithm='vespo'"),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "field", "acts_with"), REFUSED)
def test_settings_without_effect_are_refused_naming_where_they_act(tmp_path, settings, field, acts_with):
    with pytest.raises(ValueError, match=rf"DHPOConfig\.{field}=.* has no effect with .*: it acts with") as error:
        make_config(tmp_path, **settings)
    assert acts_with in str(error.value)
    assert f"algorithm={settings.get('algorithm', 'dhpo')!r}" in str(error.value)


@pytest.mark.parametrize(("algorithm", "field", "own"), [
    ("dhpo", "epsilon", "epsilon_low_token"), ("dhpo", "epsilon_high", "epsilon_high_token"),
    ("dhpo", "epsilon_high", "epsilon_high_seq"), ("gmpo", "epsilon_high", "gmpo_epsilon_high"),
])  # fmt: skip
def test_trl_epsilons_refused_with_dhpo_or_gmpo_name_the_rows_own_fields(tmp_path, algorithm, field, own):
    """A TRL config's clip-higher (DAPO's epsilon_high=0.28) moved to DHPO: the refusal names the field that acts."""
    with pytest.raises(ValueError, match=rf"DHPOConfig\.{field}=") as error:
        make_config(tmp_path, algorithm=algorithm, **{field: 0.28 if field == "epsilon_high" else 0.3})
    assert own in str(error.value)
    assert make_config(tmp_path, algorithm=algorithm, **{own: 0.28})  # and that field is accepted


def test_every_objective_setting_is_refused_somewhere_and_read_somewhere(tmp_path):
    """The registry is the one source of truth: each objective-specific field is read by some objective and has a
    scope message; the refusal table above exercises every one of them."""
    assert set(OBJECTIVE_SETTINGS) == set(SETTING_SCOPES)
    variants = [dict(mixing=m, clipping=c) for m in ("averaged", "entropy") for c in ("branch", "unified")]
    configs = [make_config(tmp_path, **variant) for variant in variants]
    read = {name for objective in OBJECTIVES.values() for config in configs for name in objective.settings(config)}
    assert read == set(OBJECTIVE_SETTINGS)
    assert {field for _, field, _ in REFUSED} == set(OBJECTIVE_SETTINGS)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo"])
def test_gmpo_refuses_token_weighted_aggregations(tmp_path, loss_type):
    message = rf"DHPOConfig\.loss_type='{loss_type}' with algorithm='gmpo'.*loss_type='grpo'"
    with pytest.raises(ValueError, match=message):
        make_config(tmp_path, algorithm="gmpo", loss_type=loss_type)


@pytest.mark.parametrize("algorithm", ["dhpo", "grpo", "gspo", "cispo", "sapo", "vespo"])
def test_token_aggregations_stay_selectable(tmp_path, algorithm):
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        assert make_config(tmp_path, algorithm=algorithm, loss_type=loss_type).loss_type == loss_type
    # bnpo normalises per micro-batch: with TRL's batching only
    assert make_config(tmp_path, algorithm=algorithm, loss_type="bnpo", dynamic_batching=False).loss_type == "bnpo"


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "7"])
def test_a_seed_numpy_cannot_take_is_refused_at_construction(tmp_path, seed):
    """TRL's trainer seeds numpy with it (accelerate's set_seed), after the model has loaded: refused here instead."""
    with pytest.raises(ValueError, match=r"DHPOConfig\.seed="):
        make_config(tmp_path, seed=seed)


def test_every_seed_numpy_takes_is_accepted(tmp_path):
    assert [make_config(tmp_path, seed=seed).seed for seed in (0, 2**32 - 1)] == [0, 2**32 - 1]


def test_a_seed_some_rank_would_push_past_numpys_limit_is_refused(tmp_path, monkeypatch):
    """TRL seeds each process with seed + its rank (`set_seed(seed, device_specific=True)`): on 4 processes the top
    3 seeds numpy takes fail on a rank once the model has loaded."""
    monkeypatch.setattr(DHPOConfig, "world_size", property(lambda self: 4))
    with pytest.raises(ValueError, match=r"DHPOConfig\.seed=4294967293 .*2\*\*32 - 4"):
        make_config(tmp_path, seed=2**32 - 3)
    assert make_config(tmp_path, seed=2**32 - 4).seed == 2**32 - 4


# TRL settings that TRL accepts at construction and fails on (or divides by) only once training runs.
FAILS_MID_RUN = [
    ("num_iterations", 0), ("num_iterations", 1.5), ("steps_per_generation", 0), ("max_completion_length", 0),
    ("temperature", 0.0), ("temperature", -0.7), ("temperature", float("inf")), ("temperature", float("nan")),
    ("scale_rewards", "sometimes"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), FAILS_MID_RUN)
def test_trl_settings_that_fail_mid_run_are_refused_at_construction(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"DHPOConfig\.{field}="):
        make_config(tmp_path, **{field: value})


@pytest.mark.parametrize("size", [0, -8])
def test_a_generation_batch_size_below_1_is_refused_before_trl_divides_it(tmp_path, size):
    """TRL derives steps_per_generation from it (0 or -1 here): named here, not a ZeroDivisionError or a run whose
    generation batches hold no prompt."""
    with pytest.raises(ValueError, match=r"DHPOConfig\.generation_batch_size="):
        make_config(tmp_path, generation_batch_size=size, steps_per_generation=None)
    assert make_config(tmp_path, generation_batch_size=16, steps_per_generation=None).steps_per_generation == 2


def test_trl_settings_at_their_limits_are_accepted(tmp_path):
    config = make_config(tmp_path, num_iterations=1, max_completion_length=1, temperature=1e-3, scale_rewards=False)
    assert (config.num_iterations, config.max_completion_length, config.scale_rewards) == (1, 1, "none")
    assert [make_config(tmp_path, scale_rewards=mode).scale_rewards for mode in ("group", "batch", "none", True)] == [
        "group", "batch", "none", "group"]  # fmt: skip


def test_settings_at_their_default_and_settings_that_act_are_accepted(tmp_path):
    # a value typed at its default is indistinguishable from an omitted one, and changes nothing
    assert make_config(tmp_path, algorithm="grpo", epsilon_low_token=0.2, mixing="entropy", token_weight=0.5)
    gspo = make_config(tmp_path, algorithm="gspo", importance_sampling_level="sequence")
    assert gspo.importance_sampling_level == "sequence"
    assert make_config(tmp_path, algorithm="dhpo", delta=3.0).delta == 3.0  # DHPO's dual clip for A < 0
    assert make_config(tmp_path, algorithm="gspo", delta=2.5, epsilon=0.1, epsilon_high=0.2).delta == 2.5
    assert make_config(tmp_path, mixing="averaged", token_weight=1, clipping="unified").token_weight == 1
    assert make_config(tmp_path, algorithm="cispo", epsilon_high=5.0).epsilon_high == 5.0


# Averaged mixing at an end of [0, 1] gives one branch no weight, so that branch's trust region cannot act (with
# branch clipping; the unified clip clips m with the token epsilons whatever w).
UNWEIGHTED_BRANCH = [
    (dict(token_weight=1.0), "epsilon_low_seq", 0.05),
    (dict(token_weight=1), "epsilon_high_seq", 0.01),
    (dict(token_weight=0.0), "epsilon_low_token", 0.05),
    (dict(token_weight=0), "epsilon_high_token", 0.01),
]  # fmt: skip


def _dhpo_loss(settings):
    """Per-token DHPO loss on a batch where every clip of both branches binds (ratios far outside [0.8, 1.28])."""
    logps = torch.log(torch.tensor([[2.0, 1.5, 3.0], [0.3, 0.5, 0.2]], dtype=torch.float64))
    old, mask = torch.zeros_like(logps), torch.ones_like(logps)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return dhpo_per_token_loss(logps, old, advantages, mask, mixing="averaged", clipping="branch", **settings)[0]


@pytest.mark.parametrize(("weight", "field", "value"), UNWEIGHTED_BRANCH)
def test_the_epsilons_of_a_branch_without_weight_are_refused(tmp_path, weight, field, value):
    # the premise, on the pure loss: at this weight the field changes nothing; at w = 0.5 it does
    assert torch.equal(_dhpo_loss({**weight, field: value}), _dhpo_loss(weight))
    assert not torch.equal(_dhpo_loss({"token_weight": 0.5, field: value}), _dhpo_loss({"token_weight": 0.5}))
    with pytest.raises(ValueError, match=rf"DHPOConfig\.{field}=.* has no effect with .*token_weight") as error:
        make_config(tmp_path, mixing="averaged", **weight, **{field: value})
    assert "token_weight" in str(error.value).split("it acts with")[1]  # the setting that would make it act
    assert make_config(tmp_path, mixing="averaged", token_weight=0.5, **{field: value})  # acts between the ends
    assert make_config(tmp_path, mixing="averaged", **weight)  # the field at its default: accepted


def test_the_unified_clip_reads_the_token_epsilons_at_every_weight(tmp_path):
    config = make_config(tmp_path, mixing="averaged", token_weight=0.0, clipping="unified", epsilon_low_token=0.1)
    assert config.epsilon_low_token == 0.1


@pytest.mark.parametrize(("asked", "fix"), [
    (dict(), dict(importance_sampling_level="token")),  # the default row: DHPO
    (dict(algorithm="grpo"), dict(algorithm="grpo", importance_sampling_level="token")),
])  # fmt: skip
def test_the_selection_note_names_the_fix_back_to_the_row_asked_for(tmp_path, asked, fix):
    """importance_sampling_level='sequence' selects GSPO; the note's fix, applied, runs the row the config named."""
    note = selection_note(make_config(tmp_path, importance_sampling_level="sequence", **asked))
    assert make_config(tmp_path, **fix).algorithm == asked.get("algorithm", "dhpo")  # the fix, applied
    named = note.split("; for ", 1)[1]  # the settings the fix names
    assert "importance_sampling_level='token'" in named
    assert ("algorithm='grpo'" in named) == ("algorithm" in asked)


# TRL's spellings of its objectives -> (algorithm, loss_type, importance_sampling_level, epsilon_high) run here
TRL_SPELLINGS = [
    (dict(loss_type="sapo"), ("sapo", "grpo", "token", None)),
    (dict(loss_type="sapo", importance_sampling_level="sequence"), ("sapo", "grpo", "sequence", None)),
    (dict(algorithm="sapo", loss_type="sapo"), ("sapo", "grpo", "token", None)),
    (dict(loss_type="vespo"), ("vespo", "dapo", "token", None)),
    (dict(loss_type="luspo"), ("luspo", "luspo", "token", None)),
    (dict(loss_type="luspo", importance_sampling_level="sequence"), ("luspo", "luspo", "sequence", None)),
    (dict(algorithm="luspo"), ("luspo", "luspo", "token", None)),  # its own aggregation, not the default "grpo"
    (dict(loss_type="cispo"), ("cispo", "dapo", "token", 0.2)),  # TRL's cap: epsilon_high, else epsilon
    (dict(loss_type="cispo", epsilon=0.5), ("cispo", "dapo", "token", 0.5)),
    (dict(loss_type="cispo", epsilon_high=5.0), ("cispo", "dapo", "token", 5.0)),
    (dict(importance_sampling_level="sequence"), ("gspo", "grpo", "sequence", None)),
    (dict(importance_sampling_level="sequence", loss_type="dapo"), ("gspo", "dapo", "sequence", None)),
    (dict(algorithm="grpo", importance_sampling_level="sequence"), ("gspo", "grpo", "sequence", None)),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "expected"), TRL_SPELLINGS)
def test_trls_spellings_select_the_row_trl_runs(tmp_path, settings, expected):
    config = make_config(tmp_path, **settings)
    ran = (config.algorithm, config.loss_type, config.importance_sampling_level, config.epsilon_high)
    assert ran == expected
    config.validate()  # idempotent: the trainer validates again
    assert (config.algorithm, config.loss_type, config.importance_sampling_level, config.epsilon_high) == expected


def test_an_explicit_other_algorithm_with_trls_objective_spelling_is_refused_naming_both(tmp_path):
    with pytest.raises(ValueError, match=r"DHPOConfig\.loss_type='vespo' is TRL's VESPO objective, but "
                                         r"algorithm='cispo': set algorithm='vespo'"):
        make_config(tmp_path, algorithm="cispo", loss_type="vespo")
    # a row's own setting left behind by the selection names what selected the row
    with pytest.raises(ValueError, match=r"DHPOConfig\.mixing='averaged' has no effect with algorithm='gspo' "
                                         r"\(selected by importance_sampling_level='sequence'"):
        make_config(tmp_path, importance_sampling_level="sequence", mixing="averaged")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_a_grpo_config_converts_to_the_row_trl_runs_with_every_field_kept(tmp_path, loss_type, level):
    grpo = GRPOConfig(str(tmp_path), loss_type=loss_type, importance_sampling_level=level, epsilon=0.25,
                      learning_rate=3e-4, gradient_accumulation_steps=2, steps_per_generation=4, seed=7,
                      **dict(CPU, bf16=False))  # fmt: skip
    config, ignored = from_grpo_config(grpo)
    rows = {"cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo"), "luspo": ("luspo", "luspo"), "vespo": ("vespo", "dapo")}
    clipped_surrogate = ("gspo" if level == "sequence" else "grpo", loss_type)
    assert (config.algorithm, config.loss_type) == rows.get(loss_type, clipped_surrogate)
    for name in ("learning_rate", "gradient_accumulation_steps", "steps_per_generation", "seed", "num_generations",
                 "beta", "scale_rewards", "max_completion_length", "temperature"):
        assert getattr(config, name) == getattr(grpo, name), name
    assert config.generation_batch_size == grpo.generation_batch_size
    # TRL's epsilon_high None: epsilon for the upper clip and for CISPO's cap; SAPO and VESPO ignore epsilon (and VESPO
    # the level without a KL), as TRL does: set back to the default and named
    unread = {"epsilon": 0.25} if loss_type in ("sapo", "vespo") else {}
    if (loss_type, level) == ("vespo", "sequence"):
        unread["importance_sampling_level"] = "sequence"
    assert ignored == unread
    if loss_type == "cispo":
        assert (config.epsilon, config.epsilon_high) == (0.2, 0.25)
    else:
        assert (config.epsilon, config.epsilon_high) == (0.2 if unread else 0.25, None)
    assert config.importance_sampling_level == ("token" if "importance_sampling_level" in unread else level)


def test_bare_cispo_caps_the_weight_at_the_papers_1_2(tmp_path):
    config = make_config(tmp_path, algorithm="cispo")
    assert config.epsilon_high == 1.2 and config.loss_type == "grpo"


def test_cli_parser_passes_every_field_and_only_changed_ones_are_refused(tmp_path):
    """TrlParser hands every field to DHPOConfig; defaults must not be mistaken for user settings."""
    parser = TrlParser((DHPOConfig,))
    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--steps_per_generation", "2"]
    for algorithm in OBJECTIVES:
        (config,) = parser.parse_args_into_dataclasses(args=[*base, "--algorithm", algorithm])
        assert config.algorithm == algorithm
    (config,) = parser.parse_args_into_dataclasses(args=[*base, "--algorithm", "grpo", "--delta", "3"])
    assert config.delta == 3.0
    with pytest.raises(ValueError, match=r"DHPOConfig\.token_weight=0\.7 has no effect"):
        parser.parse_args_into_dataclasses(args=[*base, "--algorithm", "grpo", "--token_weight", "0.7"])


def test_validate_catches_a_config_mutated_after_construction(tmp_path):
    config = make_config(tmp_path, algorithm="gspo")
    config.algorithm = "grpo"  # the "sequence" level was the gspo row's, not the user's: GRPO runs token-level
    config.validate()
    assert (config.algorithm, config.importance_sampling_level) == ("grpo", "token")
    config = make_config(tmp_path, algorithm="gspo", importance_sampling_level="sequence")
    config.algorithm = "gmpo"  # ... a level the user set stays, and is refused where it would not act
    with pytest.raises(ValueError, match=r"DHPOConfig\.importance_sampling_level='sequence' has no effect"):
        config.validate()
    config = make_config(tmp_path, algorithm="grpo")
    config.loss_type = "luspo"
    with pytest.raises(ValueError, match=r"DHPOConfig\.loss_type='luspo' is TRL's LUSPO objective"):
        config.validate()
    config = make_config(tmp_path)
    config.algorithm = "cispo"  # the cap is filled in again
    config.validate()
    assert config.epsilon_high == 1.2


ON_POLICY = [
    dict(gradient_accumulation_steps=1, steps_per_generation=1),
    dict(gradient_accumulation_steps=4, steps_per_generation=4),
    # two generation batches per optimizer step (no whole window inside one generation batch: TRL's batching)
    dict(gradient_accumulation_steps=4, steps_per_generation=2, dynamic_batching=False),
]
OFF_POLICY_SETUPS = [
    dict(gradient_accumulation_steps=1, steps_per_generation=2),
    dict(gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2),
    dict(gradient_accumulation_steps=4, steps_per_generation=8),
]


def warnings_of(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("algorithm", ["dhpo", "gmpo"])
@pytest.mark.parametrize("setup", ON_POLICY)
def test_on_policy_dhpo_and_gmpo_warn(tmp_path, algorithm, setup):
    messages = warnings_of(lambda: DHPOConfig(output_dir=str(tmp_path), algorithm=algorithm, **CPU, **setup))
    assert len(messages) == 1
    assert f"algorithm='{algorithm}' runs on-policy" in messages[0] and "exactly GRPO's" in messages[0]
    assert "vLLM alone does not change this" in messages[0]


def test_the_checks_after_trls_post_init_read_the_steps_per_generation_it_resolves(tmp_path):
    """`steps_per_generation` left unset is resolved by TRL's `__post_init__` to `gradient_accumulation_steps`: the
    batching check and the on-policy warning run after it, on that value."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = DHPOConfig(output_dir=str(tmp_path), **CPU, gradient_accumulation_steps=3, dynamic_batching=True)
    assert (config.steps_per_generation, config.dynamic_batching) == (3, True)  # 3 is a multiple of 3: accepted
    (warning,) = user_warnings(caught)
    assert "gradient_accumulation_steps=3 is a multiple of steps_per_generation=3" in str(warning.message)


def test_on_policy_warning_is_given_once_per_setup(tmp_path):
    config = DHPOConfig(output_dir=str(tmp_path), **CPU, **ON_POLICY[0])
    assert warnings_of(config.validate) == []  # the trainer's re-validation does not repeat it
    config.gradient_accumulation_steps = config.steps_per_generation = 2  # still on-policy, another setup
    assert len(warnings_of(config.validate)) == 1


@pytest.mark.parametrize("setup", OFF_POLICY_SETUPS)
def test_off_policy_configs_and_grpo_do_not_warn(tmp_path, setup):
    assert warnings_of(lambda: DHPOConfig(output_dir=str(tmp_path), **CPU, **setup)) == []
    on_policy = dict(gradient_accumulation_steps=1, steps_per_generation=1)
    assert warnings_of(lambda: DHPOConfig(output_dir=str(tmp_path), algorithm="grpo", **CPU, **on_policy)) == []


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ("GRPO", dict(algorithm="grpo", loss_type="grpo", importance_sampling_level="token", epsilon=0.2,
                      epsilon_high=0.2, delta=3.0)),
        ("GSPO", dict(algorithm="gspo", loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4,
                      epsilon_high=4e-4, delta=None)),
        ("GMPO", dict(algorithm="gmpo", loss_type="grpo", importance_sampling_level="token", gmpo_epsilon_low=0.4,
                      gmpo_epsilon_high=0.4, delta=None)),
        ("CISPO", dict(algorithm="cispo", loss_type="grpo", importance_sampling_level="token", epsilon_high=1.2,
                       delta=None)),
        ("DHPO-A", dict(algorithm="dhpo", mixing="averaged", token_weight=0.5, clipping="branch", loss_type="grpo",
                        importance_sampling_level="token", epsilon_low_token=0.2, epsilon_high_token=0.28,
                        epsilon_low_seq=0.2, epsilon_high_seq=0.28, delta=None)),
        ("DHPO-E", dict(algorithm="dhpo", mixing="entropy", clipping="branch", loss_type="grpo",
                        importance_sampling_level="token", epsilon_low_token=0.2, epsilon_high_token=0.28,
                        epsilon_low_seq=0.2, epsilon_high_seq=0.28, delta=None)),
        ("DHPO-E-unified", dict(algorithm="dhpo", mixing="entropy", clipping="unified", loss_type="grpo",
                                importance_sampling_level="token", epsilon_low_token=0.2, epsilon_high_token=0.28,
                                delta=None)),
    ],
)  # fmt: skip
def test_presets_produce_the_paper_rows(tmp_path, row, expected):
    config = config_for(row, output_dir=str(tmp_path), **OFF_POLICY, **CPU)
    assert isinstance(config, DHPOConfig)
    actual = {name: getattr(config, name) for name in expected}
    assert actual == expected
    assert config.beta == 0.0


def test_presets_cover_seven_rows_and_accept_overrides(tmp_path):
    assert list(PAPER_ALGORITHMS) == ["GRPO", "GSPO", "GMPO", "CISPO", "DHPO-A", "DHPO-E", "DHPO-E-unified"]
    config = config_for("DHPO-A", output_dir=str(tmp_path), token_weight=0.8, **OFF_POLICY, **CPU)
    assert (config.mixing, config.token_weight) == ("averaged", 0.8)
    with pytest.raises(ValueError, match="DAPO"):
        config_for("DAPO", output_dir=str(tmp_path), **CPU)


ACCEPTED_AT_THE_LIMIT = [
    dict(epsilon_low_token=0.0, epsilon_high_token=0.0, epsilon_low_seq=0.0, epsilon_high_seq=0.0),  # epsilon 0
    dict(epsilon_low_token=0.999, epsilon_low_seq=0.999),  # just below 1: a lower clip at 0.001 remains
    dict(mixing="averaged", token_weight=0),  # w = 0: GSPO's ratio
    dict(mixing="averaged", token_weight=1.0),  # w = 1: GRPO's ratio
    dict(delta=1.000001),
    dict(algorithm="grpo", epsilon=0.0, epsilon_high=0.0, delta=3),
    dict(algorithm="gmpo", gmpo_epsilon_low=0.0, gmpo_epsilon_high=0.0),
    dict(algorithm="cispo", epsilon_high=1e-9),
    dict(max_tokens_per_micro_batch=1),
    dict(dynamic_batching=False, loss_type="bnpo", gradient_accumulation_steps=2, steps_per_generation=3),
]


@pytest.mark.parametrize(
    "settings", ACCEPTED_AT_THE_LIMIT, ids=[f"limit{i}" for i in range(len(ACCEPTED_AT_THE_LIMIT))]
)
def test_values_exactly_at_a_limit_are_accepted(tmp_path, settings):
    config = make_config(tmp_path, **settings)
    assert {name: getattr(config, name) for name in settings} == settings


def test_validate_applies_the_algorithm_again(tmp_path):
    """(validate() refusing a mutated batching setting: tests/test_contracts.py.)"""
    config = make_config(tmp_path)
    config.algorithm = "gspo"  # what the algorithm implies is applied again
    config.validate()
    assert config.importance_sampling_level == "sequence"


def user_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, UserWarning)]


def test_on_policy_warning_points_at_the_caller(tmp_path):
    # Counts stack frames: left out of the mutation run, whose trampolines add one (pyproject.toml).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        DHPOConfig(output_dir=str(tmp_path), **CPU, gradient_accumulation_steps=2, steps_per_generation=2)
    (warning,) = user_warnings(caught)
    assert (warning.filename, warning.lineno) == (__file__, line)  # the line that built the config


def test_on_policy_warning_from_the_trainer_points_at_the_caller(tmp_path, monkeypatch):
    """A config made on-policy after it was built warns when `DHPOTrainer(...)` validates it, at that call's line."""
    from dhpo_trl import DHPOTrainer
    from dhpo_trl.training import trainer

    class Validated(Exception):
        """Raised by the step after `validate()`: no model is loaded."""

    def stop(*args, **kwargs):
        raise Validated

    config = DHPOConfig(output_dir=str(tmp_path), **CPU, **OFF_POLICY)
    config.gradient_accumulation_steps = config.steps_per_generation = 2
    monkeypatch.setattr(trainer, "check_vllm_setup", stop)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(Validated):
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        DHPOTrainer("tiny-model", [len], args=config)
    (warning,) = user_warnings(caught)
    assert "runs on-policy" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)  # the line that built the trainer


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "cispo"])
def test_baselines_do_not_warn_on_policy(tmp_path, algorithm):
    on_policy = dict(gradient_accumulation_steps=1, steps_per_generation=1)
    assert warnings_of(lambda: DHPOConfig(output_dir=str(tmp_path), algorithm=algorithm, **CPU, **on_policy)) == []


# ------------------------------------------------------------------ presets, written out
def test_preset_table_as_written_in_the_paper():
    assert PAPER_ALGORITHMS == {
        "GRPO": {"algorithm": "grpo", "epsilon": 0.2, "epsilon_high": 0.2, "delta": 3.0},
        "GSPO": {"algorithm": "gspo", "epsilon": 0.0003, "epsilon_high": 0.0004},
        "GMPO": {"algorithm": "gmpo", "gmpo_epsilon_low": 0.4, "gmpo_epsilon_high": 0.4},
        "CISPO": {"algorithm": "cispo", "epsilon_high": 1.2},
        "DHPO-A": {
            "algorithm": "dhpo", "mixing": "averaged", "token_weight": 0.5, "clipping": "branch",
            "epsilon_low_token": 0.2, "epsilon_high_token": 0.28, "epsilon_low_seq": 0.2, "epsilon_high_seq": 0.28,
        },
        "DHPO-E": {
            "algorithm": "dhpo", "mixing": "entropy", "clipping": "branch",
            "epsilon_low_token": 0.2, "epsilon_high_token": 0.28, "epsilon_low_seq": 0.2, "epsilon_high_seq": 0.28,
        },
        "DHPO-E-unified": {
            "algorithm": "dhpo", "mixing": "entropy", "clipping": "unified",
            "epsilon_low_token": 0.2, "epsilon_high_token": 0.28,
        },
    }  # fmt: skip


def test_config_for_overrides_without_editing_the_table(tmp_path):
    config = config_for("GRPO", output_dir=str(tmp_path), delta=2.0, epsilon_high=0.3, **OFF_POLICY, **CPU)
    assert (config.algorithm, config.epsilon, config.epsilon_high, config.delta) == ("grpo", 0.2, 0.3, 2.0)
    assert PAPER_ALGORITHMS["GRPO"] == {"algorithm": "grpo", "epsilon": 0.2, "epsilon_high": 0.2, "delta": 3.0}
    with pytest.raises(ValueError) as error:
        config_for("grpo", output_dir=str(tmp_path))  # the row names, not the algorithm names
    assert str(error.value) == (
        "Unknown algorithm 'grpo': choose one of ['GRPO', 'GSPO', 'GMPO', 'CISPO', 'DHPO-A', 'DHPO-E', "
        "'DHPO-E-unified']."
    )


# ------------------------------------------------------------------ no knob is a silent no-op
def _loss_and_gradient(config):
    """The objective's per-token loss and its gradient on a fixed batch whose ratios lie on both sides of every
    clip: row 0 has A > 0, rows 1 and 2 A < 0 (row 2 with ratios far above 1, where a dual clip acts)."""
    import torch

    log_ratio = torch.tensor([[0.5, -0.5, 0.1, 0.3], [-0.5, 0.4, -0.1, -0.6], [0.8, 0.6, 1.0, 0.2]])
    per_token_logps = (log_ratio - 1.0).requires_grad_(True)
    old = torch.full_like(log_ratio, -1.0)
    advantages = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.ones_like(log_ratio)
    entropies = torch.tensor([[0.1, 2.0, 0.5, 1.0], [1.5, 0.2, 0.9, 0.3], [0.4, 1.2, 0.05, 2.5]])
    objective = OBJECTIVES[config.algorithm]
    loss, _, _ = objective.compute(per_token_logps, old, advantages, mask, entropies, config, None)
    (gradient,) = torch.autograd.grad(loss.sum(), per_token_logps)
    return torch.cat([loss.detach().flatten(), gradient.flatten()])


# (preset row, knob, a value other than the row's): each changes the loss or its gradient
KNOBS = [
    ("DHPO-E", "mixing", "averaged"),
    ("DHPO-E", "clipping", "unified"),
    ("DHPO-E", "epsilon_low_token", 0.05),
    ("DHPO-E", "epsilon_high_token", 0.05),
    ("DHPO-E", "epsilon_low_seq", 0.01),
    ("DHPO-E", "epsilon_high_seq", 0.01),
    ("DHPO-E", "entropy_norm_scope", "sequence"),  # "global" differs from "batch" across processes only
    ("DHPO-E", "delta", 1.5),
    ("DHPO-A", "token_weight", 0.9),
    ("DHPO-E-unified", "epsilon_low_token", 0.05),
    ("DHPO-E-unified", "epsilon_high_token", 0.05),
    ("GRPO", "epsilon", 0.05),
    ("GRPO", "epsilon_high", 0.05),
    ("GRPO", "delta", 1.5),
    ("GSPO", "epsilon", 0.5),
    ("GSPO", "epsilon_high", 0.5),
    ("GSPO", "delta", 1.2),
    ("GMPO", "gmpo_epsilon_low", 0.05),
    ("GMPO", "gmpo_epsilon_high", 0.05),
    ("CISPO", "epsilon_high", 1.05),
]


@pytest.mark.parametrize(("row", "knob", "value"), KNOBS, ids=[f"{row}-{knob}" for row, knob, _ in KNOBS])
def test_every_objective_knob_changes_the_update(tmp_path, row, knob, value):
    import torch

    base = config_for(row, output_dir=str(tmp_path), **OFF_POLICY, **CPU)
    changed = config_for(row, output_dir=str(tmp_path), **{knob: value}, **OFF_POLICY, **CPU)
    assert getattr(changed, knob) == value != getattr(base, knob)
    assert not torch.allclose(_loss_and_gradient(base), _loss_and_gradient(changed))


# ------------------------------------------------------------- DeepSpeed that accelerate would silently drop
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto"}  # fmt: skip


@pytest.mark.parametrize(
    ("deepspeed", "environ", "refused"),
    [
        (ZERO3, {"ACCELERATE_USE_CPU": "1"}, "DHPOConfig.deepspeed"),
        ("ds_config.json", {"ACCELERATE_USE_CPU": "True"}, "DHPOConfig.deepspeed"),
        (None, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_CPU": "yes"}, "ACCELERATE_USE_DEEPSPEED"),
        (ZERO3, {"ACCELERATE_USE_CPU": "False"}, None),  # what `accelerate launch` writes without --cpu
        (ZERO3, {}, None),
        (None, {"ACCELERATE_USE_CPU": "1"}, None),  # a plain CPU run
        (None, {"ACCELERATE_USE_DEEPSPEED": "false", "ACCELERATE_USE_CPU": "1"}, None),
    ],
)
def test_deepspeed_that_accelerate_would_drop_is_refused(deepspeed, environ, refused):
    from dhpo_trl.core.config import refuse_deepspeed_dropped_by_accelerate

    if refused is None:
        refuse_deepspeed_dropped_by_accelerate(deepspeed, environ)
        return
    with pytest.raises(ValueError, match=refused) as caught:
        refuse_deepspeed_dropped_by_accelerate(deepspeed, environ)
    assert "ACCELERATE_USE_CPU" in str(caught.value)


TORCHRUN = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}


@pytest.mark.parametrize(
    ("use_cpu", "backend", "environ", "starts"),
    [
        (True, None, TORCHRUN, {"rank": 1, "world_size": 2, "port": "29611"}),
        # torchrun with ACCELERATE_USE_CPU exported
        (False, "gloo", {**TORCHRUN, "WORLD_SIZE": "4", "ACCELERATE_USE_CPU": "true"}, {"rank": 1, "world_size": 4}),
        # accelerate's CPU defaults: port 29500; the rank and size of an MPI launcher (`accelerate launch --cpu
        # --mpirun_hostfile`, the only multi-process `--cpu` launch: Intel MPI's, then Open MPI's variables)
        (True, None, {**TORCHRUN, "MASTER_PORT": ""}, {"rank": 1, "world_size": 2, "port": "29500"}),
        (True, "gloo", {"PMI_SIZE": "3", "PMI_RANK": "2", "MASTER_ADDR": "h"}, {"rank": 2, "world_size": 3}),
        (True, None, {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "MASTER_ADDR": "h"}, {"rank": 0}),
        (True, None, {**TORCHRUN, "WORLD_SIZE": "1"}, None),  # one process: no group to limit
        (True, None, {}, None),
        (False, None, {**TORCHRUN, "ACCELERATE_USE_CPU": "False"}, None),  # a GPU run: transformers passes it
        (True, "ccl", TORCHRUN, None),  # another backend is accelerate's to start
        (True, "mpi", TORCHRUN, None),
        (True, None, {**TORCHRUN, "MASTER_ADDR": ""}, None),  # accelerate names the missing variable
    ],
)
def test_a_cpu_run_of_several_processes_starts_its_group_with_ddp_timeout(use_cpu, backend, environ, starts, monkeypatch):
    import torch.distributed as dist

    from dhpo_trl.core.config import start_cpu_process_group

    started, environ = [], dict(environ)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "is_mpi_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: started.append((backend, kwargs)))
    assert start_cpu_process_group(use_cpu, backend, 77, environ) is (starts is not None)
    if starts is None:
        assert started == []
    else:
        [(group_backend, kwargs)] = started
        assert (group_backend, kwargs["timeout"]) == ("gloo", timedelta(seconds=77))
        assert kwargs["rank"] == starts["rank"] and kwargs["world_size"] == starts.get("world_size", 2)
        assert environ["MASTER_PORT"] == starts.get("port", environ.get("MASTER_PORT"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a group the launch started itself is kept
    assert start_cpu_process_group(use_cpu, backend, 77, environ) is False and len(started) == int(bool(starts))


def test_a_cpu_group_is_left_to_accelerate_where_it_would_choose_mpi(monkeypatch):
    """accelerate starts MPI for a CPU run that names no backend when torch was built with it."""
    import torch.distributed as dist

    from dhpo_trl.core.config import start_cpu_process_group

    started = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: started.append(backend))
    monkeypatch.setattr(dist, "is_mpi_available", lambda: True)
    assert start_cpu_process_group(True, None, 77, dict(TORCHRUN)) is False
    assert start_cpu_process_group(True, "gloo", 77, dict(TORCHRUN)) is True and started == ["gloo"]


def test_the_config_refuses_it_at_construction_and_in_validate(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    with pytest.raises(ValueError, match="DHPOConfig.deepspeed"):
        make_config(tmp_path, deepspeed=ZERO3)
    config = make_config(tmp_path)  # without DeepSpeed the variable is an ordinary CPU run
    config.deepspeed = ZERO3  # set after construction: DHPOTrainer's validate() refuses it too
    with pytest.raises(ValueError, match="DHPOConfig.deepspeed"):
        config.validate()
