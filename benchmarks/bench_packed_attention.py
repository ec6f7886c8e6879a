"""Attention alone on packed rows of the long-tailed workload: padding_free's per-sequence SDPA loop against one
SDPA over the row with a dense block-diagonal causal mask (what transformers' `sdpa` does with packed
position_ids), forward + backward, interleaved, one thread.

Rows hold --sequences sequences: prompts of 16 to 96 tokens, completions lognormal with median 64, cut at 512. Also
counts how many sequences share a length with another one in their row (what grouping equal lengths could batch).

    python benchmarks/bench_packed_attention.py --trials 8 --heads 4 --head-dim 64
"""

import argparse
import math
import random
import statistics
import time

import torch
import torch.nn.functional as F

from dhpo_trl.training import packing


def row_lengths(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(16, 96) + min(512, max(1, int(rng.lognormvariate(math.log(64), 1.0)))) for _ in range(count)]


def timed(function, *tensors) -> float:
    tensors = [t.detach().requires_grad_() for t in tensors]
    start = time.perf_counter()
    function(*tensors).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=16, help="sequences per packed row")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    options = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    per_token = {"per-sequence loop": [], "dense block mask": []}
    shared = tokens = 0
    for trial in range(options.trials):
        lengths = row_lengths(rng, options.sequences)
        total = sum(lengths)
        tokens += total
        shared += sum(lengths.count(length) > 1 for length in lengths)
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (torch.randn(1, options.heads, total, options.head_dim) for _ in range(3))
        sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        mask = (sequence[:, None] == sequence[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
        arms = {
            "per-sequence loop": lambda q, k, v: packing.packed_sdpa_attention(None, q, k, v, None,
                                                                               cu_seq_lens_q=bounds)[0],  # fmt: skip
            "dense block mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        }
        for name in sorted(arms, reverse=bool(trial % 2)):  # alternate the order
            per_token[name].append(timed(arms[name], q, k, v) / total * 1e6)
    print(f"{options.trials} rows of {options.sequences} sequences, mean {tokens / options.trials:.0f} tokens, "
          f"heads={options.heads} head_dim={options.head_dim}, threads=1")  # fmt: skip
    for name, values in per_token.items():
        print(f"{name:18s} {statistics.median(values):8.2f} us/token (median, forward + backward)")
    share = shared / (options.trials * options.sequences)
    print(f"sequences sharing their length with another in the row: {share:.1%}")


if __name__ == "__main__":
    main()
