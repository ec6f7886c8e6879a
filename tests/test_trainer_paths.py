"""Trainer paths that the training runs reach only in rare setups, checked on fixed inputs in one process: the
passes of a token-budget micro-step under DeepSpeed / DDP (with a fake accelerator), planning and its warning, and
the model card copied into every checkpoint. Expected values are written out by hand. The entropy bonus and the
cross-process reductions are pure functions, tested in test_aggregation.py and test_metric_functions.py.
"""

import contextlib
import os
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from datasets import Dataset

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.core import metrics
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching, shared_prompts, update_path
from dhpo_trl.training import trainer as trainer_module


def metrics_store():
    return defaultdict(lambda: defaultdict(list))


# ------------------------------------------------------------------ the passes of a token-budget micro-step
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
        self.seen.append(("backward", loss.item(), kwargs, self.sync_gradients))
        if self.fail:
            raise RuntimeError("out of memory")


@pytest.fixture
def recorded_forwards(monkeypatch):
    """TRL's compute_loss replaced by one that records the accelerator's `sync_gradients` during the forward."""
    seen = []

    def parent_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seen.append(("forward", inputs["name"], self.accelerator.sync_gradients))
        if hasattr(self.accelerator, "seen"):
            self.accelerator.seen.append(("forward", inputs["name"], self.accelerator.sync_gradients))
        return torch.tensor(inputs["loss"], requires_grad=True)

    monkeypatch.setattr(trainer_module.GRPOTrainer, "compute_loss", parent_compute_loss)
    return seen


@pytest.mark.parametrize(
    "distributed_type, kwargs",
    [(DistributedType.DEEPSPEED, {"scale_wrt_gas": False}), (DistributedType.MULTI_GPU, {}), (DistributedType.NO, {})],
)
def test_a_pass_before_the_boundary_runs_forward_and_backward_without_sync_or_step(
    distributed_type, kwargs, recorded_forwards, card_trainer, monkeypatch
):
    """The forward too runs with `sync_gradients` False (once-per-step work waits for the last pass) and inside
    `no_sync` (DDP decides in the forward whether the backward all-reduces); DeepSpeed: no accumulation rescaling
    (the loss is already normalised) and no engine step; then the accelerator is as it was."""
    accelerator = RecordingAccelerator(distributed_type)
    monkeypatch.setattr(card_trainer, "accelerator", accelerator)
    model = object()
    card_trainer._pass_before_the_boundary(model, {"name": "a", "loss": 2.0}, False, None)
    assert accelerator.seen == [
        ("no_sync", model), ("forward", "a", False), ("backward", 2.0, kwargs, False), ("synced", model)
    ]  # fmt: skip
    assert accelerator.sync_gradients is True


def test_a_failed_budget_pass_restores_gradient_sync(recorded_forwards, card_trainer, monkeypatch):
    accelerator = RecordingAccelerator(DistributedType.DEEPSPEED, fail=True)
    monkeypatch.setattr(card_trainer, "accelerator", accelerator)
    with pytest.raises(RuntimeError, match="out of memory"):
        card_trainer._pass_before_the_boundary(object(), {"name": "a", "loss": 1.0}, False, None)
    assert accelerator.sync_gradients is True


def test_a_micro_step_of_several_passes_backpropagates_each_and_reports_their_sum(card_trainer, recorded_forwards,
                                                                                 monkeypatch):  # fmt: skip
    """Passes before the last run forward and backward with `sync_gradients` off; the Trainer backpropagates the
    last one, whose forward sees the step boundary, and the loss it logs is the sum over the passes."""
    backward = []
    monkeypatch.setattr(card_trainer.accelerator, "backward", lambda loss, **kw: backward.append(loss.item()))
    model = card_trainer.model
    passes = batching.Passes([{"name": "a", "loss": 0.5}, {"name": "b", "loss": 0.25}, {"name": "c", "loss": 2.0}])
    total = card_trainer.compute_loss(model, passes, False, 7)
    assert total.item() == pytest.approx(2.75) and total.requires_grad
    assert recorded_forwards == [("forward", "a", False), ("forward", "b", False), ("forward", "c", True)]
    assert backward == [0.5, 0.25]
    # one pass (a plain dict): TRL's compute_loss, untouched
    recorded_forwards.clear()
    assert card_trainer.compute_loss(model, {"name": "d", "loss": 1.5}, False, 3).item() == 1.5
    assert recorded_forwards == [("forward", "d", True)] and len(backward) == 2


