"""Trainer paths that the training runs reach only in rare setups, checked on fixed inputs in one process:
the entropy bonus (static and adaptive), the cross-process reductions (with a fake second process), the backward
of a token-budget pass under DeepSpeed / DDP (with a fake accelerator), the batching warning, and the model card
copied into every checkpoint. Expected values are written out by hand.
"""

import math
import os
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist
from accelerate.utils import DistributedType
from datasets import Dataset

from dhpo_trl import DHPOConfig, DHPOTrainer, batching
from dhpo_trl import trainer as trainer_module
from dhpo_trl.tiny import build_char_tokenizer, build_tiny_qwen3

# Two rows of three completion columns; padding entropies are huge, so any leak into a mean shows.
ENTROPIES = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # valid entropies 1, 2, 4: sum 7 over 3 tokens


def metrics():
    return defaultdict(lambda: defaultdict(list))


class FakeAccelerator:
    """The parts of accelerate.Accelerator the entropy bonus touches, in one process."""

    def __init__(self, sync_gradients=True):
        self.sync_gradients = sync_gradients

    def gather(self, tensor):
        return tensor.reshape(-1)

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        return tensor


def bonus_host(adaptive=False, coef=0.1, accumulation=2, last_world_entropy=math.inf, **args):
    settings = dict(entropy_target=2.5, entropy_coef_delta=0.05, entropy_coef_max=0.2, entropy_coef_min=0.0)
    return SimpleNamespace(
        current_gradient_accumulation_steps=accumulation, use_adaptive_entropy=adaptive, entropy_coef=coef,
        _last_world_entropy=last_world_entropy, _entropy_window_stats=None, _metrics=metrics(),
        accelerator=FakeAccelerator(), args=SimpleNamespace(**{**settings, **args}),
    )  # fmt: skip


def add_bonus(host, mode="train", entropy_mask=None, inputs=None, loss=1.0, policy_loss=(0.5, float("nan"), 1.5)):
    out = DHPOTrainer._add_entropy_bonus(
        host, torch.tensor(loss), ENTROPIES, MASK, entropy_mask, torch.tensor(policy_loss), mode, inputs or {}
    )
    return out.item()


# ------------------------------------------------------------------ entropy bonus
def test_static_bonus_is_the_masked_mean_entropy_divided_by_accumulation_in_train():
    host = bonus_host(coef=0.1, accumulation=2)
    assert add_bonus(host) == pytest.approx(1.0 - 0.1 * (7 / 3) / 2)
    assert host._metrics["train"]["policy_loss"] == [pytest.approx(1.0)]  # nan-mean of (0.5, nan, 1.5)
    assert host._metrics["train"]["entropy_coef"] == [0.1]  # logged at the optimizer step


def test_static_bonus_in_eval_is_not_divided_and_logs_no_coefficient():
    host = bonus_host(coef=0.1, accumulation=2)
    assert add_bonus(host, mode="eval") == pytest.approx(1.0 - 0.1 * 7 / 3)
    assert "entropy_coef" not in host._metrics["eval"]
    assert host._metrics["eval"]["policy_loss"] == [pytest.approx(1.0)]


def test_entropy_mask_restricts_the_bonus_to_its_tokens():
    entropy_mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # with MASK: entropies 1 and 4
    host = bonus_host(coef=0.2, accumulation=1)
    assert add_bonus(host, entropy_mask=entropy_mask) == pytest.approx(1.0 - 0.2 * 2.5)


def test_dynamic_batching_divides_by_the_window_token_count_not_the_micro_batch():
    host = bonus_host(coef=0.1, accumulation=4)  # the window count replaces both the mean and the accumulation
    inputs = {batching.WINDOW_TOKENS: torch.tensor(10.0)}
    assert add_bonus(host, inputs=inputs) == pytest.approx(1.0 - 0.1 * 7 / 10)
    inputs = {batching.WINDOW_TOKENS: torch.tensor(0.0)}  # an empty window divides by 1, not 0
    assert add_bonus(bonus_host(coef=0.1), inputs=inputs) == pytest.approx(1.0 - 0.1 * 7)


