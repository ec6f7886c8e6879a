"""dhpo_trl.evaluation.backends with stand-ins for the engines: what reaches `model.generate` and vLLM's
`LLM` / `SamplingParams` (sampling settings, padding, batching, seeds), how outputs come back (prompt trimmed,
special tokens dropped, grouped per prompt in order), and the one-line errors for bad settings or a missing vLLM."""

import sys
import types

import pytest
import torch

from dhpo_trl.demo.tiny import build_char_tokenizer
from dhpo_trl.evaluation import backends
from dhpo_trl.evaluation.backends import SamplingSettings, TransformersBackend, VLLMBackend

# Character tokenizer ids (dhpo_trl.demo.tiny): pad 0, end-of-text 1, 'a'..'z' 13..38.
PAD, EOS = 0, 1
A, B, C, X, Y, Z = 13, 14, 15, 36, 37, 38


# ------------------------------------------------------------------ SamplingSettings
def test_settings_defaults_are_the_paper_protocol():
    settings = SamplingSettings()
    assert settings.max_new_tokens == 16384
    assert settings.temperature == 1.0
    assert settings.top_p == 1.0
    assert settings.seed == 0
    with pytest.raises(AttributeError):
        settings.seed = 1  # frozen: one settings object is shared by every benchmark


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, r"^max_new_tokens must be >= 1, got 0\.$"),
        ({"max_new_tokens": -3}, r"^max_new_tokens must be >= 1, got -3\.$"),
        ({"temperature": -0.5}, r"^temperature must be >= 0 \(0 = greedy\), got -0\.5\.$"),
        ({"top_p": 0.0}, r"^top_p must be in \(0, 1\], got 0\.0\.$"),
        ({"top_p": 1.01}, r"^top_p must be in \(0, 1\], got 1\.01\.$"),
        ({"top_p": -0.2}, r"^top_p must be in \(0, 1\], got -0\.2\.$"),
    ],
)
def test_settings_refuse_bad_values_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingSettings(**kwargs)


def test_settings_accept_the_boundaries():
    assert SamplingSettings(max_new_tokens=1).max_new_tokens == 1
    assert SamplingSettings(temperature=0).temperature == 0  # greedy
    assert SamplingSettings(top_p=1.0).top_p == 1.0
    assert SamplingSettings(top_p=0.01).top_p == 0.01


# ------------------------------------------------------------------ TransformersBackend
class ScriptedLM(torch.nn.Module):
    """A causal-LM stand-in: each generate() call appends the next scripted block of new token ids to its input, and
    records its keyword arguments with the state it ran in (train mode, grad mode, RNG seed, a random draw)."""

    def __init__(self, new_tokens):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.new_tokens = list(new_tokens)
        self.calls = []

    def generate(self, **kwargs):
        self.calls.append(
            {
                "kwargs": {k: v.tolist() if torch.is_tensor(v) else v for k, v in kwargs.items()},
                "training": self.training,
                "grad": torch.is_grad_enabled(),
                "seed": torch.initial_seed(),
                "draw": torch.rand(1).item(),
            }
        )
        block = self.new_tokens.pop(0)
        if isinstance(block, Exception):
            raise block
        return torch.cat([kwargs["input_ids"], torch.tensor(block)], dim=1)


@pytest.fixture
def char_tokenizer():
    return build_char_tokenizer()


def test_transformers_pads_left_batches_jobs_and_trims_the_prompt(char_tokenizer):
    # two prompts x two samples, three sequences per call: [p0, p0, p1] then [p1]
    model = ScriptedLM([[[X, EOS], [Y, Y], [Z, PAD]], [[A, C]]])
    backend = TransformersBackend(model, char_tokenizer, batch_size=3)
    settings = SamplingSettings(max_new_tokens=2, temperature=0.7, top_p=0.9, seed=5)
    completions = backend.generate([[A, B], [C]], 2, settings)
    # new tokens only (the prompt "ab" / "c" is cut), special tokens dropped, grouped per prompt in order
    assert completions == [["x", "yy"], ["z", "ac"]]
    first, second = (call["kwargs"] for call in model.calls)
    assert first == {
        "input_ids": [[A, B], [A, B], [PAD, C]],
        "attention_mask": [[1, 1], [1, 1], [0, 1]],
        "max_new_tokens": 2,
        "pad_token_id": PAD,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
    }
    assert (second["input_ids"], second["attention_mask"]) == ([[C]], [[1]])  # padded to its own batch only


