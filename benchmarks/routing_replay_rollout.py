"""R3 (`routing_replay="rollout"`) against vLLM's offline engine, as TRL's colocate mode builds it: a Qwen3-MoE
built here (random weights, no download) is saved, vLLM generates from it with `enable_return_routed_experts=True`,
and the policy (transformers, the same weights) scores the completions with live routing and with vLLM's routing
replayed.

    python benchmarks/routing_replay_rollout.py --device cuda --dtype bfloat16 --shape small --json out.json
    python benchmarks/routing_replay_rollout.py --device cpu --engine stand-in --shape tiny --json out.json

Reported: the engine's routing parsed by `dhpo_trl/training/rollout_routing.py` (`output_samples`, `routing_of`, the
code the trainer runs); the flip fraction before replay (token-layer decisions where the policy's live top-k set
differs from the engine's, over every token but each sequence's last, whose routing the engine may not return);
whether every expert block of the replayed pass ran the engine's experts for every token and layer (read by a spy
on the blocks, not by the hooks); the replayed fraction; and the gap |log pi_policy - log pi_engine| over the sampled
tokens, mean and max, live and replayed.

`--engine vllm` needs vllm installed (a GPU machine with it); where it is not, the JSON says so and nothing else
runs. `--engine stand-in` (the CPU dry run): transformers generates in float32 from a copy whose router weights are
perturbed (as an engine's own kernels give other numerics), and returns routing shaped as vLLM returns it, only when
built with `enable_return_routed_experts=True`, as vLLM does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dhpo_trl.demo.tiny import build_char_tokenizer, build_qwen3_from_fields  # noqa: E402
from dhpo_trl.training import routing_replay as rr  # noqa: E402
from dhpo_trl.training.rollout_routing import output_samples, routing_of  # noqa: E402

SHAPES = {  # head_dim 64: a size every vLLM attention backend takes
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "small": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=256),
}  # fmt: skip


def save_model(directory: Path, shape: str, seed: int = 0) -> None:
    """A randomly initialised Qwen3-MoE of `shape` and the character tokenizer, saved for the engine to load."""
    tokenizer = build_char_tokenizer()
    fields = dict(SHAPES[shape], vocab_size=len(tokenizer), norm_topk_prob=True, tie_word_embeddings=False)
    build_qwen3_from_fields(tokenizer, fields, seed=seed, max_position_embeddings=512).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


class StandInEngine:
    """vLLM's `LLM` as far as this check uses it: `generate(prompts, sampling_params)` returning request outputs
    with `prompt_token_ids`, `prompt_routed_experts` and, per completion, `token_ids`, `logprobs`, `routed_experts`
    (one token short, as vLLM's capturer), the routing only when built with enable_return_routed_experts=True."""

    def __init__(self, model: str, router_noise: float = 0.05, seed: int = 0, **kwargs):
        from transformers import Qwen3MoeForCausalLM

        self.returns_routing = bool(kwargs.get("enable_return_routed_experts", False))
        self.model = Qwen3MoeForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.add_(router_noise * param.abs().mean() * torch.randn(param.shape, generator=generator))
        self.hooks = rr.RoutingReplay(self.model)

    def generate(self, prompts: list, sampling_params: dict, use_tqdm: bool = False) -> list:
        outputs = []
        for index, prompt in enumerate(prompts):
            ids = torch.tensor([prompt["prompt_token_ids"]])
            torch.manual_seed(sampling_params.get("seed", 0) + index)
            with torch.no_grad():
                full = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                           max_new_tokens=sampling_params["max_tokens"], min_new_tokens=2)  # fmt: skip
                with self.hooks.record() as out:
                    logps = torch.log_softmax(self.model(input_ids=full).logits[0, :-1].float(), -1)
            completion = full[0, ids.size(1) :].tolist()
            chosen = logps[ids.size(1) - 1 :].gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()
            rows = out[0].experts.permute(1, 0, 2).numpy().astype(np.int16)  # (tokens, layers, top_k)
            routing = self.returns_routing
            steps = [{token: SimpleNamespace(logprob=logp)} for token, logp in zip(completion, chosen)]
            output = SimpleNamespace(token_ids=completion, logprobs=steps,
                                     routed_experts=rows[ids.size(1) : -1] if routing else None)  # fmt: skip
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[output],
                                           prompt_routed_experts=rows[: ids.size(1)] if routing else None))
        return outputs


ROUTING_FLAGS = {"enable_return_routed_experts": True}  # what R3 needs of the engine, whichever engine


def build_engine(kind: str, directory: Path, dtype: str, max_len: int):
    """The engine, built to return routing (`ROUTING_FLAGS`), and its sampling-parameters class."""
    if kind == "stand-in":
        return StandInEngine(model=str(directory), **ROUTING_FLAGS), dict
    from vllm import LLM, SamplingParams

    engine = LLM(model=str(directory), tokenizer=str(directory), dtype=dtype, enforce_eager=True,
                 gpu_memory_utilization=0.3, max_model_len=max_len, seed=0, **ROUTING_FLAGS)  # fmt: skip
    return engine, SamplingParams