# ------------------------------------------------------------------ planning and its warning
def micro_batch(rows=2, extra=None):
    batch = {
        "prompt_ids": torch.ones(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_ids": torch.ones(rows, 3, dtype=torch.long),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]] * (rows // 2)),
        "advantages": torch.zeros(rows),
    }  # fmt: skip
    return {**batch, **(extra or {})}


def planning_host(dynamic_batching=True, steps=1, pad_to_multiple_of=None):
    host = SimpleNamespace(
        args=SimpleNamespace(dynamic_batching=dynamic_batching, gradient_accumulation_steps=steps,
                             steps_per_generation=steps, max_tokens_per_micro_batch=None),
        pad_to_multiple_of=pad_to_multiple_of, _metrics=metrics_store(),
        _update=update_path.UpdatePath(batching.DYNAMIC if dynamic_batching else batching.PADDED),
        accelerator=SimpleNamespace(num_processes=1, autocast=contextlib.nullcontext),
        _reduce=lambda sums, maxima: metrics.reduce_across(sums, maxima, metrics.local_all_reduce),
        _max_over_processes=lambda values: values,
    )  # fmt: skip
    host._run = lambda: DHPOTrainer._run(host)
    return host


def plan(host, buffered):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = DHPOTrainer._plan_micro_batches(host, buffered)
    return planned, [str(w.message) for w in caught]


def test_dynamic_batching_off_keeps_trl_batches_without_a_warning():
    host = planning_host(dynamic_batching=False)
    buffered = [micro_batch(), micro_batch()]
    planned, messages = plan(host, buffered)
    assert planned is buffered and messages == []
    # padding of TRL's slices: 8 real of 10 tokens in each
    assert host._metrics["train"]["batching/padding_fraction"] == [pytest.approx(0.2)]


def test_an_unsupported_batch_warns_once_and_keeps_trl_batches():
    host = planning_host()
    buffered = [micro_batch(extra={"pixel_values": torch.zeros(2, 1)})]
    planned, messages = plan(host, buffered)
    assert planned is buffered
    assert len(messages) == 1 and "pixel_values" in messages[0]  # the input that keeps TRL's batching
    planned, messages = plan(host, buffered)  # the next generation batch: no second warning
    assert planned is buffered and messages == []


def test_an_unsupported_batch_under_share_prompts_logs_trl_padding_and_no_saved_prompt():
    """The shared path keeps TRL's micro-batches for a batch it cannot plan: the padding of those micro-batches,
    and no prompt token saved, logged as every planned batch logs them."""
    host = planning_host()
    host._update = update_path.UpdatePath(shared_prompts.SHARED)
    buffered = [micro_batch(extra={"pixel_values": torch.zeros(2, 1)})]
    planned, messages = plan(host, buffered)
    assert planned is buffered and len(messages) == 1 and "share_prompts" in messages[0]
    train = host._metrics["train"]
    assert train["batching/padding_fraction"] == [pytest.approx(0.2)]  # 8 real of 10 tokens
    assert train["batching/prompt_tokens_saved"] == [0.0]


def test_a_single_micro_batch_window_is_planned():
    """One micro-batch per generation batch (no accumulation): it is re-cut to its own widths."""
    planned = batching.plan_generation_batch([micro_batch()], micro_steps=1)
    assert len(planned) == 1
    assert planned[0]["completion_ids"].shape == (2, 3)  # the long row needs all three columns
    assert (planned[0][batching.WINDOW].sequences, planned[0][batching.WINDOW].tokens) == (2.0, 4.0)


@pytest.mark.parametrize("multiple, width", [(None, 3), (2, 4), (8, 5)])
def test_planned_widths_honour_pad_to_multiple_of(multiple, width):
    """The longest completion needs 3 of the 5 columns: rounded up to the multiple, never past the batch width."""
    batch = micro_batch()
    batch["completion_ids"] = torch.ones(2, 5, dtype=torch.long)
    batch["completion_mask"] = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    planned = batching.plan_generation_batch([batch], micro_steps=1, pad_to_multiple_of=multiple)
    assert planned[0]["completion_ids"].shape == (2, width)


def test_a_token_budget_takes_the_pass_count_agreed_over_processes():
    """This process alone needs one pass; another needs three: the agreement callable decides, once per plan."""
    asked = []

    def agree(values):
        asked.append(list(values))
        return [3 for _ in values]

    rows = [micro_batch(rows=4), micro_batch(rows=4)]
    planned = batching.plan_generation_batch(rows, micro_steps=2, budget=1000, max_over_processes=agree)
    assert asked == [[1]]  # one window, one agreement
    assert [len(step) if isinstance(step, list) else 1 for step in planned] == [2, 2]  # ceil(3 / 2) passes a step
    assert {part[batching.WINDOW].passes for part in batching.forward_passes(planned)} == {4.0}


# ------------------------------------------------------------------ model card
@pytest.fixture(scope="module")
def built_card_trainer(tmp_path_factory):
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


@pytest.fixture
def card_trainer(built_card_trainer):
    """The module's trainer with accelerate's shared state live: a config built by another test since (transformers'
    `TrainingArguments` resets that state as it sets up its devices) leaves the trainer's accelerator without one, as
    in mutmut's cheapest-first order. Accelerate's states share one dict per class, so an `Accelerator` built again
    (the trainer's settings: CPU, no mixed precision) refills the one the trainer reads."""
    from accelerate import Accelerator
    from accelerate.state import is_initialized

    if not is_initialized():
        Accelerator(cpu=True)
    return built_card_trainer


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
    monkeypatch.setattr(card_trainer, "create_model_card", lambda model_name=None: None)  # keep "the card"
    monkeypatch.setattr(card_trainer, "save_model", lambda output_dir, _internal_call: saved.append(output_dir))
    for piece in ("_save_optimizer_and_scheduler", "_save_scaler", "_save_rng_state"):
        monkeypatch.setattr(card_trainer, piece, lambda output_dir: None)
    monkeypatch.setattr(card_trainer.state, "global_step", 7)
    card_trainer._save_checkpoint(card_trainer.model, trial=None)
    assert saved == [checkpoint]
    assert open(os.path.join(checkpoint, "README.md"), encoding="utf-8").read() == "the card\n"
    # a hyperparameter-search trial saves under its own run folder: the card goes to that checkpoint
    trial_checkpoint = os.path.join(output_dir, "run-t1", "checkpoint-7")
    os.makedirs(trial_checkpoint)
    monkeypatch.setattr(card_trainer, "_get_output_dir", lambda trial: os.path.join(output_dir, f"run-{trial}"))
    card_trainer._save_checkpoint(card_trainer.model, trial="t1")
    assert saved[-1] == trial_checkpoint
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

    import dhpo_trl.core.config as config_module

    monkeypatch.setattr(config_module, "DHPOConfig", CpuConfig)  # the default config is built there
    monkeypatch.chdir(tmp_path)
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    model.config._name_or_path = name
    trainer = DHPOTrainer(model, zero_reward, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}))  # fmt: skip
    assert isinstance(trainer.args, CpuConfig) and trainer.args.output_dir == f"{run}-DHPO"