def test_a_micro_batch_with_one_valid_token_takes_its_entropy():
    one = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # only the entropy 2.0
    host = bonus_host(adaptive=True, coef=0.1, accumulation=1, last_world_entropy=0.0)
    out = DHPOTrainer._add_entropy_bonus(host, torch.tensor(1.0), ENTROPIES, one, None, torch.tensor([0.0]), "train", {})
    assert out.item() == pytest.approx(1.0 - 0.1 * 2.0)
    assert host._last_world_entropy == 2.0  # the window's world entropy is that one token's too


def test_a_micro_batch_without_valid_tokens_adds_no_bonus():
    host = bonus_host(coef=0.1, accumulation=1)
    out = DHPOTrainer._add_entropy_bonus(
        host, torch.tensor(1.0), ENTROPIES, torch.zeros_like(MASK), None, torch.tensor([0.0]), "train", {}
    )
    assert out.item() == 1.0


def test_adaptive_coefficient_applies_only_below_the_target_and_moves_once_per_optimizer_step():
    # First window: no world entropy yet (inf > target), so no bonus; its entropy 7/3 <= 2.5 raises the coefficient.
    host = bonus_host(adaptive=True, coef=0.1, accumulation=1)
    host.accelerator.sync_gradients = False  # first micro-batch of a window of two: accumulate only
    assert add_bonus(host) == 1.0
    assert host.entropy_coef == 0.1 and host._last_world_entropy == math.inf
    assert host._entropy_window_stats.tolist() == [7.0, 3.0]
    assert "entropy_coef" not in host._metrics["train"]
    host.accelerator.sync_gradients = True  # the step's last micro-batch (entropies 1 and 4): 12 over 5 tokens
    assert add_bonus(host, entropy_mask=torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])) == 1.0
    assert host._last_world_entropy == pytest.approx(12 / 5)  # the whole window, not its last micro-batch (2.5)
    assert host.entropy_coef == pytest.approx(0.15) and host._entropy_window_stats is None
    assert host._metrics["train"]["entropy_coef"] == [pytest.approx(0.15)]
    # Next step: the world entropy is below the target, so the raised coefficient applies.
    assert add_bonus(host) == pytest.approx(1.0 - 0.15 * 7 / 3)
    assert host.entropy_coef == pytest.approx(0.2)  # 0.15 + 0.05, at the cap
    add_bonus(host)
    assert host.entropy_coef == pytest.approx(0.2)  # capped at entropy_coef_max


def test_adaptive_coefficient_falls_above_the_target_and_stops_at_the_floor():
    host = bonus_host(adaptive=True, coef=0.08, accumulation=1, entropy_target=2.0, entropy_coef_min=0.01)
    assert add_bonus(host) == 1.0  # world entropy still unknown
    assert host._last_world_entropy == pytest.approx(7 / 3)  # above 2.0: lower the coefficient
    assert host.entropy_coef == pytest.approx(0.03)
    assert add_bonus(host) == 1.0  # above the target: no bonus at all
    assert host.entropy_coef == pytest.approx(0.01)  # 0.03 - 0.05, floored at entropy_coef_min


def test_adaptive_coefficient_at_exactly_the_target_counts_as_below():
    entropy_mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # with MASK: entropies 1 and 4, mean 2.5
    host = bonus_host(adaptive=True, coef=0.1, accumulation=1, last_world_entropy=2.5, entropy_target=2.5)
    assert add_bonus(host, entropy_mask=entropy_mask) == pytest.approx(1.0 - 0.1 * 2.5)  # applied at the target
    assert host._last_world_entropy == 2.5
    assert host.entropy_coef == pytest.approx(0.15)  # and raised: a world entropy at the target is not above it


def test_adaptive_coefficient_does_not_move_in_eval():
    host = bonus_host(adaptive=True, coef=0.1, accumulation=1, last_world_entropy=1.0)
    assert add_bonus(host, mode="eval") == pytest.approx(1.0 - 0.1 * 7 / 3)
    assert host.entropy_coef == 0.1 and host._entropy_window_stats is None and host._last_world_entropy == 1.0


