"""The tiny local models and the character tokenizer: sizes as documented, deterministic in the seed, and a
tokenizer that maps every printable ASCII character to one token."""

import os
import string
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from dhpo_trl.demo.tiny import SPECIAL_TOKENS, build_char_tokenizer, build_tiny_qwen3, use_deepspeed_on_cpu
from dhpo_trl.scoring.data import format_prompt


def test_char_tokenizer_ids_and_round_trip():
    tokenizer = build_char_tokenizer()
    assert len(tokenizer) == 3 + len(set(string.printable)) == 103
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token) == tuple(SPECIAL_TOKENS)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.padding_side == "left"
    text = "Q: 12+30=\\boxed{42}\n\tx"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and 2 not in ids  # one known token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [2]  # outside ASCII: unknown
    assert tokenizer.convert_ids_to_tokens(3) == string.printable[0]
    assert build_char_tokenizer()("abc")["input_ids"] == tokenizer("abc")["input_ids"]  # same ids every time
    batch = tokenizer(["a", "abc"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_dense_model_shape(tokenizer):
    model = build_tiny_qwen3(tokenizer, hidden_size=24, num_layers=3, num_heads=6)
    config = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (103, 24, 48)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (3, 6, 3)
    assert config.head_dim == 4 and config.max_position_embeddings == 512
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (0, 1, 1)
    assert config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert (model.generation_config.pad_token_id, model.generation_config.eos_token_id) == (0, 1)
    assert build_tiny_qwen3(tokenizer, num_heads=1).config.num_key_value_heads == 1  # at least one kv head
    default = build_tiny_qwen3(tokenizer).config
    assert (default.hidden_size, default.num_hidden_layers, default.num_attention_heads) == (64, 2, 4)


def test_moe_model_shape(tokenizer):
    model = build_tiny_qwen3(tokenizer, hidden_size=16, num_heads=2, moe=True)
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 16)
    assert config.decoder_sparse_step == 1 and config.router_aux_loss_coef == 0.01
    assert config.output_router_logits is False  # True breaks cached generate() in transformers 5.17
    assert config.intermediate_size == 32 and config.max_position_embeddings == 512
    assert model.generation_config.pad_token_id == 0


def test_seed_and_dtype(tokenizer):
    a, b = build_tiny_qwen3(tokenizer, seed=3), build_tiny_qwen3(tokenizer, seed=3)
    c = build_tiny_qwen3(tokenizer, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))
    default = build_tiny_qwen3(tokenizer)  # seed 0 unless told otherwise
    seed_zero = build_tiny_qwen3(tokenizer, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(default.parameters(), seed_zero.parameters(), strict=True))
    assert build_tiny_qwen3(tokenizer).dtype == torch.float32
    assert build_tiny_qwen3(tokenizer, dtype=torch.bfloat16).dtype == torch.bfloat16


def _expected_ids(text: str) -> list[int]:
    """Ids from the documented vocabulary order (SPECIAL_TOKENS, then string.printable), not from the tokenizer."""
    return [len(SPECIAL_TOKENS) + string.printable.index(character) for character in text]


@pytest.mark.parametrize(
    "text, ids",
    [
        ("a\n\nb", [13, 99, 99, 14]),  # "a" is printable[10], "\n" printable[96], "b" printable[11]; +3 specials
        ("\n\n\n", [99, 99, 99]),
        ("\r\n\t \t", [100, 99, 98, 97, 98]),
        ("  \t\t\r\r\x0b\x0b\x0c\x0c", [97, 97, 98, 98, 100, 100, 101, 101, 102, 102]),
    ],
)
def test_char_tokenizer_whitespace_runs_are_one_token_per_character(tokenizer, text, ids):
    # Regression: the pre-tokenizer's regex was ".", which skips "\n", so "\n\n" stayed one piece -> <|unk|>.
    assert ids == _expected_ids(text)  # the literal ids agree with the vocabulary order
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encoded == ids and tokenizer.unk_token_id not in encoded
    assert tokenizer.decode(encoded) == text


def test_char_tokenizer_round_trips_every_printable_text(tokenizer):
    texts = [
        string.printable,
        string.printable[::-1],
        "".join(character * 3 for character in string.printable),  # every character in a run of three
        format_prompt("What is 2 plus 2?"),  # the plain SimpleRL prompt: "...\n\n...\n\nAnswer:"
    ]
    assert "\n\n" in texts[-1]
    for text in texts:
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert encoded == _expected_ids(text), repr(text)
        assert tokenizer.decode(encoded) == text


def _stand_in_deepspeed(monkeypatch, compatible_ops: dict) -> ModuleType:
    """A stand-in `deepspeed.ops` in sys.modules (the real one in this process would keep its accelerator for every
    later test). The real DeepSpeed's answer is checked in a child: test_accelerate_configs.py's shm_all_reduce."""
    fake_ops = ModuleType("deepspeed.ops")
    fake_ops.__compatible_ops__ = compatible_ops
    fake_deepspeed = ModuleType("deepspeed")
    fake_deepspeed.ops = fake_ops
    monkeypatch.setitem(sys.modules, "deepspeed", fake_deepspeed)
    monkeypatch.setitem(sys.modules, "deepspeed.ops", fake_ops)
    return fake_ops


def test_deepspeed_on_cpu_picks_the_cpu_accelerator_and_turns_off_the_shared_memory_op(monkeypatch):
    fake_ops = _stand_in_deepspeed(monkeypatch, {"deepspeed_shm_comm": True, "cpu_adam": True})
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # a value inherited from the shell is overridden
    use_deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert fake_ops.__compatible_ops__ == {"deepspeed_shm_comm": False, "cpu_adam": True}  # only that op


@pytest.mark.parametrize("chosen", ["cuda", "cpu"])
def test_deepspeed_on_cpu_is_refused_once_deepspeed_chose_another_accelerator(monkeypatch, chosen):
    """DeepSpeed picks its accelerator once per process; after a non-CPU pick, DS_ACCELERATOR=cpu would do nothing."""
    fake_ops = _stand_in_deepspeed(monkeypatch, {"deepspeed_shm_comm": True})
    real_accelerator = ModuleType("deepspeed.accelerator.real_accelerator")
    real_accelerator.ds_accelerator = SimpleNamespace(_name=chosen)
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator.real_accelerator", real_accelerator)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    if chosen == "cpu":  # already on the CPU: nothing is lost
        use_deepspeed_on_cpu()
        assert fake_ops.__compatible_ops__ == {"deepspeed_shm_comm": False}
        return
    with pytest.raises(RuntimeError, match=r"already chose the 'cuda' accelerator; call it before anything imports"):
        use_deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "cuda" and fake_ops.__compatible_ops__ == {"deepspeed_shm_comm": True}