@pytest.mark.parametrize(("process_index", "probed"), [(0, ["tiny-vllm-model"]), (1, [])])
def test_only_the_first_process_waits_for_the_vllm_server(process_index, probed, tmp_path, monkeypatch):
    """In TRL only the main process talks to a vLLM server; the others (maybe on nodes that cannot reach its host)
    must not probe it. A second process is faked through the config's `process_index`."""
    from dhpo_trl.training import vllm_utils

    class Stop(Exception):
        pass

    waited = []
    monkeypatch.setattr(DHPOConfig, "process_index", property(lambda self: process_index))
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda: True)
    monkeypatch.setattr(vllm_utils, "wait_for_vllm_server", lambda args, name: waited.append(name))
    def stop(*args):  # the step right after the check
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
    trainer = DHPOTrainer(build_tiny_qwen3(tokenizer), zero_reward, cpu_args(tmp_path, padding_free=False),
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}), processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    buffered = [micro_batch(extra={"pixel_values": torch.zeros(2, 1)})]
    assert plan(trainer, buffered) == (buffered, [
        "dynamic_batching keeps TRL's micro-batches for this run: the batch holds multimodal input `pixel_values`."
    ])  # fmt: skip
    assert plan(trainer, buffered) == (buffered, [])


@pytest.mark.parametrize(("settings", "named"), [(dict(loss_type="bnpo"), "loss_type"),
                                                 (dict(gradient_accumulation_steps=2, steps_per_generation=3),
                                                  "steps_per_generation")])  # fmt: skip
def test_trl_settings_dynamic_batching_cannot_serve_get_trl_batching_said_once(tmp_path, capsys, settings, named):
    """The automatic default keeps TRL's micro-batches and forwards where dynamic batching cannot serve a TRL
    setting, printing one line that names it (an explicit request is refused: test_contracts.py)."""
    tokenizer = build_char_tokenizer()
    args = DHPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", **settings)
    trainer = DHPOTrainer(build_tiny_qwen3(tokenizer), zero_reward, args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}))  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if "dynamic_batching=None" in line]
    assert trainer._update.path is batching.PADDED and len(lines) == 1 and named in lines[0]
    buffered = [micro_batch(), micro_batch()]
    assert plan(trainer, buffered) == (buffered, [])  # TRL's micro-batches, unchanged, nothing warned