def test_transformers_greedy_at_temperature_zero(char_tokenizer):
    model = ScriptedLM([[[X]]])
    out = TransformersBackend(model, char_tokenizer).generate(
        [[A]], 1, SamplingSettings(max_new_tokens=3, temperature=0)
    )
    assert out == [["x"]]
    assert model.calls[0]["kwargs"] == {
        "input_ids": [[A]],
        "attention_mask": [[1]],
        "max_new_tokens": 3,
        "pad_token_id": PAD,
        "do_sample": False,
    }


def test_transformers_pads_with_eos_when_the_tokenizer_has_no_pad(char_tokenizer):
    char_tokenizer.pad_token = None
    model = ScriptedLM([[[X], [Y]]])
    out = TransformersBackend(model, char_tokenizer).generate([[A, B, C], [Z]], 1, SamplingSettings(max_new_tokens=1))
    assert out == [["x"], ["y"]]
    call = model.calls[0]["kwargs"]
    assert call["input_ids"] == [[A, B, C], [EOS, EOS, Z]]
    assert call["attention_mask"] == [[1, 1, 1], [0, 0, 1]]
    assert call["pad_token_id"] == EOS


@pytest.mark.parametrize(("batch_size", "sizes"), [(None, [8, 1]), (1, [1] * 9), (4, [4, 4, 1]), (9, [9])])
def test_transformers_batch_size_counts_sequences(char_tokenizer, batch_size, sizes):
    model = ScriptedLM([[[X]] * size for size in sizes])
    backend = (
        TransformersBackend(model, char_tokenizer)
        if batch_size is None
        else TransformersBackend(model, char_tokenizer, batch_size=batch_size)
    )
    out = backend.generate([[A], [B], [C]], 3, SamplingSettings(max_new_tokens=1))
    assert [len(call["kwargs"]["input_ids"]) for call in model.calls] == sizes
    assert out == [["x", "x", "x"]] * 3
    # jobs are prompt-major: every sample of prompt 0, then prompt 1, ...
    assert [row for call in model.calls for row in call["kwargs"]["input_ids"]] == [[A]] * 3 + [[B]] * 3 + [[C]] * 3


@pytest.mark.parametrize("batch_size", [0, -2])
def test_transformers_refuses_a_batch_size_below_one(batch_size):
    with pytest.raises(ValueError, match=rf"^batch_size must be >= 1, got {batch_size}\.$"):
        TransformersBackend(ScriptedLM([]), build_char_tokenizer(), batch_size=batch_size)


def test_transformers_seeds_a_private_stream_without_grad(char_tokenizer):
    model = ScriptedLM([[[X]], [[X]], [[X]]])
    backend = TransformersBackend(model, char_tokenizer)
    with torch.random.fork_rng():  # this test's own seed does not leak into later tests
        torch.manual_seed(99)
        state = torch.get_rng_state()
        backend.generate([[A]], 1, SamplingSettings(max_new_tokens=1, seed=1234))
        assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
    backend.generate([[A]], 1, SamplingSettings(max_new_tokens=1, seed=1234))
    backend.generate([[A]], 1, SamplingSettings(max_new_tokens=1, seed=7))
    assert [call["seed"] for call in model.calls] == [1234, 1234, 7]
    draws = [call["draw"] for call in model.calls]
    assert draws[0] == draws[1] != draws[2]
    assert [call["grad"] for call in model.calls] == [False, False, False]


@pytest.mark.parametrize("was_training", [True, False])
def test_transformers_samples_in_eval_mode_and_restores_the_mode(char_tokenizer, was_training):
    model = ScriptedLM([[[X]], RuntimeError("out of memory")])
    model.train(was_training)
    backend = TransformersBackend(model, char_tokenizer)
    backend.generate([[A]], 1, SamplingSettings(max_new_tokens=1))
    assert model.calls[0]["training"] is False
    assert model.training is was_training
    with pytest.raises(RuntimeError, match="out of memory"):
        backend.generate([[A]], 1, SamplingSettings(max_new_tokens=1))
    assert model.training is was_training  # restored even when generation fails


def test_transformers_backend_name():
    assert TransformersBackend.name == "transformers"
    assert VLLMBackend.name == "vllm"


