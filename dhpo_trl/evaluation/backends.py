"""Sampling backends: vLLM offline inference (GPU) and transformers `generate` (CPU, tests, in-training evaluation).

Both take the same tokenised prompts and return decoded completions, so scoring never depends on the backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 16384  # the paper's 16K evaluation budget
    temperature: float = 1.0
    top_p: float = 1.0  # the paper: nucleus sampling with top-p 1.0 and no top-k cutoff
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")


class TransformersBackend:
    """Batched `model.generate` sampling; `batch_size` counts sequences (prompt x sample) per call."""

    name = "transformers"

    def __init__(self, model, tokenizer, *, batch_size: int = 8):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[list[int]], num_samples: int, settings: SamplingSettings
    ) -> list[list[str]]:
        device = next(self.model.parameters()).device
        # A private RNG stream: reproducible for a fixed batch size, and a training run that evaluates
        # mid-way keeps the random state it would have had without the evaluation.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(settings.seed)
            return self._sample(prompt_ids, num_samples, settings, device)

    def _sample(self, prompt_ids, num_samples, settings, device) -> list[list[str]]:
        jobs = [(prompt_index, ids) for prompt_index, ids in enumerate(prompt_ids) for _ in range(num_samples)]
        completions: list[list[str]] = [[] for _ in prompt_ids]
        pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )
        sampling = (
            {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
            if settings.temperature > 0
            else {"do_sample": False}
        )
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(jobs), self.batch_size):
                batch = jobs[start : start + self.batch_size]
                width = max(len(ids) for _, ids in batch)
                # Left padding keeps every prompt's last token at the same position, which generate() needs.
                input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for _, ids in batch], device=device)
                attention_mask = torch.tensor(
                    [[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=device
                )
                output = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=settings.max_new_tokens,
                    pad_token_id=pad_id,
                    **sampling,
                )
                texts = self.tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
                for (prompt_index, _), text in zip(batch, texts):
                    completions[prompt_index].append(text)
        finally:
            self.model.train(was_training)
        return completions


class VLLMBackend:
    """vLLM offline `LLM.generate`: one request per problem with `n` samples."""

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
    ):
        vllm = import_vllm()
        self._sampling_params_class = vllm.SamplingParams
        self.llm = vllm.LLM(
            model=model,
            tokenizer=tokenizer or model,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
        )

    def generate(
        self, prompt_ids: Sequence[list[int]], num_samples: int, settings: SamplingSettings
    ) -> list[list[str]]:
        params = self._sampling_params_class(
            n=num_samples,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=settings.max_new_tokens,
            seed=settings.seed,
        )
        # Token ids, not text: vLLM would otherwise re-tokenise and could add a second BOS to a chat prompt.
        requests = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        outputs = self.llm.generate(requests, params)
        return [[choice.text for choice in output.outputs] for output in outputs]


def import_vllm():
    """vLLM is optional (GPU only); fail with the install command rather than a bare ImportError."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "The vLLM backend needs vllm: pip install 'dhpo-trl[vllm]' (CUDA GPU required). "
            "On CPU use --backend transformers."
        ) from error
    return vllm


def vllm_available() -> bool:
    try:
        import_vllm()
    except ImportError:
        return False
    return torch.cuda.is_available()
