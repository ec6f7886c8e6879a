"""`DHPOConfig` defaults follow the paper, bad values fail early naming the field, presets map the seven rows."""

import pytest

from dhpo_trl import DHPOConfig
from dhpo_trl.presets import PAPER_ALGORITHMS, config_for

CPU = dict(use_cpu=True, bf16=False, report_to="none")


def make_config(tmp_path, **kwargs):
    return DHPOConfig(output_dir=str(tmp_path), **CPU, **kwargs)


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


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("algorithm", "ppo"),
        ("mixing", "geometric"),
        ("clipping", "none"),
        ("entropy_norm_scope", "token"),
        ("token_weight", 1.01),
        ("token_weight", -0.5),
        ("epsilon_low_token", -0.1),
        ("epsilon_high_token", -0.1),
        ("epsilon_low_seq", -0.1),
        ("epsilon_high_seq", -0.1),
        ("gmpo_epsilon_low", -0.4),
        ("gmpo_epsilon_high", -0.4),
        ("loss_type", "sapo"),
        ("loss_type", "cispo"),  # CISPO is selected with algorithm="cispo"
        ("importance_sampling_level", "sequence"),  # sequence ratios come from algorithm="gspo"
    ],
)
def test_validation_error_names_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"DHPOConfig\.{field}="):
        make_config(tmp_path, **{field: value})


def test_token_aggregations_stay_selectable(tmp_path):
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert make_config(tmp_path, loss_type=loss_type).loss_type == loss_type


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ("GRPO", dict(algorithm="grpo", loss_type="grpo", importance_sampling_level="token", epsilon=0.2,
                      epsilon_high=0.2)),
        ("GSPO", dict(algorithm="gspo", loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4,
                      epsilon_high=4e-4)),
        ("GMPO", dict(algorithm="gmpo", loss_type="grpo", importance_sampling_level="token", gmpo_epsilon_low=0.4,
                      gmpo_epsilon_high=0.4)),
        ("CISPO", dict(algorithm="cispo", loss_type="cispo", importance_sampling_level="token", epsilon_high=1.2)),
        ("DHPO-A", dict(algorithm="dhpo", mixing="averaged", token_weight=0.5, clipping="branch", loss_type="grpo",
                        importance_sampling_level="token", epsilon_low_token=0.2, epsilon_high_token=0.28,
                        epsilon_low_seq=0.2, epsilon_high_seq=0.28)),
        ("DHPO-E", dict(algorithm="dhpo", mixing="entropy", clipping="branch", loss_type="grpo",
                        importance_sampling_level="token", epsilon_low_token=0.2, epsilon_high_token=0.28,
                        epsilon_low_seq=0.2, epsilon_high_seq=0.28)),
        ("DHPO-E-unified", dict(algorithm="dhpo", mixing="entropy", clipping="unified", loss_type="grpo",
                                importance_sampling_level="token", epsilon_low_token=0.2, epsilon_high_token=0.28)),
    ],
)  # fmt: skip
def test_presets_produce_the_paper_rows(tmp_path, row, expected):
    config = config_for(row, output_dir=str(tmp_path), **CPU)
    assert isinstance(config, DHPOConfig)
    actual = {name: getattr(config, name) for name in expected}
    assert actual == pytest.approx(expected)
    assert config.beta == 0.0


def test_presets_cover_seven_rows_and_accept_overrides(tmp_path):
    assert list(PAPER_ALGORITHMS) == ["GRPO", "GSPO", "GMPO", "CISPO", "DHPO-A", "DHPO-E", "DHPO-E-unified"]
    config = config_for("DHPO-A", output_dir=str(tmp_path), token_weight=0.8, **CPU)
    assert (config.mixing, config.token_weight) == ("averaged", 0.8)
    with pytest.raises(ValueError, match="DAPO"):
        config_for("DAPO", output_dir=str(tmp_path), **CPU)


def test_delta_rejected_for_dhpo_and_gmpo():
    from dhpo_trl import DHPOConfig

    for algorithm in ("dhpo", "gmpo"):
        with pytest.raises(ValueError, match="DHPOConfig.delta"):
            DHPOConfig(output_dir="unused", algorithm=algorithm, delta=2.0, use_cpu=True, bf16=False, report_to="none")
    assert DHPOConfig(output_dir="unused", algorithm="grpo", delta=2.0, use_cpu=True, bf16=False).delta == 2.0
