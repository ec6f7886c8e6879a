"""GPU memory of full DHPO training of Qwen3-30B-A3B under DeepSpeed ZeRO-3, derived from the model's config.

    python scripts/memory_estimate.py                            # 8 GPUs, micro-batch 16, 1024 + 4096 tokens
    python scripts/memory_estimate.py --gpus 8 --micro-batch 4   # the 30B-A3B recipe on 8 training GPUs
    python scripts/memory_estimate.py --gpus 4 --micro-batch 4 --offload-optimizer   # GPUs 0-3 of the node serve vLLM

docs/scale_out.md quotes its output. Bytes per parameter follow DeepSpeed's bf16 mixed precision: bf16 weights and
gradients, fp32 master weights and fp32 Adam moments, all four sharded over the GPUs by ZeRO-3. Activations assume
decoder-layer gradient checkpointing (TRL's default), FlashAttention/SDPA (no seq x seq matrix kept) and TRL's
fused LM head (no batch x seq x vocab logits kept). With --offload-optimizer, DeepSpeed keeps the fp32 master
weights, the Adam moments and an fp32 copy of the gradients in CPU RAM (16 bytes per parameter, split over the nodes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 2**30

# Qwen/Qwen3-30B-A3B config.json (Qwen3MoeForCausalLM). Every decoder layer is sparse (decoder_sparse_step 1,
# mlp_only_layers []), so the dense `intermediate_size` (6144) is unused.
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False,
)  # fmt: skip


@dataclass
class ParameterCount:
    embeddings: int
    lm_head: int
    attention_per_layer: int
    norms_per_layer: int
    router_per_layer: int
    experts_per_layer: int
    final_norm: int
    layers: int
    expert_size: int
    active_experts: int

    @property
    def per_layer(self) -> int:
        return self.attention_per_layer + self.norms_per_layer + self.router_per_layer + self.experts_per_layer

    @property
    def total(self) -> int:
        return self.embeddings + self.lm_head + self.layers * self.per_layer + self.final_norm

    @property
    def active(self) -> int:
        """Parameters one token goes through (the `A3B`): all but the experts it is not routed to."""
        inactive = self.layers * (self.experts_per_layer - self.active_experts * self.expert_size)
        return self.total - inactive


def count_parameters(c: dict) -> ParameterCount:
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections (no biases in Qwen3)
    norms = 2 * h + 2 * d  # input / post-attention RMSNorm, q_norm and k_norm over head_dim
    expert = 3 * h * c["moe_intermediate_size"]  # gate, up, down projections of one SwiGLU expert
    embeddings = c["vocab_size"] * h
    return ParameterCount(
        embeddings=embeddings,
        lm_head=0 if c["tie_word_embeddings"] else embeddings,
        attention_per_layer=attention,
        norms_per_layer=norms,
        router_per_layer=h * c["num_experts"],
        experts_per_layer=c["num_experts"] * expert,
        final_norm=h,
        layers=c["num_hidden_layers"],
        expert_size=expert,
        active_experts=c["num_experts_per_tok"],
    )


# Bytes per parameter under DeepSpeed bf16 mixed precision with Adam(W).
STATE_BYTES = {"bf16 weights": 2, "bf16 gradients": 2, "fp32 master weights": 4, "fp32 Adam moments (m, v)": 8}


def training_state_per_gpu(params: int, gpus: int, offload_optimizer: bool = False) -> dict[str, float]:
    """Sharded model and optimizer state on each GPU, in bytes. Offload moves the fp32 parts to CPU memory."""
    on_gpu = {k: v for k, v in STATE_BYTES.items() if not (offload_optimizer and k.startswith("fp32"))}
    return {name: params * size / gpus for name, size in on_gpu.items()}


def activation_elements_per_token(c: dict) -> dict[str, int]:
    """bf16 elements autograd keeps per token while one decoder layer is recomputed for its backward."""
    h, d, k = c["hidden_size"], c["head_dim"], c["num_experts_per_tok"]
    q, kv, e = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["moe_intermediate_size"]
    return {
        # norm out, q/k/v, q/k after norm and rotary, attention out, o_proj out, residual
        "attention block": h + (q + 2 * kv) + 2 * (q + kv) + q + h + h,
        # norm out and router logits/probabilities (fp32 counted as two bf16)
        "router": h + 2 * 2 * c["num_experts"],
        # per routed copy: gathered input, gate_up out, act(gate), act*up, down out, weighted out
        "routed experts": k * (h + 2 * e + e + e + h + h),
    }


@dataclass
class Estimate:
    params: ParameterCount
    state: dict[str, float]
    checkpoints: float
    layer_recompute: float
    lm_head_tile: float
    zero3_working_set: float
    runtime_reserve: float
    gpu_bytes: float
    cpu_bytes_per_node: float  # offloaded optimizer state in each training node's RAM (0 without offload)

    @property
    def peak(self) -> float:
        return (
            sum(self.state.values()) + self.checkpoints + self.layer_recompute + self.lm_head_tile
            + self.zero3_working_set + self.runtime_reserve
        )  # fmt: skip

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_bytes


def estimate(
    config: dict = QWEN3_30B_A3B,
    gpus: int = 8,
    micro_batch: int = 16,
    prompt_tokens: int = 1024,
    completion_tokens: int = 4096,
    gpu_gib: float = 79.6,  # an 80 GB H100 reports 81,559 MiB
    offload_optimizer: bool = False,
    runtime_reserve_gib: float = 3.0,
    gpus_per_node: int = 8,
) -> Estimate:
    params = count_parameters(config)
    tokens = micro_batch * (prompt_tokens + completion_tokens)  # TRL pads every sequence of a micro-batch
    h = config["hidden_size"]
    block = params.experts_per_layer + params.router_per_layer  # one MoE block = one ZeRO-3 leaf, gathered whole
    return Estimate(
        params=params,
        state=training_state_per_gpu(params.total, gpus, offload_optimizer),
        # gradient checkpointing keeps each decoder layer's bf16 input
        checkpoints=tokens * h * 2 * params.layers,
        layer_recompute=tokens * sum(activation_elements_per_token(config).values()) * 2,
        # fused LM head: one [4096 tokens, vocab] bf16 tile at most, over the completion tokens
        lm_head_tile=min(micro_batch * completion_tokens, 4096) * config["vocab_size"] * 2,
        # the gathered MoE block being computed plus the prefetched next one (bf16), and the block's full bf16
        # gradient before it is reduce-scattered
        zero3_working_set=3 * block * 2,
        runtime_reserve=runtime_reserve_gib * GIB,  # CUDA context, NCCL buffers, allocator fragmentation
        gpu_bytes=gpu_gib * GIB,
        # fp32 master weights (4 B), Adam m and v (8 B) and DeepSpeed's fp32 gradient partition (4 B) per parameter
        cpu_bytes_per_node=16 * params.total * min(gpus, gpus_per_node) / gpus if offload_optimizer else 0.0,
    )


def report(e: Estimate, gpus: int, micro_batch: int, prompt_tokens: int, completion_tokens: int) -> str:
    p = e.params
    lines = [
        "Qwen3-30B-A3B parameters",
        f"  embeddings            {p.embeddings:>15,}",
        f"  lm_head (untied)      {p.lm_head:>15,}",
        f"  per layer: attention  {p.attention_per_layer:>15,}",
        f"  per layer: experts    {p.experts_per_layer:>15,}  ({p.experts_per_layer // p.expert_size} x {p.expert_size:,})",
        f"  per layer: router     {p.router_per_layer:>15,}",
        f"  per layer: norms      {p.norms_per_layer:>15,}",
        f"  layers                {p.layers:>15}",
        f"  total                 {p.total:>15,}  ({p.total / 1e9:.2f} B)",
        f"  active per token      {p.active:>15,}  ({p.active / 1e9:.2f} B)",
        "",
        f"Per GPU, ZeRO-3 over {gpus} GPUs, micro-batch {micro_batch} x ({prompt_tokens} + {completion_tokens}) tokens",
    ]
    for name, value in e.state.items():
        lines.append(f"  {name:<34}{value / GIB:8.2f} GiB")
    lines += [
        f"  {'activation checkpoints (48 layers)':<34}{e.checkpoints / GIB:8.2f} GiB",
        f"  {'one layer recomputed for backward':<34}{e.layer_recompute / GIB:8.2f} GiB",
        f"  {'fused LM head tile':<34}{e.lm_head_tile / GIB:8.2f} GiB",
        f"  {'ZeRO-3 gathered MoE blocks + grads':<34}{e.zero3_working_set / GIB:8.2f} GiB",
        f"  {'CUDA context, NCCL, fragmentation':<34}{e.runtime_reserve / GIB:8.2f} GiB",
        f"  {'peak':<34}{e.peak / GIB:8.2f} GiB of {e.gpu_bytes / GIB:.1f} GiB -> "
        + (f"fits ({(e.gpu_bytes - e.peak) / GIB:.1f} GiB spare)" if e.fits else "does NOT fit"),
    ]
    if e.cpu_bytes_per_node:
        lines.append(f"  {'CPU RAM per node, offloaded state':<34}{e.cpu_bytes_per_node / GIB:8.2f} GiB")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8, help="GPUs that train (ZeRO-3 shards over these)")
    parser.add_argument("--micro-batch", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=4096)
    parser.add_argument("--gpu-gib", type=float, default=79.6, help="usable GPU memory (80 GB H100: 79.6)")
    parser.add_argument("--offload-optimizer", action="store_true", help="offload_optimizer_device: cpu")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="training GPUs per node (for CPU RAM per node)")
    args = parser.parse_args(argv)
    result = estimate(
        gpus=args.gpus, micro_batch=args.micro_batch, prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens, gpu_gib=args.gpu_gib, offload_optimizer=args.offload_optimizer,
        gpus_per_node=args.gpus_per_node,
    )  # fmt: skip
    print(report(result, args.gpus, args.micro_batch, args.prompt_tokens, args.completion_tokens))
    return result


if __name__ == "__main__":
    main()
