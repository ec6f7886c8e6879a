"""A tiny Qwen2.5-VL and its processor, built locally (no download), and a few image prompts.

The processor is transformers' `Qwen2_5_VLProcessor` with the PIL image processor, a character tokenizer holding
Qwen-VL's vision tokens and a ChatML template that renders `{"type": "image"}` as Qwen's
`<|vision_start|><|image_pad|><|vision_end|>`. Its video processor needs torchvision, which the CPU environment does
not install; no test passes videos, so the processor is built without one.
"""

from __future__ import annotations

import string

import numpy as np
import torch
from datasets import Dataset
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)  # fmt: skip

SPECIAL = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ImageOnlyProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without a video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def char_tokenizer(special: list[str], pad: str, kept: list[str], template: str) -> PreTrainedTokenizerFast:
    """A tokenizer of single characters after the tokens `special`, those in `kept` never split, `pad` padding on
    the left and standing for unknown characters, `<|im_end|>` as end of sequence, and the chat `template`."""
    vocab = {token: index for index, token in enumerate(special + list(dict.fromkeys(string.printable)))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad, eos_token="<|im_end|>",
                                   padding_side="left", additional_special_tokens=kept)  # fmt: skip
    fast.chat_template = template
    return fast


def build_processor() -> ImageOnlyProcessor:
    fast = char_tokenizer(SPECIAL, "<|pad|>", SPECIAL[2:], TEMPLATE)
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)  # fmt: skip
    return ImageOnlyProcessor(image_processor=images, tokenizer=fast, video_processor=None, chat_template=TEMPLATE)


def build_model(processor, seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    ids = {token: processor.tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(processor.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                           window_size=56),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=ids["<|im_end|>"],
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config)


def image_dataset(rows: int = 8) -> Dataset:
    """Conversational image prompts of four image sizes (1, 2 and 4 image tokens) and three text lengths."""
    rng = np.random.default_rng(0)
    sizes = [(28, 28), (56, 28), (28, 56), (56, 56)]
    examples = []
    for index in range(rows):
        pixels = (rng.random((*sizes[index % 4], 3)) * 255).astype("uint8")
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x" * (1 + index % 3)}]}]
        examples.append({"prompt": prompt, "image": Image.fromarray(pixels)})
    return Dataset.from_list(examples)