# ------------------------------------------------------------------ cross-process reductions
class OtherProcess:
    """torch.distributed with one other process holding `other`: all_reduce(MAX) takes the element-wise max."""

    ReduceOp = torch_dist.ReduceOp

    def __init__(self, other, initialized=True):
        self.other, self.initialized, self.calls = other, initialized, 0

    def is_available(self):
        return True

    def is_initialized(self):
        return self.initialized

    def all_reduce(self, tensor, op):
        assert op == torch_dist.ReduceOp.MAX, op
        self.calls += 1
        tensor.copy_(torch.maximum(tensor, torch.as_tensor(self.other, dtype=tensor.dtype)))


def process_host(num_processes):
    return SimpleNamespace(accelerator=SimpleNamespace(num_processes=num_processes, device=torch.device("cpu")))


def test_pass_counts_are_the_maximum_over_processes(monkeypatch):
    fake = OtherProcess([3, 1, 5])
    monkeypatch.setattr(trainer_module, "dist", fake)
    assert DHPOTrainer._max_over_processes(process_host(2), [2, 2, 5]) == [3, 2, 5]
    assert fake.calls == 1
    assert DHPOTrainer._max_over_processes(process_host(1), [2, 2, 5]) == [2, 2, 5]  # alone: no collective
    assert fake.calls == 1


def test_global_entropy_range_spans_every_process(monkeypatch):
    # This process: valid entropies 1, 2, 4. The other: 0.5 .. 3 (sent as (-min, max)).
    fake = OtherProcess([-0.5, 3.0])
    monkeypatch.setattr(trainer_module, "dist", fake)
    low, high = DHPOTrainer._global_entropy_range(process_host(2), ENTROPIES, MASK)
    assert (float(low), float(high)) == (0.5, 4.0) and fake.calls == 1


def test_an_all_padding_process_does_not_drag_the_global_range(monkeypatch):
    fake = OtherProcess([-0.5, 3.0])
    monkeypatch.setattr(trainer_module, "dist", fake)
    low, high = DHPOTrainer._global_entropy_range(process_host(2), ENTROPIES, torch.zeros_like(MASK))
    assert (float(low), float(high)) == (0.5, 3.0)


def test_global_entropy_range_of_one_process_is_its_own_and_never_reduces(monkeypatch):
    fake = OtherProcess([-0.0, 50.0])
    monkeypatch.setattr(trainer_module, "dist", fake)
    low, high = DHPOTrainer._global_entropy_range(process_host(1), ENTROPIES, MASK)
    assert (float(low), float(high)) == (1.0, 4.0) and fake.calls == 0
    # accelerate reports two processes but torch.distributed is not set up (no collective is possible)
    monkeypatch.setattr(trainer_module, "dist", OtherProcess([-0.0, 50.0], initialized=False))
    low, high = DHPOTrainer._global_entropy_range(process_host(2), ENTROPIES, MASK)
    assert (float(low), float(high)) == (1.0, 4.0)


def test_global_entropy_range_without_any_valid_token_is_finite():
    low, high = DHPOTrainer._global_entropy_range(process_host(1), ENTROPIES, torch.zeros_like(MASK))
    assert math.isfinite(low) and math.isfinite(high)


# ------------------------------------------------------------------ backward of a token-budget pass
class RecordingAccelerator:
    def __init__(self, distributed_type, fail=False):
        self.distributed_type, self.sync_gradients, self.fail = distributed_type, True, fail
        self.seen = []

    def no_sync(self, model):
        accelerator = self

        class Context:
            def __enter__(self):
                accelerator.seen.append(("no_sync", model))

            def __exit__(self, *exc):
                accelerator.seen.append(("synced", model))
                return False

        return Context()

    def backward(self, loss, **kwargs):
        self.seen.append(("backward", loss, kwargs, self.sync_gradients))
        if self.fail:
            raise RuntimeError("out of memory")


