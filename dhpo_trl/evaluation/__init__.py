"""Benchmark evaluation with the DHPO paper's protocol, as a command (`dhpo-evaluate`) and as a training callback.

- `benchmarks`: the seven benchmarks of Table 1, their samples per problem, and loaders for their real formats.
- `backends`: vLLM offline inference (GPU) and transformers `generate` (CPU, tests, in-training evaluation).
- `runner` / `metrics`: sampling, scoring (`dhpo_trl.scoring.rewards.score_answer`, the training reward's function), Avg@k /
  Pass@1, the AVG column and the Table-1 layout.
- `audit`: the scorer audit (generated correct rewrites, near misses, rotated golds), run by scripts/audit_scorer.py.
- `callback.BenchmarkEvalCallback`: scores a subset every N training steps and logs `eval/<benchmark>`.
"""

from .backends import SamplingSettings, TransformersBackend, VLLMBackend
from .benchmarks import BENCHMARKS, BenchmarkSpec, Problem, load_benchmark, resolve_benchmark_names
from .callback import BenchmarkEvalCallback
from .metrics import average_score, benchmark_score, format_table
from .runner import evaluate_problems

__all__ = [
    "BENCHMARKS",
    "BenchmarkEvalCallback",
    "BenchmarkSpec",
    "Problem",
    "SamplingSettings",
    "TransformersBackend",
    "VLLMBackend",
    "average_score",
    "benchmark_score",
    "evaluate_problems",
    "format_table",
    "load_benchmark",
    "resolve_benchmark_names",
]