def test_transformers_real_tiny_model_greedy_is_batch_invariant(char_tokenizer, tiny_model):
    prompts = [[A, B, C], [X]]
    settings = SamplingSettings(max_new_tokens=2, temperature=0)
    one = TransformersBackend(tiny_model, char_tokenizer, batch_size=1).generate(prompts, 2, settings)
    four = TransformersBackend(tiny_model, char_tokenizer, batch_size=4).generate(prompts, 2, settings)
    assert one == four
    assert [len(samples) for samples in one] == [2, 2]
    assert one[0][0] == one[0][1] and one[1][0] == one[1][1]  # greedy: both samples of a prompt agree


# ------------------------------------------------------------------ VLLMBackend
class FakeVLLM:
    """A `vllm` module stand-in recording how LLM and SamplingParams are built and what generate() receives."""

    def __init__(self):
        self.llm_kwargs = None
        self.params = []
        self.generate_calls = []
        fake = self

        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
                fake.params.append(self)

        class LLM:
            def __init__(self, **kwargs):
                fake.llm_kwargs = kwargs

            def generate(self, requests, params):
                fake.generate_calls.append((requests, params))
                choice = types.SimpleNamespace
                return [
                    choice(outputs=[choice(text=f"r{i}-{k}") for k in range(params.kwargs["n"])])
                    for i in range(len(requests))
                ]

        self.module = types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams)


@pytest.fixture
def fake_vllm(monkeypatch):
    fake = FakeVLLM()
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    return fake


def test_vllm_engine_defaults(fake_vllm):
    VLLMBackend("org/model")
    assert fake_vllm.llm_kwargs == {
        "model": "org/model",
        "tokenizer": "org/model",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "max_model_len": None,
        "dtype": "auto",
        "seed": 0,
    }


def test_vllm_engine_options_are_passed_through(fake_vllm):
    VLLMBackend(
        "ckpt", tokenizer="tok", tensor_parallel_size=2, gpu_memory_utilization=0.55, max_model_len=4096,
        dtype="bfloat16", seed=11,
    )  # fmt: skip
    assert fake_vllm.llm_kwargs == {
        "model": "ckpt",
        "tokenizer": "tok",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.55,
        "max_model_len": 4096,
        "dtype": "bfloat16",
        "seed": 11,
    }


def test_vllm_generate_sends_token_ids_and_sampling_params(fake_vllm):
    backend = VLLMBackend("ckpt")
    settings = SamplingSettings(max_new_tokens=321, temperature=0.6, top_p=0.95, seed=42)
    out = backend.generate([(5, 6, 7), (8,), [9, 10]], 2, settings)
    assert out == [["r0-0", "r0-1"], ["r1-0", "r1-1"], ["r2-0", "r2-1"]]
    (params,) = fake_vllm.params
    assert params.kwargs == {"n": 2, "temperature": 0.6, "top_p": 0.95, "max_tokens": 321, "seed": 42}
    ((requests, sent_params),) = fake_vllm.generate_calls
    assert sent_params is params
    assert requests == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}, {"prompt_token_ids": [9, 10]}]
    assert all(type(request["prompt_token_ids"]) is list for request in requests)  # tuples become lists


def test_vllm_greedy_passes_temperature_zero(fake_vllm):
    VLLMBackend("ckpt").generate([[1]], 1, SamplingSettings(max_new_tokens=8, temperature=0))
    assert fake_vllm.params[0].kwargs == {"n": 1, "temperature": 0, "top_p": 1.0, "max_tokens": 8, "seed": 0}


def test_vllm_missing_is_one_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError) as error:
        VLLMBackend("ckpt")
    assert str(error.value) == (
        "The vLLM backend needs vllm: pip install 'dhpo-trl[vllm]' (CUDA GPU required). "
        "On CPU use --backend transformers."
    )
    assert isinstance(error.value.__cause__, ImportError)  # the original import failure stays attached
    with pytest.raises(ImportError, match="pip install 'dhpo-trl\\[vllm\\]'"):
        backends.import_vllm()


def test_vllm_available_needs_the_package_and_cuda(monkeypatch, fake_vllm):
    assert backends.import_vllm() is fake_vllm.module
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.vllm_available() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.vllm_available() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert backends.vllm_available() is False
