"""An independent account of one DHPOTrainer optimizer step, from what the trainer's public entry points saw.

`record_training` runs `DHPOTrainer.train()` and records, through public hooks only, what a re-implementation
needs: the inputs of every `compute_loss` call (one micro-step: a dict, or a list of forward passes under a token
budget), the parameters at the start of every optimizer step (`on_step_begin`) and the gradient the optimizer is
about to apply (`on_pre_optimizer_step`), and how many forward passes the model ran.

`reference_gradient` then rebuilds the step's gradient by hand: a fresh tiny model loaded with the recorded
parameters, its own forward and log-softmax / entropy, the loop-based eq. 7 terms of `reference_losses`
(DHPO-A / DHPO-E with branch clipping), TRL's masks (tool mask, top-entropy quantile over every process's tokens of
the pass), eq. 7's per-response mean over the process's window (or TRL's `dapo` token normaliser), TRL's entropy
bonus (fixed or adaptive, coefficient from the previous step), the MoE router aux loss averaged over the window's
forward passes, and DDP's mean over processes. Nothing here imports `dhpo_trl` code but the tiny-model builder.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from reference_losses import constant_weights, reference_dhpo, reference_entropy_weights
from transformers import TrainerCallback

EPS = dict(epsilon_low_token=0.2, epsilon_high_token=0.28, epsilon_low_seq=0.2, epsilon_high_seq=0.28)
MAX_COMPLETION = 24


def rollout(tok, *, tool_mask: bool, long_rank: int | None = None):
    """Deterministic completions of varied lengths (a TRL `rollout_func`). With `tool_mask`, every completion of
    4+ tokens has tokens 1..2 marked as tool output (`env_mask` 0, TRL's tool mask). With `long_rank`, that process
    gets long completions and the others short ones, so token budgets need different pass counts per process."""
    calls = []

    def generate(prompts, trainer):
        rank = trainer.accelerator.process_index
        prompt_ids, completion_ids, env_masks = [], [], []
        for index, prompt in enumerate(prompts):
            rng = random.Random(f"{prompt}|{index}|{len(calls)}|{rank}")
            length = rng.randint(1, MAX_COMPLETION)
            if long_rank is not None:
                length = rng.randint(16, MAX_COMPLETION) if rank == long_rank else rng.randint(1, 4)
            body = [rng.randint(3, len(tok) - 1) for _ in range(length - 1)] + [tok.eos_token_id]
            prompt_ids.append(tok(prompt, add_special_tokens=False)["input_ids"])
            completion_ids.append(body)
            env_masks.append([0 if 1 <= t <= 2 and length >= 4 else 1 for t in range(length)])
        calls.append(len(prompts))
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        if tool_mask:
            out["env_mask"] = env_masks
        return out

    return generate


def reward(completions, **kwargs):
    return [float((len(text) * 7 + sum(map(ord, text))) % 5) for text in completions]


@dataclass
class Recording:
    micro_steps: list = field(default_factory=list)  # per micro-step: list of forward-pass input dicts
    params: list = field(default_factory=list)  # per optimizer step: parameters at its start
    grads: list = field(default_factory=list)  # per optimizer step: the gradient handed to the optimizer
    forwards: int = 0  # training-model forward passes (old log-probs and training passes)


class _Hooks(TrainerCallback):
    def __init__(self, recording, model):
        self.recording, self.model = recording, model

    def on_step_begin(self, args, state, control, **kwargs):
        self.recording.params.append({n: p.detach().clone() for n, p in self.model.named_parameters()})

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.recording.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                                     if p.grad is not None})  # fmt: skip


def record_training(trainer) -> Recording:
    """Train `trainer` and record its micro-steps, step-start parameters, gradients and forward count."""
    recording = Recording()
    trainer.add_callback(_Hooks(recording, trainer.model))
    original = trainer.compute_loss

    def compute_loss(model, inputs, *args, **kwargs):
        parts = inputs if isinstance(inputs, list) else [inputs]
        recording.micro_steps.append([{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in part.items()}
                                      for part in parts])  # fmt: skip
        return original(model, inputs, *args, **kwargs)

    def count(module, args, kwargs, output):
        recording.forwards += 1

    trainer.compute_loss = compute_loss
    handle = trainer.model.register_forward_hook(count, with_kwargs=True)
    try:
        trainer.train()
    finally:
        handle.remove()
    return recording


@dataclass
class Settings:
    """What the reference needs to know of the run's configuration."""

    accumulation: int  # gradient_accumulation_steps
    steps_per_generation: int
    rows_per_micro_batch: int  # per_device_train_batch_size
    mixing: str = "entropy"  # "entropy" (DHPO-E) or "averaged" (DHPO-A, token_weight 0.5)
    entropy_scope: str = "batch"  # DHPO-E's min-max: "batch" (the pass, this process) or "global" (every process)
    loss_type: str = "grpo"
    dynamic_batching: bool = True
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    adaptive: dict | None = None  # TRL's entropy_target, entropy_coef_delta, entropy_coef_min, entropy_coef_max
    aux_coef: float = 0.0


def forward(model, part, aux: bool):
    """(log-probs with gradient, entropies with gradient, router aux loss or None) of the completion tokens."""
    prompt_width = part["prompt_ids"].size(1)
    out = model(
        input_ids=torch.cat([part["prompt_ids"], part["completion_ids"]], dim=1),
        attention_mask=torch.cat([part["prompt_mask"], part["completion_mask"]], dim=1),
        output_router_logits=aux or None,
    )
    logits = out.logits[:, prompt_width - 1 : -1]
    log_probs = torch.log_softmax(logits, dim=-1)
    logps = log_probs.gather(-1, part["completion_ids"].unsqueeze(-1)).squeeze(-1)
    entropies = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropies, (out.aux_loss if aux else None)


def _windows(recording: Recording, accumulation: int):
    steps = recording.micro_steps
    starts = range(0, len(steps), accumulation)
    return [[part for micro in steps[i : i + accumulation] for part in micro] for i in starts]


def reference_gradients(build_model, recordings: list[Recording], settings: Settings,
                        coefficients: list | None = None, window_entropies: list | None = None) -> list[dict]:  # fmt: skip
    """The hand gradient of every optimizer step, from the per-process recordings (same steps on every process).
    With `coefficients`, the entropy coefficient after each step's update is appended to it (TRL logs that one);
    with `window_entropies`, (the world's window entropy, [each process's own]) of each step, as the controller
    sees them."""
    s = settings
    windows = [_windows(r, s.accumulation) for r in recordings]  # [process][step] -> passes
    processes, steps = len(recordings), len(windows[0])
    windows_per_generation = s.steps_per_generation // s.accumulation
    coef, last_world_entropy = s.entropy_coef, math.inf
    out = []
    for step in range(steps):
        model = build_model()
        # float64, so that the reference's own rounding stays far below the tolerance (an off-policy float32
        # reference drifts by ~1e-5 from a float64 one); MoE experts' grouped matmul has no float64 kernel.
        dtype = torch.float32 if getattr(model.config, "num_experts", None) else torch.float64
        model.to(dtype)
        params = {name: value.to(dtype) for name, value in recordings[0].params[step].items()}
        missing, unexpected = model.load_state_dict(params, strict=False)
        assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)  # tied
        model.train()
        losses, world, local = [], torch.zeros(2, dtype=dtype), []
        first = step - step % windows_per_generation
        generation = range(first, first + windows_per_generation)
        if s.loss_type == "dapo":  # TRL's num_items_in_batch: the generation batch's loss tokens, every process
            assert generation[-1] < steps, "dapo needs the whole last generation batch: a multiple of its steps"
            generation_tokens = sum(_loss_mask(part).sum() for r in windows for w in generation for part in r[w])
        forwards = [[forward(model, part, s.aux_coef != 0.0) for part in windows[p][step]] for p in range(processes)]
        for p in range(processes):
            passes = windows[p][step]
            terms_total, entropy_sum, entropy_count, bonus_micro, aux_sum = 0.0, 0.0, 0.0, 0.0, 0.0
            bonus_by_tokens, window_tokens = 0.0, 0.0
            for j, (part, (logps, entropies, aux)) in enumerate(zip(passes, forwards[p], strict=True)):
                mask = _loss_mask(part).to(dtype)
                old = part.get("old_per_token_logps")
                old = logps.detach() if old is None else old.to(dtype)  # on-policy: pi_old = sg[pi_theta]
                advantages = part["advantages"].reshape(-1).to(dtype)
                if s.mixing == "entropy" and s.entropy_scope == "global":  # min-max over this pass, every process
                    pooled = [float(e) for q in range(processes)
                              for e in forwards[q][j][1].detach()[_loss_mask(windows[q][step][j]).bool()]]  # fmt: skip
                    weights = reference_entropy_weights(entropies.detach(), mask,
                                                        entropy_range=(min(pooled), max(pooled)))
                elif s.mixing == "entropy":
                    weights = reference_entropy_weights(entropies.detach(), mask)
                else:
                    weights = constant_weights(mask, 0.5)
                terms = reference_dhpo(logps, old, advantages, mask, weights, "branch", EPS)
                keep = torch.ones_like(mask)
                if s.top_entropy_quantile < 1.0:  # TRL: quantile over this pass's valid tokens on every process
                    pooled = torch.cat([forwards[q][j][1].detach()[_loss_mask(windows[q][step][j]).bool()]
                                        for q in range(processes)])  # fmt: skip
                    threshold = torch.quantile(pooled, 1 - s.top_entropy_quantile)
                    keep = ((entropies.detach() >= threshold) & mask.bool()).float()
                for i in range(mask.size(0)):
                    valid = [t for t in range(mask.size(1)) if mask[i, t] > 0]
                    row = sum((terms[i, t] * keep[i, t] for t in valid), torch.zeros(()))
                    if s.loss_type == "grpo":
                        terms_total = terms_total + row / max(len(valid), 1)
                    else:  # dapo: token sum, normalised below
                        terms_total = terms_total + row
                effective = mask * keep
                entropy_sum = entropy_sum + (entropies * effective).sum()
                entropy_count = entropy_count + effective.sum()
                pass_mean = (entropies * effective).sum() / effective.sum().clamp(min=1.0)
                bonus_micro = bonus_micro + pass_mean
                bonus_by_tokens = bonus_by_tokens + pass_mean * mask.sum()
                window_tokens = window_tokens + mask.sum()
                if aux is not None:
                    aux_sum = aux_sum + aux
            if s.loss_type == "grpo":  # eq. 7 over the process's window: B x accumulation responses
                loss = terms_total / (s.rows_per_micro_batch * s.accumulation)
            else:  # dapo: TRL's num_items_in_batch / processes x accumulation / steps_per_generation
                loss = terms_total / (generation_tokens / processes * s.accumulation / s.steps_per_generation)
            if s.entropy_coef != 0.0 or s.adaptive is not None:
                if s.dynamic_batching:
                    # The micro-batches vary: each pass's mean over the tokens the bonus acts on (TRL's per-micro-batch
                    # mean), weighted by the pass's share of the window's loss tokens. Without a top-entropy mask this
                    # is the token mean over the window, whatever the grouping. With one, the kept count of the other
                    # passes is unknown when a pass computes its loss (each pass draws its own quantile), so the
                    # share is by loss tokens, of which each pass keeps the same fraction.
                    bonus = bonus_by_tokens / max(float(window_tokens), 1.0)
                else:  # TRL: each micro-batch's mean, divided by the accumulation steps
                    bonus = bonus_micro / s.accumulation
                applied = coef
                if s.adaptive is not None:
                    applied = coef if last_world_entropy <= s.adaptive["entropy_target"] else 0.0
                loss = loss - applied * bonus
            if s.aux_coef != 0.0:  # mean over the window's forward passes
                loss = loss + s.aux_coef * aux_sum / len(passes)
            losses.append(loss)
            world += torch.stack([entropy_sum.detach(), torch.as_tensor(entropy_count, dtype=dtype)])
            local.append(float(entropy_sum) / max(float(entropy_count), 1.0))
        model.zero_grad()
        (sum(losses) / processes).backward()  # DDP averages the processes' gradients
        out.append({n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None})
        if s.adaptive is not None:  # once per optimizer step, on the window's tokens of every process
            last_world_entropy = (world[0] / world[1].clamp(min=1.0)).item()
            a = s.adaptive
            if last_world_entropy <= a["entropy_target"]:
                coef = min(coef + a["entropy_coef_delta"], a["entropy_coef_max"])
            else:
                coef = max(coef - a["entropy_coef_delta"], a["entropy_coef_min"])
        if coefficients is not None:
            coefficients.append(coef)
        if window_entropies is not None:
            window_entropies.append(((world[0] / world[1].clamp(min=1.0)).item(), local))
    return out


def _loss_mask(part):
    mask = part["completion_mask"]
    return mask * part["tool_mask"] if part.get("tool_mask") is not None else mask


def relative_gap(ours: dict, reference: dict) -> float:
    names = sorted(reference)
    assert sorted(ours) == names, "the trainer and the reference disagree on which parameters have a gradient"
    a = torch.cat([ours[n].flatten().double() for n in names])
    b = torch.cat([reference[n].flatten().double() for n in names])
    return ((a - b).norm() / b.norm()).item()