@pytest.mark.parametrize(
    "distributed_type, kwargs",
    [(DistributedType.DEEPSPEED, {"scale_wrt_gas": False}), (DistributedType.MULTI_GPU, {}), (DistributedType.NO, {})],
)
def test_a_budget_pass_backpropagates_without_sync_or_step(distributed_type, kwargs):
    """DeepSpeed: no gradient-accumulation rescaling (the loss is already normalised) and no engine step (not the
    accumulation boundary); DDP: no all-reduce until the step's last pass; then the accelerator is as it was."""
    accelerator = RecordingAccelerator(distributed_type)
    model, loss = object(), torch.tensor(2.0)
    DHPOTrainer._backward_without_sync(SimpleNamespace(accelerator=accelerator), model, loss)
    assert accelerator.seen == [("no_sync", model), ("backward", loss, kwargs, False), ("synced", model)]
    assert accelerator.sync_gradients is True


def test_a_failed_budget_pass_restores_gradient_sync():
    accelerator = RecordingAccelerator(DistributedType.DEEPSPEED, fail=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        DHPOTrainer._backward_without_sync(SimpleNamespace(accelerator=accelerator), object(), torch.tensor(1.0))
    assert accelerator.sync_gradients is True


def test_a_micro_step_of_several_passes_backpropagates_each_and_reports_their_sum(card_trainer, monkeypatch):
    """Passes before the last go through `_backward_without_sync`; the Trainer backpropagates the last one, and the
    loss it logs is the sum over the passes (each pass is already normalised by the window)."""
    seen, backward = [], []

    def parent_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seen.append((model, inputs["name"], return_outputs, num_items_in_batch))
        return torch.tensor(inputs["loss"], requires_grad=True)

    monkeypatch.setattr(trainer_module.GRPOTrainer, "compute_loss", parent_compute_loss)
    monkeypatch.setattr(card_trainer, "_backward_without_sync", lambda model, loss: backward.append((model, loss.item())))
    model = object()
    passes = batching.Passes([{"name": "a", "loss": 0.5}, {"name": "b", "loss": 0.25}, {"name": "c", "loss": 2.0}])
    total = card_trainer.compute_loss(model, passes, False, 7)
    assert total.item() == pytest.approx(2.75) and total.requires_grad
    assert seen == [(model, "a", False, 7), (model, "b", False, 7), (model, "c", False, 7)]
    assert backward == [(model, 0.5), (model, 0.25)]
    # one pass (a plain dict): TRL's compute_loss, untouched
    seen.clear()
    assert card_trainer.compute_loss(model, {"name": "d", "loss": 1.5}, False, 3).item() == 1.5
    assert seen == [(model, "d", False, 3)] and len(backward) == 2


# ------------------------------------------------------------------ batching warning
def micro_batch(rows=2, extra=None):
    batch = {
        "prompt_ids": torch.ones(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_ids": torch.ones(rows, 3, dtype=torch.long),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]] * (rows // 2)),
        "advantages": torch.zeros(rows),
    }  # fmt: skip
    return {**batch, **(extra or {})}


def planning_host(dynamic_batching=True, steps=1, pad_to_multiple_of=None):
    logged = []
    host = SimpleNamespace(
        args=SimpleNamespace(dynamic_batching=dynamic_batching, gradient_accumulation_steps=steps,
                             max_tokens_per_micro_batch=None),
        pad_to_multiple_of=pad_to_multiple_of, _batching_warned=False, _padding_free=False, _log_padding=logged.append,
    )  # fmt: skip
    return host, logged


def plan(host, buffered):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = DHPOTrainer._plan_micro_batches(host, buffered)
    return planned, [str(w.message) for w in caught]


def test_dynamic_batching_off_keeps_trl_batches_without_a_warning():
    host, logged = planning_host(dynamic_batching=False)
    buffered = [micro_batch(), micro_batch()]
    planned, messages = plan(host, buffered)
    assert planned is buffered and messages == [] and logged == [buffered]


def test_an_unsupported_batch_warns_once_and_keeps_trl_batches():
    host, logged = planning_host()
    buffered = [micro_batch(extra={"pixel_values": torch.zeros(2, 1)})]
    planned, messages = plan(host, buffered)
    assert planned is buffered and logged == [buffered]
    assert messages == ["dynamic_batching keeps TRL's micro-batches for this run: the batch holds multimodal input "
                        "`pixel_values`."]  # fmt: skip
    planned, messages = plan(host, buffered)  # the next generation batch: no second warning
    assert planned is buffered and messages == []


def test_a_single_micro_batch_window_is_planned():
    """One micro-batch per generation batch (no accumulation): it is re-cut to its own widths."""
    host, logged = planning_host(steps=1)
    planned, messages = plan(host, [micro_batch()])
    assert messages == [] and len(planned) == 1
    assert planned[0]["completion_ids"].shape == (2, 3)  # the long row needs all three columns
    assert len(logged) == 1 and len(logged[0]) == 1


@pytest.mark.parametrize("multiple, width", [(None, 3), (2, 4), (8, 5)])
def test_planned_widths_honour_pad_to_multiple_of(multiple, width):
    """The longest completion needs 3 of the 5 columns: rounded up to the multiple, never past the batch width."""
    batch = micro_batch()
    batch["completion_ids"] = torch.ones(2, 5, dtype=torch.long)
    batch["completion_mask"] = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    host, _ = planning_host(pad_to_multiple_of=multiple)
    planned, _ = plan(host, [batch])
    assert planned[0]["completion_ids"].shape == (2, width)


class GatheringAccelerator:
    """accelerate's gather with another process holding `other` rows."""

    device = torch.device("cpu")

    def __init__(self, other):
        self.other = other

    def gather(self, tensor):
        return torch.cat([tensor, torch.tensor(self.other, dtype=tensor.dtype)])


def test_padding_fraction_counts_every_process_tokens():
    # Here: prompts 2 x 2 all real, completions 3 + 1 real of 2 x 3: 8 real of 10 forwarded tokens.
    # The other process: 5 real of 10. Logged: 1 - 13 / 20.
    host = SimpleNamespace(accelerator=GatheringAccelerator([[5, 10]]), _metrics=metrics())
    DHPOTrainer._log_padding(host, [micro_batch()])
    assert host._metrics["train"]["batching/padding_fraction"] == [pytest.approx(0.35)]
    host = SimpleNamespace(accelerator=GatheringAccelerator([[0, 0]]), _metrics=metrics())
    DHPOTrainer._log_padding(host, [micro_batch(), micro_batch()])
    assert host._metrics["train"]["batching/padding_fraction"] == [pytest.approx(0.2)]


# ------------------------------------------------------------------ model card
@pytest.fixture(scope="module")
def card_trainer(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    output_dir = tmp_path_factory.mktemp("card")
    args = DHPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=2, num_generations=2, max_completion_length=4, steps_per_generation=2,
        algorithm="gmpo", learning_rate=3e-6,
    )  # fmt: skip
    return DHPOTrainer(
        build_tiny_qwen3(tokenizer, hidden_size=32), lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 2}), processing_class=tokenizer,
    )  # fmt: skip


