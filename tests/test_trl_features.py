"""TRL 1.16 features a `GRPOTrainer` user turns on, with `DHPOTrainer` in its place: the same run with both trainers,
off-policy (two optimizer steps per generation batch), parameters and logged metrics compared; or, where one of our
settings cannot act with the feature, the early refusal that names it.
"""

import asyncio
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForSequenceClassification
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_chat_template
from trl.import_utils import is_liger_kernel_available
from vlm_stand_in import build_model, build_processor, char_tokenizer, image_dataset

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1)
# Two micro-batches per optimizer step, two optimizer steps per generation batch: step 2 is off-policy.
RUN = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
           max_steps=2, optim="sgd", learning_rate=0.5, max_grad_norm=0.0)  # fmt: skip


@pytest.fixture(autouse=True)
def quiet_trl(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def length_reward(completions, **kwargs):
    return [float(len(str(completion)) % 5) for completion in completions]


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(trainer):
    start = [p.detach().clone() for p in trainer.model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return torch.cat([(p.detach() - s).flatten() for p, s in zip(trainer.model.parameters(), start, strict=True)])


# ------------------------------------------------------------------ vision-language models
def vlm_trainer(trainer_cls, args):
    processor = build_processor()
    return trainer_cls(model=build_model(processor), reward_funcs=length_reward, args=args,
                       train_dataset=image_dataset(), processing_class=processor)  # fmt: skip


def test_a_vision_language_model_on_image_prompts_trains_as_trls(tmp_path):
    """A tiny Qwen2.5-VL on prompts with images of four shapes: the default path keeps TRL's micro-batches and TRL's
    forwards with the image inputs, so the off-policy update is TRL's."""
    run = dict(**RUN, max_completion_length=8, **CPU)
    trl = vlm_trainer(GRPOTrainer, GRPOConfig(str(tmp_path / "trl"), **run))
    trl_change = train(trl)  # built and trained before the other: the same random state when each samples
    ours = vlm_trainer(DHPOTrainer, GRPOConfig(str(tmp_path / "dhpo"), **run))
    ours_change = train(ours)
    assert trl_change.norm() > 1e-2
    assert logged(ours, "off_policy/abs_log_ratio")[1] > 1e-3  # the second step is off-policy
    assert (ours_change - trl_change).abs().max().item() <= 1e-5
    for key in ("loss", "entropy", "clip_ratio/region_mean", "reward"):
        assert logged(ours, key) == pytest.approx(logged(trl, key), abs=1e-5), key


@pytest.mark.parametrize("setting", [dict(dynamic_batching=True), dict(padding_free=True),
                                     dict(padding_free=True, share_prompts=True),
                                     dict(max_tokens_per_micro_batch=512)])  # fmt: skip
def test_planned_batching_asked_for_with_a_vision_language_processor_is_refused(tmp_path, setting):
    """Image batches keep TRL's micro-batches: an explicit request for planned ones is refused when the trainer is
    built, naming every setting asked for and the processor."""
    args = DHPOConfig(str(tmp_path), **setting, **RUN, **CPU)
    with pytest.raises(ValueError, match="ImageOnlyProcessor") as error:
        vlm_trainer(DHPOTrainer, args)
    for name, value in setting.items():
        assert f"{name}={value!r}" in str(error.value)


def test_the_refusal_comes_before_the_model_loads(tmp_path):
    """A model id that does not exist: the refusal, not the load error, when the processor is passed in."""
    args = DHPOConfig(str(tmp_path), padding_free=True, **RUN, **CPU)
    with pytest.raises(ValueError, match="padding_free=True"):
        DHPOTrainer(str(tmp_path / "no-such-model"), length_reward, args, image_dataset(2),
                    processing_class=build_processor())  # fmt: skip


def test_a_vision_language_model_on_text_only_prompts_packs_as_asked(tmp_path):
    """The same processor on a text-only dataset: TRL forwards no image input, so `padding_free=True` acts (packed
    rows, no fallback warning) and the off-policy update is TRL's."""
    texts = Dataset.from_dict({"prompt": [[{"role": "user", "content": "x" * (1 + i % 3)}] for i in range(8)]})
    run = dict(**RUN, max_completion_length=8, **CPU)
    changes = []
    for trainer_cls, args in ((GRPOTrainer, GRPOConfig(str(tmp_path / "trl"), **run)),
                              (DHPOTrainer, DHPOConfig(str(tmp_path / "dhpo"), algorithm="grpo", loss_type="dapo",
                                                       padding_free=True, **run))):  # fmt: skip
        processor = build_processor()
        trainer = trainer_cls(model=build_model(processor), reward_funcs=length_reward, args=args,
                              train_dataset=texts, processing_class=processor)  # fmt: skip
        changes.append(train(trainer))
    assert trainer._update.padding_free and not trainer._update.warned  # packed, every batch planned
    assert logged(trainer, "batching/padding_fraction") == [0.0]
    assert logged(trainer, "off_policy/abs_log_ratio")[1] > 1e-3
    assert (changes[1] - changes[0]).norm() <= 1e-5 * changes[0].norm()


# ------------------------------------------------------------------ multi-turn tool calling (`tools=`)
TOOL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<think>", "</think>"]  # fmt: skip


def qwen3_tokenizer():
    """Characters and Qwen3's special tokens, with Qwen3's chat template as TRL ships it (TRL then sets the response
    template that parses tool calls, and the training template that renders tool results)."""
    return char_tokenizer(TOOL_TOKENS, "<|endoftext|>", TOOL_TOKENS[1:], qwen3_chat_template)


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


def calling_the_tool_first(model, tokenizer):
    """The model's first turn is a tool call whose result differs in length by row; after the tool result it
    samples as it would (a random tiny model calls no tool by itself)."""
    sample = model.generate

    def generate(input_ids=None, attention_mask=None, **kwargs):
        if any("<tool_response>" in text for text in tokenizer.batch_decode(input_ids)):
            return sample(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        texts = [f'{{"name": "multiply", "arguments": {{"a": {3 + row}, "b": {7 ** (row % 4)}}}}}'
                 for row in range(input_ids.size(0))]  # fmt: skip
        calls = [tokenizer(f"<tool_call>\n{text}\n</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
                 for text in texts]  # fmt: skip
        width = max(map(len, calls))
        calls = [call + [tokenizer.pad_token_id] * (width - len(call)) for call in calls]
        return torch.cat([input_ids, torch.tensor(calls)], dim=1)

    model.generate = generate


def tool_trainer(trainer_cls, args):
    tokenizer = qwen3_tokenizer()
    model = build_tiny_qwen3(tokenizer, hidden_size=32, seed=0, max_position_embeddings=1024)  # the tools' prompt
    calling_the_tool_first(model, tokenizer)
    prompts = [[{"role": "user", "content": "x" * (1 + index % 3)}] for index in range(4)]
    return trainer_cls(model=model, reward_funcs=length_reward, args=args, processing_class=tokenizer,
                       train_dataset=Dataset.from_dict({"prompt": prompts}), tools=[multiply])  # fmt: skip


TOOL_RUN = dict(RUN, per_device_train_batch_size=2, num_generations=2, max_completion_length=110,
                max_tool_calling_iterations=1, **CPU)  # fmt: skip


@pytest.fixture(scope="module")
def trl_tool_run(tmp_path_factory):
    trainer = tool_trainer(GRPOTrainer, GRPOConfig(str(tmp_path_factory.mktemp("trl-tools")), **TOOL_RUN))
    return train(trainer), trainer


@pytest.mark.parametrize("path", [dict(dynamic_batching=False), dict(padding_free=False), dict(padding_free=True),
                                  dict(padding_free=True, max_tokens_per_micro_batch=160),
                                  dict(padding_free=True, share_prompts=True)],
                         ids=["Padded", "Dynamic", "Packed", "Packed_budget", "Shared"])  # fmt: skip
def test_tool_calling_trains_as_trls_on_every_path(tmp_path, trl_tool_run, path, request):
    """`tools=[...]`: TRL runs the tool and appends its result to the completion, masked out of the loss by its
    `tool_mask`. On every path the off-policy update is TRL's (the tool result tokens carry no gradient)."""
    trl_change, trl = trl_tool_run
    masked, passes = [], []
    ours = tool_trainer(DHPOTrainer, DHPOConfig(str(tmp_path), algorithm="grpo", loss_type="dapo", **path, **TOOL_RUN))
    compute_loss = ours.compute_loss

    def recording(model, inputs, *args, **kwargs):
        passes.append(len(inputs) if isinstance(inputs, list) else 1)
        for part in inputs if isinstance(inputs, list) else [inputs]:
            masked.append(int((part["completion_mask"] * (1 - part["tool_mask"])).sum()))
        return compute_loss(model, inputs, *args, **kwargs)

    ours.compute_loss = recording
    ours_change = train(ours)
    assert logged(trl, "tools/call_frequency")[0] == 1.0 and logged(ours, "tools/call_frequency")[0] == 1.0
    assert min(masked) > 0  # every micro-batch holds tool result tokens
    assert (max(passes) > 1) == ("max_tokens_per_micro_batch" in path)  # the budget splits micro-steps
    assert type(ours._update.path).__name__ == request.node.callspec.id.split("_")[0]  # the path asked for ran
    saved = logged(ours, "batching/prompt_tokens_saved")  # logged by the shared-prompt path only
    assert (bool(saved) and saved[0] > 0) == path.get("share_prompts", False)
    assert logged(ours, "off_policy/abs_log_ratio")[1] > 1e-3
    assert (ours_change - trl_change).norm() <= 1e-5 * trl_change.norm()
    assert logged(ours, "loss") == pytest.approx(logged(trl, "loss"), abs=1e-6)


# ------------------------------------------------------------------ rewards, evaluation, reference model, chat kwargs
def digits_reward(completions, **kwargs):
    """No reward (None) for every third sample: TRL counts it as NaN, left out of the mean."""
    return [None if index % 3 == 0 else float(sum(c.isdigit() for c in str(completion)))
            for index, completion in enumerate(completions)]  # fmt: skip


async def async_length_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(str(completion)) % 3) for completion in completions]


def reward_model():
    """A tiny sequence classifier with a tokenizer of its own (another vocabulary than the policy's)."""
    tokenizer = build_char_tokenizer(vocab_size=120)
    torch.manual_seed(5)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return Qwen3ForSequenceClassification(config), tokenizer


THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
            "{% if think is defined and think %}assistant, thinking:{% else %}assistant:{% endif %}{% endif %}")


def text_trainer(trainer_cls, args, tmp_path, **kwargs):
    """The tiny Qwen3 on arithmetic prompts (saved and passed by path when a reference model is built from it)."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = THINKING
    model = build_tiny_qwen3(tokenizer, hidden_size=32, seed=0)
    if args.beta:
        model.save_pretrained(tmp_path / "model")
        tokenizer.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    prompts = [f"{'y' * (a % 4)}{a}*{a + 2}=" for a in range(8)]
    if kwargs.pop("conversational", False):
        prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
    return trainer_cls(model=model, args=args, processing_class=tokenizer,
                       train_dataset=Dataset.from_dict({"prompt": prompts}), **kwargs)  # fmt: skip


def trl_and_ours(tmp_path, settings, **kwargs):
    """The same run with `trl.GRPOTrainer` and `DHPOTrainer` (a GRPOConfig: TRL's objective, the default path)."""
    run = dict(RUN, max_steps=4, max_completion_length=12, **settings, **CPU)
    results = []
    for name, trainer_cls in (("trl", GRPOTrainer), ("dhpo", DHPOTrainer)):
        factory = dict(kwargs)
        if "reward_funcs" in factory and callable(factory["reward_funcs"]):
            factory.update(factory.pop("reward_funcs")())  # fresh reward models for each trainer
        trainer = text_trainer(trainer_cls, GRPOConfig(str(tmp_path / name), **run), tmp_path / name, **factory)
        results.append((train(trainer), trainer))
    return results


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_a_reward_model_async_and_none_rewards_train_as_trls(tmp_path, aggregation):
    """A reward model with its own tokenizer (`reward_processing_classes`), an async reward function and one that
    returns None for some samples, weighted, under both of TRL's multi-reward aggregations."""

    def rewards():
        model, tokenizer = reward_model()
        return dict(reward_funcs=[model, async_length_reward, digits_reward],
                    reward_processing_classes=[tokenizer, None, None])  # fmt: skip

    settings = dict(reward_weights=[1.0, 0.5, 2.0], multi_objective_aggregation=aggregation)
    (trl_change, trl), (ours_change, ours) = trl_and_ours(tmp_path, settings, reward_funcs=rewards)
    assert trl_change.norm() > 1e-2 and logged(ours, "off_policy/abs_log_ratio")[1] > 1e-3
    assert (ours_change - trl_change).norm() <= 1e-5 * trl_change.norm()
    for key in ("loss", "reward", "reward_std", "rewards/Qwen3ForSequenceClassification/mean",
                "rewards/async_length_reward/mean", "rewards/digits_reward/mean"):  # fmt: skip
        assert logged(ours, key) == pytest.approx(logged(trl, key), abs=1e-5), key


def test_evaluation_kl_to_a_synced_reference_and_chat_template_kwargs_as_trls(tmp_path):
    """`eval_dataset` with `eval_strategy="steps"` (TRL's eval metrics), `beta > 0` with `sync_ref_model` (the
    reference mixed into the policy every 2 steps) and conversational prompts rendered with `chat_template_kwargs`."""
    settings = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                    chat_template_kwargs={"think": True}, eval_strategy="steps", eval_steps=2,
                    per_device_eval_batch_size=4)  # fmt: skip
    prompts = [[{"role": "user", "content": f"{a}+{a}="}] for a in range(4)]
    (trl_change, trl), (ours_change, ours) = trl_and_ours(
        tmp_path, settings, reward_funcs=[length_reward], conversational=True,
        eval_dataset=Dataset.from_dict({"prompt": prompts}))  # fmt: skip
    assert logged(ours, "off_policy/abs_log_ratio")[1] > 1e-3
    assert (ours_change - trl_change).norm() <= 1e-5 * trl_change.norm()
    assert (flat(ours.ref_model) - (flat(ours.model) - ours_change)).norm() > 1e-3  # the reference was synced
    rendered = ours.processing_class.decode(ours._buffered_inputs[0]["prompt_ids"][0])
    assert rendered.endswith("assistant, thinking:")  # the kwarg reached the template
    evaluations = [entry for entry in trl.state.log_history if "eval_loss" in entry]
    assert len(evaluations) == 2
    for key in [key for key in evaluations[0] if key.startswith("eval_") and not key.endswith(("runtime", "_second"))]:
        assert logged(ours, key) == pytest.approx(logged(trl, key), abs=1e-5), key
    for key in ("loss", "reward"):  # `kl` and `entropy`: per-micro-batch means, which the default path regroups
        assert logged(ours, key) == pytest.approx(logged(trl, key), abs=1e-5), key


@pytest.mark.skipif(is_liger_kernel_available(), reason="checks the run without liger-kernel")
def test_liger_kernel_without_liger_installed_fails_as_trls(tmp_path):
    """`use_liger_kernel=True` without liger-kernel: both trainers stop when training starts, with transformers'
    ImportError naming the package (TRL 1.16 applies only liger's layer kernels, and deprecates the setting)."""
    messages = []
    for name, trainer_cls in (("trl", GRPOTrainer), ("dhpo", DHPOTrainer)):
        args = GRPOConfig(str(tmp_path / name), use_liger_kernel=True, **dict(RUN, max_completion_length=8), **CPU)
        trainer = text_trainer(trainer_cls, args, tmp_path / name, reward_funcs=[length_reward])
        with pytest.raises(ImportError, match="liger-kernel") as error:
            train(trainer)
        messages.append(str(error.value))
    assert messages[0] == messages[1]


class Calculator:
    """A TRL environment (`environment_factory`): its method is the tool, and it owns the reward."""

    def reset(self, **kwargs):
        self.product = 0

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product.
        """
        self.product = a * b
        return self.product

    def get_reward(self) -> float:
        return float(self.product % 5)


def test_an_environment_that_owns_tools_and_reward_trains_as_trls(tmp_path):
    """`environment_factory` with no reward function: TRL runs the environment's method as the tool and scores each
    rollout with its `get_reward`; the default path's off-policy update is TRL's."""
    changes = []
    for name, trainer_cls in (("trl", GRPOTrainer), ("dhpo", DHPOTrainer)):
        tokenizer = qwen3_tokenizer()
        model = build_tiny_qwen3(tokenizer, hidden_size=32, seed=0, max_position_embeddings=1024)
        calling_the_tool_first(model, tokenizer)
        prompts = [[{"role": "user", "content": "x" * (1 + index % 3)}] for index in range(4)]
        trainer = trainer_cls(model=model, reward_funcs=None, args=GRPOConfig(str(tmp_path / name), **TOOL_RUN),
                              processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": prompts}),
                              environment_factory=Calculator)  # fmt: skip
        changes.append((train(trainer), trainer))
    (trl_change, trl), (ours_change, ours) = changes
    assert logged(ours, "tools/call_frequency")[0] == 1.0 and logged(ours, "rewards/Calculator/std")[0] > 0
    assert logged(ours, "off_policy/abs_log_ratio")[1] > 1e-3
    assert (ours_change - trl_change).norm() <= 1e-5 * trl_change.norm()
    assert logged(ours, "reward") == pytest.approx(logged(trl, "reward"), abs=1e-6)