def padded(sequences: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = torch.tensor(sequence), 1
    return ids.to(device), mask.to(device)


def engine_logps(outputs: list) -> list[list[float]]:
    """The engine's log-prob of each sampled token, per completion in `output_samples` order."""
    return [[step[token].logprob for token, step in zip(output.token_ids, output.logprobs)]
            for request in outputs for output in request.outputs]  # fmt: skip


def scored(model, ids, mask, prompt_lengths: list[int], completion_lengths: list[int]) -> list[torch.Tensor]:
    """The policy's log-prob of each completion token, per sequence."""
    logps = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    out = []
    for row, (prompt, completion) in enumerate(zip(prompt_lengths, completion_lengths)):
        targets = ids[row, prompt : prompt + completion]
        out.append(logps[row, prompt - 1 : prompt + completion - 1].gather(-1, targets[:, None])[:, 0].cpu())
    return out


def check(options) -> dict:
    report = {"engine": options.engine, "shape": options.shape, "device": options.device, "dtype": options.dtype}
    if options.engine == "vllm":
        try:
            import vllm
        except ImportError as error:
            report["skipped"] = (f"vllm is not installed here ({error}): R3 against a real engine needs a machine "
                                 "with vllm (`pip install -e .[vllm]`); the routing path was dry-run on CPU with "
                                 "--engine stand-in")  # fmt: skip
            return report
        report["vllm"] = vllm.__version__
    with tempfile.TemporaryDirectory(prefix="dhpo_r3_") as directory:  # the saved model, removed however this ends
        return measure(options, report, Path(directory))


def measure(options, report: dict, directory: Path) -> dict:
    """The engine generates from the model saved in `directory`; the policy scores its completions live and replayed."""
    from transformers import Qwen3MoeForCausalLM

    save_model(directory, options.shape)
    tokenizer = build_char_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer(f"{a}*{a + 7}=")["input_ids"]} for a in range(options.prompts)]
    start = time.perf_counter()
    engine, sampling = build_engine(options.engine, directory, options.dtype, 256)
    outputs = engine.generate(prompts, sampling(max_tokens=options.max_tokens, temperature=1.0, logprobs=0, seed=0),
                              use_tqdm=False)  # fmt: skip
    report["engine_seconds"] = time.perf_counter() - start
    samples = output_samples(outputs)  # what the trainer's wrapper keeps: ValueError where routing is missing
    routing = routing_of(samples)
    policy = Qwen3MoeForCausalLM.from_pretrained(directory, dtype=getattr(torch, options.dtype)).to(options.device)
    hooks = rr.RoutingReplay(policy)
    rr.check_fits(routing, rr.routers(policy))
    ids, mask = padded([tokens for tokens, _ in samples], options.device)
    prompt_lengths = [len(request.prompt_token_ids) for request in outputs for _ in request.outputs]
    completion_lengths = [len(tokens) - p for (tokens, _), p in zip(samples, prompt_lengths)]
    scored_tokens = mask.clone()  # every token but each sequence's last: the engine may not have routed it
    scored_tokens[torch.arange(len(samples)), mask.sum(1) - 1] = 0
    keep = scored_tokens[mask.bool()].bool().cpu()  # over the layout's tokens, row-major
    with torch.no_grad(), hooks.record() as out:
        live_logps = scored(policy, ids, mask, prompt_lengths, completion_lengths)
    live = out[0]
    engine_experts = routing.lookup(live.keys.cpu(), live.checks.cpu())
    flips = rr.decisions_differ(live.experts.long().cpu(), engine_experts)[:, keep]
    used = []
    spies = [block.register_forward_pre_hook(lambda m, args: used.append(args[1].detach().cpu()))
             for name, block in policy.named_modules() if name.endswith("mlp.experts")]  # fmt: skip
    with torch.no_grad(), hooks.replay(routing) as stats:
        replayed_logps = scored(policy, ids, mask, prompt_lengths, completion_lengths)
    for spy in spies:
        spy.remove()
    attended = mask.flatten().bool().cpu()
    ran = torch.stack([calls.view(-1, calls.size(-1))[attended] for calls in used])  # (layers, tokens, top_k)
    differing = rr.decisions_differ(ran.long(), engine_experts)
    reference = [torch.tensor(lp) for lp in engine_logps(outputs)]
    gaps = {name: torch.cat([(a - b).abs() for a, b in zip(logps, reference)])
            for name, logps in (("live", live_logps), ("replayed", replayed_logps))}  # fmt: skip
    report.update({
        "sequences": len(samples), "tokens": int(attended.sum()), "layers": routing.experts.size(0),
        "top_k": routing.experts.size(2), "routing_dtype": str(samples[0][1].dtype),
        "flip_fraction_before_replay": flips.float().mean().item(), "flipped_decisions": int(flips.sum()),
        "decisions": flips.numel(), "replayed_decisions_differing": int(differing.sum()),
        "replayed_decisions_checked": differing.numel(), "replayed_fraction": stats.replayed / stats.decisions,
        "logp_gap_live_mean": gaps["live"].mean().item(), "logp_gap_live_max": gaps["live"].max().item(),
        "logp_gap_replayed_mean": gaps["replayed"].mean().item(),
        "logp_gap_replayed_max": gaps["replayed"].max().item(),
    })  # fmt: skip
    report["ok"] = (report["replayed_decisions_differing"] == 0 and report["replayed_fraction"] == 1.0
                    and all(math.isfinite(report[k]) for k in report if k.startswith("logp_gap")))  # fmt: skip
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["vllm", "stand-in"], default="vllm")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", required=True, help="where the figures are written")
    options = parser.parse_args(argv)
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch; run on a GPU machine, or --device cpu")
    report = check(options)
    Path(options.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0 if report.get("ok", "skipped" in report) else 1


if __name__ == "__main__":
    sys.exit(main())