def test_model_card_records_the_objective_and_its_settings(card_trainer):
    card_trainer.create_model_card(model_name="my-run", dataset_name="my-data", tags=["my-tag"])
    card = open(os.path.join(card_trainer.args.output_dir, "README.md"), encoding="utf-8").read()
    assert "model_name: my-run" in card and "datasets: my-data" in card  # TRL's card gets the caller's arguments
    assert "- my-tag\n" in card and "- trl\n" in card and "- dhpo\n" in card and "- gmpo\n" in card
    section = card[card.index("\n\n## DHPO settings\n\nTrained with `dhpo_trl.DHPOTrainer`") :]
    assert "objective `algorithm=gmpo`" in section
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows[:3] == ["| `algorithm` | `gmpo` |", "| `gmpo_epsilon_low` | `0.4` |", "| `gmpo_epsilon_high` | `0.4` |"]
    assert "| `learning_rate` | `3e-06` |" in rows and "| `steps_per_generation` | `2` |" in rows
    assert "| `max_completion_length` | `4` |" in rows
    assert not any("epsilon_low_token" in row for row in rows)  # DHPO's settings are not GMPO's
    assert card.count("## DHPO settings") == 1


def test_every_checkpoint_carries_the_model_card(card_trainer, monkeypatch):
    output_dir = card_trainer.args.output_dir
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
        handle.write("the card\n")
    checkpoint = os.path.join(output_dir, "checkpoint-7")
    os.makedirs(checkpoint, exist_ok=True)
    saved = []
    monkeypatch.setattr(trainer_module.GRPOTrainer, "_save_checkpoint", lambda self, model, trial: saved.append((model, trial)))
    monkeypatch.setattr(card_trainer.state, "global_step", 7)
    card_trainer._save_checkpoint(card_trainer.model, trial=None)
    assert saved == [(card_trainer.model, None)]
    assert open(os.path.join(checkpoint, "README.md"), encoding="utf-8").read() == "the card\n"
    # a hyperparameter-search trial saves under its own run folder: the card goes to that checkpoint
    trial_checkpoint = os.path.join(output_dir, "run-t1", "checkpoint-7")
    os.makedirs(trial_checkpoint)
    monkeypatch.setattr(card_trainer, "_get_output_dir", lambda trial: os.path.join(output_dir, f"run-{trial}"))
    card_trainer._save_checkpoint(card_trainer.model, trial="t1")
    assert saved[-1] == (card_trainer.model, "t1")
    assert open(os.path.join(trial_checkpoint, "README.md"), encoding="utf-8").read() == "the card\n"
    os.remove(os.path.join(checkpoint, "README.md"))
    monkeypatch.setattr(type(card_trainer.args), "should_save", property(lambda self: False))
    card_trainer._save_checkpoint(card_trainer.model, trial=None)  # not the saving process: nothing copied
    assert not os.path.exists(os.path.join(checkpoint, "README.md"))


