"""Tiny, deterministic Qwen3-architecture models and a character tokenizer, built locally (no download), and the
switch that runs DeepSpeed on CPU.

Used by the tests, the benchmarks and the embedded CPU default: nothing here touches the Hub.
"""

from __future__ import annotations

import os
import string
import sys

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
CHARACTERS = string.printable  # digits, letters, punctuation, whitespace: every ASCII text tokenizes losslessly


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """One token per ASCII character, plus pad / end-of-text / unknown. Deterministic: same ids every time.

    `vocab_size`: filler tokens `<|tN|>` up to that size, which text never encodes to but which decode, so that a
    model with a real vocabulary size (151,936 for Qwen3) can generate through this tokenizer."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(CHARACTERS)))}
    if vocab_size is not None and vocab_size < len(vocab):
        raise ValueError(f"build_char_tokenizer: vocab_size={vocab_size} is below the {len(vocab)} characters")
    vocab.update({f"<|t{index}|>": index for index in range(len(vocab), vocab_size or 0)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    # `[\s\S]`, not `.`: Oniguruma's `.` skips "\n", so a run like "\n\n" stayed one unmatched piece and became
    # <|unk|>. (`(?s)` is not accepted there; `[\s\S]` matches every character, "\n" included.)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<|unk|>",
        padding_side="left",
    )


def build_tiny_qwen3(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    moe: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 512,
):
    """A randomly initialised Qwen3 (or Qwen3-MoE with `moe=True`) causal LM sized for CPU tests."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    if moe:
        config = Qwen3MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            decoder_sparse_step=1,
            output_router_logits=False,  # True breaks cached generate() in transformers 5.17; TRL asks for router logits itself
            router_aux_loss_coef=0.01,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype)


# The released Qwen3 models' shapes (their hub config.json), for benchmarks and GPU checks with random weights.
QWEN3_SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip


def build_qwen3_shape(tokenizer: PreTrainedTokenizerFast, shape: str, *, seed: int = 0, device: str = "cpu",
                      max_position_embeddings: int = 40960):  # fmt: skip
    """A randomly initialised Qwen3 of a released model's shape (`QWEN3_SHAPES`), float32, built on `device` (no
    download; weights drawn where they live, so a GPU builds billions of them in a second)."""
    if shape not in QWEN3_SHAPES:
        raise ValueError(f"build_qwen3_shape: shape={shape!r} must be one of {sorted(QWEN3_SHAPES)}")
    return build_qwen3_from_fields(tokenizer, QWEN3_SHAPES[shape], seed=seed, device=device,
                                   max_position_embeddings=max_position_embeddings)  # fmt: skip


def build_qwen3_from_fields(tokenizer: PreTrainedTokenizerFast, fields: dict, *, seed: int = 0, device: str = "cpu",
                            max_position_embeddings: int = 40960):  # fmt: skip
    """A randomly initialised Qwen3 whose config takes `fields` (a Qwen3-MoE where they name `num_experts`; router
    logits off, as TRL asks for them itself), float32, built on `device`, with the tokenizer's special tokens."""
    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   bos_token_id=tokenizer.eos_token_id, max_position_embeddings=max_position_embeddings)  # fmt: skip
    if "num_experts" in fields:
        config, model_class = Qwen3MoeConfig(**fields, **special, output_router_logits=False), Qwen3MoeForCausalLM
    else:
        config, model_class = Qwen3Config(**fields, **special), Qwen3ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def use_deepspeed_on_cpu() -> None:
    """Run DeepSpeed on CPU, as the tests and the CPU smoke runs do: its CPU accelerator, gloo for collectives.
    Call it before anything imports deepspeed (the accelerator is chosen then).

    DeepSpeed's CPU communication backend would first JIT-compile its shared-memory all-reduce op
    (`deepspeed_shm_comm`): 38-120 s on 2 cores, redone for every new virtual environment, because torch's build
    command names the environment's path. gloo reduces a tiny model's gradients as well, so the op is marked
    incompatible and DeepSpeed's own fallback (`build_shm_op()` returns None) takes over."""
    chosen = getattr(sys.modules.get("deepspeed.accelerator.real_accelerator"), "ds_accelerator", None)
    if chosen is not None and chosen._name != "cpu":  # too late: DeepSpeed keeps its first choice for the process
        raise RuntimeError(
            f"use_deepspeed_on_cpu(): DeepSpeed already chose the {chosen._name!r} accelerator; call it before "
            "anything imports deepspeed"
        )
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed keeps this one dict for the process
