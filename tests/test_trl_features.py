"""TRL 1.16 features a `GRPOTrainer` user turns on, with `DHPOTrainer` in its place: the same run with both trainers,
off-policy (two optimizer steps per generation batch), parameters and logged metrics compared; or, where one of our
settings cannot act with the feature, the early refusal that names it.
"""

import string
import warnings

import pytest
import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_chat_template
from vlm_stand_in import build_model, build_processor, image_dataset

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.demo.tiny import build_tiny_qwen3

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
    """A tiny Qwen2.5-VL on prompts with images of three sizes: the default path keeps TRL's micro-batches and TRL's
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
    built, naming the setting (the first one set, in the config's order)."""
    args = DHPOConfig(str(tmp_path), **setting, **RUN, **CPU)
    with pytest.raises(ValueError, match=f"DHPOConfig.{next(iter(setting))}=") as error:
        vlm_trainer(DHPOTrainer, args)
    assert "Qwen2_5_VLProcessor" in str(error.value) or "ImageOnlyProcessor" in str(error.value)


# ------------------------------------------------------------------ multi-turn tool calling (`tools=`)
TOOL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<think>", "</think>"]  # fmt: skip


def qwen3_tokenizer():
    """Characters and Qwen3's special tokens, with Qwen3's chat template as TRL ships it (TRL then sets the response
    template that parses tool calls, and the training template that renders tool results)."""
    vocab = {token: index for index, token in enumerate(TOOL_TOKENS + list(dict.fromkeys(string.printable)))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   padding_side="left", additional_special_tokens=TOOL_TOKENS[1:])  # fmt: skip
    fast.chat_template = qwen3_chat_template
    return fast


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
                                  dict(padding_free=True, max_tokens_per_micro_batch=160)],
                         ids=["trl_batching", "dynamic", "packed", "packed_budget"])  # fmt: skip
def test_tool_calling_trains_as_trls_on_every_path(tmp_path, trl_tool_run, path):
    """`tools=[...]`: TRL runs the tool and appends its result to the completion, masked out of the loss by its
    `tool_mask`. On every path the off-policy update is TRL's (the tool result tokens carry no gradient)."""
    trl_change, trl = trl_tool_run
    masked = []
    ours = tool_trainer(DHPOTrainer, DHPOConfig(str(tmp_path), algorithm="grpo", loss_type="dapo", **path, **TOOL_RUN))
    compute_loss = ours.compute_loss

    def recording(model, inputs, *args, **kwargs):
        for part in inputs if isinstance(inputs, list) else [inputs]:
            masked.append(int((part["completion_mask"] * (1 - part["tool_mask"])).sum()))
        return compute_loss(model, inputs, *args, **kwargs)

    ours.compute_loss = recording
    ours_change = train(ours)
    assert logged(trl, "tools/call_frequency")[0] == 1.0 and logged(ours, "tools/call_frequency")[0] == 1.0
    assert min(masked) > 0  # every micro-batch holds tool result tokens
    assert logged(ours, "off_policy/abs_log_ratio")[1] > 1e-3
    assert (ours_change - trl_change).norm() <= 1e-5 * trl_change.norm()
    assert logged(ours, "loss") == pytest.approx(logged(trl, "loss"), abs=1e-6)