def test_evaluation_runs_through_the_trainer(card_trainer):
    """Eval batches take TRL's path (no re-planning) and log under `eval_`."""
    card_trainer.eval_dataset = Dataset.from_dict({"prompt": ["2+2=", "3+1="]})
    card_trainer.args.per_device_eval_batch_size = 2
    results = card_trainer.evaluate()
    # equal rewards: zero advantages and loss; eval is on-policy, so every ratio is 1 and nothing clips
    assert results["eval_loss"] == 0.0 and results["eval_reward"] == 0.0
    assert results["eval_gmpo/token_ratio/mean"] == 1.0 and results["eval_gmpo/clip_fraction"] == 0.0
    assert results["eval_entropy"] > 0.0 and 0 < results["eval_completions/mean_length"] <= 4


def test_dhpo_model_card_lists_only_the_settings_its_clipping_reads(tmp_path):
    tokenizer = build_char_tokenizer()
    args = DHPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=2, num_generations=2, max_completion_length=4, steps_per_generation=2,
        clipping="unified", mixing="averaged", token_weight=0.3,
    )  # fmt: skip
    trainer = DHPOTrainer(
        build_tiny_qwen3(tokenizer, hidden_size=32), lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 2}), processing_class=tokenizer,
    )  # fmt: skip
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "| `clipping` | `unified` |" in card and "| `token_weight` | `0.3` |" in card
    assert "| `epsilon_low_token` | `0.2` |" in card
    assert "epsilon_low_seq" not in card  # unified clipping has no sequence branch


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def cpu_args(output_dir, **kwargs):
    """An off-policy config this CPU machine accepts (no bf16, no reporting)."""
    return DHPOConfig(str(output_dir), use_cpu=True, bf16=False, report_to="none", steps_per_generation=2, **kwargs)


