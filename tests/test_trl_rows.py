"""TRL 1.16's own objectives as rows: `DHPOTrainer` with TRL's `loss_type` spelling (or a plain `GRPOConfig`) trains
exactly as `trl.GRPOTrainer` with that `loss_type`, off-policy, on every batching path: TRL's fixed slices, dynamic
batching and padding-free packing. Same completions (a deterministic rollout), same rewards; parameters compared.
"""

import pytest
import torch
from long_tail import OFF_POLICY_RUN, dataset, length_reward, long_tailed_rollout
from trl import GRPOConfig, GRPOTrainer

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1)
RUN = OFF_POLICY_RUN  # long_tail.py: steps 2 and 4 off-policy
# TRL's settings per case: its loss_type, the level and the objective's own knobs away from their defaults where
# that makes them bind on this data.
CASES = {
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=4.0),
    "sapo_sequence": dict(loss_type="sapo", importance_sampling_level="sequence"),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "luspo_token": dict(loss_type="luspo", epsilon=0.02, epsilon_high=0.03),
    "vespo": dict(loss_type="vespo", vespo_k_pos=3.0, vespo_lambda_neg=4.0),
    "cispo": dict(loss_type="cispo", epsilon_high=1.02),
}
PATHS = {
    "trl_batching": dict(dynamic_batching=False),
    "dynamic": dict(padding_free=False),
    "packed": dict(padding_free=True),
}
ROW_METRICS = {"sapo": (), "luspo": ("clip_ratio/region_mean",), "vespo": ("vespo/phi_seq_mean",),
               "cispo": ("cispo_clip_ratio",)}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def train(tok, trainer_cls, args):
    trainer = trainer_cls(
        model=build_tiny_qwen3(tok, seed=0), reward_funcs=length_reward, args=args, train_dataset=dataset(),
        processing_class=tok, rollout_func=long_tailed_rollout(tok, truncated_every=5),
    )  # fmt: skip
    start = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    change = torch.cat([(p.detach() - s).flatten() for p, s in zip(trainer.model.parameters(), start, strict=True)])
    return change, trainer


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.fixture(scope="module")
def trl_runs(tok, tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            args = GRPOConfig(str(tmp_path_factory.mktemp(f"trl-{case}")), **CASES[case], **RUN, **CPU)
            cache[case] = train(tok, GRPOTrainer, args)
        return cache[case]

    return get


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_trl_objective_rows_train_as_trls_grpo_trainer(tok, trl_runs, tmp_path, case, path):
    trl_change, trl = trl_runs(case)
    ours_change, ours = train(tok, DHPOTrainer, DHPOConfig(str(tmp_path), **CASES[case], **PATHS[path], **RUN, **CPU))
    row = CASES[case]["loss_type"]
    assert ours.args.algorithm == row
    assert trl_change.norm() > 1e-2  # trained
    assert max(logged(trl, "off_policy/abs_log_ratio") or [0.0]) == 0.0  # TRL does not log it; ours does
    assert max(logged(ours, "off_policy/abs_log_ratio")) > 1e-3  # off-policy steps for real
    assert (ours_change - trl_change).abs().max().item() <= 1e-5
    # the logged metrics are means of per-micro-batch values, which dynamic batching and packing regroup; the loss is
    # the window's sum on every path
    keys = ("loss", "entropy", *ROW_METRICS[row]) if path == "trl_batching" else ("loss",)
    for key in keys:
        ours_values, trl_values = logged(ours, key), logged(trl, key)
        assert len(ours_values) == len(trl_values) == RUN["max_steps"], key
        assert ours_values == pytest.approx(trl_values, abs=1e-5), key


@pytest.mark.parametrize("case", ["sapo", "luspo_sequence", "vespo", "cispo"])
def test_a_plain_grpo_config_runs_trls_objective(tok, trl_runs, tmp_path, capsys, case):
    """`DHPOTrainer(args=GRPOConfig(...))`: converted, one printed line naming the row and how to get DHPO."""
    trl_change, _ = trl_runs(case)
    ours_change, ours = train(tok, DHPOTrainer, GRPOConfig(str(tmp_path), **CASES[case], **RUN, **CPU))
    assert isinstance(ours.args, DHPOConfig) and ours.args.algorithm == CASES[case]["loss_type"]
    lines = [line for line in capsys.readouterr().out.splitlines() if "GRPOConfig" in line]
    assert len(lines) == 1 and f"algorithm={ours.args.algorithm!r}" in lines[0] and "algorithm='dhpo'" in lines[0]
    assert (ours_change - trl_change).abs().max().item() <= 1e-5
