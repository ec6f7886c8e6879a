"""Local stand-ins for the Hugging Face Hub resources of TRL's GRPO tests (no network here).

`hub_model(repo_id)` returns a local folder holding a tiny model of the named repository's architecture and a
tokenizer with Qwen's special tokens and ChatML template. For the whole file (DHPO_TRL_TESTS=full) the tokenizer has
Qwen2.5's id layout (characters at low ids, `<|endoftext|>` = 151643 as pad, `<|im_start|>` = 151644, `<|im_end|>` =
151645 as end of sequence, vocabulary 151665), so the tests that hard-code those ids hold. The suite's subset
hard-codes no id: there the special tokens follow the characters (vocabulary 112), since logits 151665 wide cost a
tiny model's step many times over and the subset asserts nothing of the vocabulary's size. `load_dataset(...)` stands in for `datasets.load_dataset("trl-internal-testing/zen", ...)` with
prompts of the same kinds (standard and conversational, train and test splits). Built once per process.
"""

from __future__ import annotations

import atexit
import os
import shutil
import string
import tempfile

import datasets
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
if os.environ.get("DHPO_TRL_TESTS") == "full":  # Qwen2.5's ids, which some of TRL's tests hard-code
    VOCAB, SPECIAL_IDS = 151665, (151643, 151644, 151645, 151657, 151658)
else:
    VOCAB, SPECIAL_IDS = 112, (100, 101, 102, 103, 104)
SPECIAL = dict(zip(SPECIAL_IDS, SPECIAL_TOKENS, strict=True))
PAD_ID, EOS_ID = SPECIAL_IDS[0], SPECIAL_IDS[2]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCHITECTURES = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": Qwen2ForCausalLM,
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": Qwen2ForSequenceClassification,
}
_ROOT = tempfile.mkdtemp(prefix="trl-stand-ins-")
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
# Fewer prompts than the Hub's (17 train): TRL's tests train 3 epochs, and this machine is a shared CPU.
PROMPTS = ["Solve 2 + 2 =", "The sky is", "Write a haiku about", "Why is the ocean", "Name a prime", "Hello",
           "Count to three:", "What color is"]  # fmt: skip


def qwen_layout_tokenizer() -> PreTrainedTokenizerFast:
    """One token per ASCII character at ids 0..99, reserved fillers, Qwen's special tokens at `SPECIAL_IDS`."""
    vocab = {char: index for index, char in enumerate(dict.fromkeys(string.printable))}
    for index in range(len(vocab), VOCAB):
        vocab[SPECIAL.get(index, f"<|reserved_{index}|>")] = index
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], padding_side="left")  # fmt: skip
    fast.chat_template = CHATML
    return fast


def hub_model(repo_id: str) -> str:
    """Local folder standing in for `repo_id` (built on first use)."""
    if repo_id not in ARCHITECTURES:
        raise KeyError(f"no local stand-in for {repo_id}: the adapted tests use only {list(ARCHITECTURES)}")
    folder = os.path.join(_ROOT, repo_id.replace("/", "--"))
    if not os.path.isdir(folder):
        tokenizer = qwen_layout_tokenizer()
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=8, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                             pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=None, tie_word_embeddings=True,
                             num_labels=1)  # fmt: skip
        ARCHITECTURES[repo_id](config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def load_dataset(path: str, name: str, split: str | None = None, streaming: bool = False):
    """`datasets.load_dataset` for trl-internal-testing/zen's prompt-only configurations, built locally."""
    if path != "trl-internal-testing/zen" or name not in ("standard_prompt_only", "conversational_prompt_only"):
        raise KeyError(f"no local stand-in for {path} {name}")

    def rows(prompts):
        if name == "standard_prompt_only":
            return {"prompt": prompts}
        return {"prompt": [[{"role": "user", "content": p}] for p in prompts]}

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows(PROMPTS[:6])),
                                   "test": datasets.Dataset.from_dict(rows(PROMPTS[6:]))})  # fmt: skip
    if streaming:
        splits = datasets.IterableDatasetDict({key: value.to_iterable_dataset() for key, value in splits.items()})
    return splits if split is None else splits[split]