@pytest.mark.parametrize(
    ("name", "run"),
    [("org/tiny-model", "tiny-model"), ("org/tiny-model/", "tiny-model"), ("tiny-model", "tiny-model"),
     ("/models/tiny-X/", "tiny-X")],
)  # fmt: skip
def test_without_args_the_run_is_named_after_the_model(name, run, tmp_path, monkeypatch):
    """As TRL names a GRPO run `<model>-GRPO`: the last part of the model's name or path, then `-DHPO`."""

    class CpuConfig(DHPOConfig):  # the default config asks for bf16, which this CPU machine refuses
        def __init__(self, output_dir, **kwargs):
            super().__init__(output_dir, use_cpu=True, bf16=False, report_to="none", **kwargs)

    monkeypatch.setattr(trainer_module, "DHPOConfig", CpuConfig)
    monkeypatch.chdir(tmp_path)
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    model.config._name_or_path = name
    trainer = DHPOTrainer(model, zero_reward, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}))  # fmt: skip
    assert isinstance(trainer.args, CpuConfig) and trainer.args.output_dir == f"{run}-DHPO"


def test_a_grpo_config_is_refused_with_the_conversion(tmp_path):
    from trl import GRPOConfig

    tokenizer = build_char_tokenizer()
    with pytest.raises(TypeError) as error:
        DHPOTrainer(build_tiny_qwen3(tokenizer), zero_reward,
                    args=GRPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none"),
                    processing_class=tokenizer)  # fmt: skip
    assert str(error.value) == (
        "DHPOTrainer needs `args` to be a DHPOConfig, got GRPOConfig. Build one with "
        "DHPOConfig(**your_grpo_config.to_dict()) or use trl.GRPOTrainer."
    )


@pytest.mark.parametrize(("process_index", "probed"), [(0, ["tiny-vllm-model"]), (1, [])])
def test_only_the_first_process_waits_for_the_vllm_server(process_index, probed, tmp_path, monkeypatch):
    """In TRL only the main process talks to a vLLM server; the others (maybe on nodes that cannot reach its host)
    must not probe it. A second process is faked through the config's `process_index`."""
    from dhpo_trl import vllm_utils

    class Stop(Exception):
        pass

    waited = []
    monkeypatch.setattr(DHPOConfig, "process_index", property(lambda self: process_index))
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda: True)
    monkeypatch.setattr(vllm_utils, "wait_for_vllm_server", lambda args, name: waited.append(name))
    def stop(reward_funcs):  # the step right after the check
        raise Stop

    monkeypatch.setattr(trainer_module, "check_reward_functions", stop)
    args = cpu_args(tmp_path, use_vllm=True, vllm_mode="server")
    tokenizer = build_char_tokenizer()
    with pytest.raises(Stop):  # stopped right after the check: TRL would import vllm next
        DHPOTrainer("tiny-vllm-model", zero_reward, args=args, processing_class=tokenizer)
    assert waited == probed


def test_positional_arguments_reach_trl_in_its_order(tmp_path):
    """GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, ...): a caller may pass
    them by position, as to TRL."""
    tokenizer = build_char_tokenizer()
    train, evaluation = Dataset.from_dict({"prompt": ["1+1="] * 8}), Dataset.from_dict({"prompt": ["2+2="] * 8})
    trainer = DHPOTrainer(build_tiny_qwen3(tokenizer), zero_reward, cpu_args(tmp_path), train, evaluation, tokenizer)
    assert trainer.train_dataset is train and trainer.eval_dataset is evaluation
    assert trainer.processing_class is tokenizer


def test_a_new_trainer_warns_on_its_first_unsupported_batch(tmp_path):
    tokenizer = build_char_tokenizer()
    trainer = DHPOTrainer(build_tiny_qwen3(tokenizer), zero_reward, cpu_args(tmp_path),
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}), processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    buffered = [micro_batch(extra={"pixel_values": torch.zeros(2, 1)})]
    assert plan(trainer, buffered) == (buffered, [
        "dynamic_batching keeps TRL's micro-batches for this run: the batch holds multimodal input `pixel_values`."
    ])  # fmt: skip
    assert plan(trainer, buffered) == (buffered, [])
