"""The long-completion embedded task: chained arithmetic with a scratchpad (`dhpo_trl.demo.long_arithmetic`), its
warm start, and the settings of its RL run.

    python -m dhpo_trl --task long                      # DHPO-E on it
    python -m dhpo_trl --task long --algorithm GSPO     # any row of dhpo_trl.core.presets.PAPER_ALGORITHMS

`run_embedded(settings=LongSettings())` runs it from Python; everything else (reward, evaluation, outputs) is the
two-digit task's (`dhpo_trl.demo.embedded`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .embedded import split_generation_batch
from .long_arithmetic import ChainProblem, LengthSettings, generate_chains, make_chain_splits
from .warmstart import WarmStartSettings, load_or_warm_start


@dataclass(frozen=True)
class LongSettings:
    """Defaults of the long-completion run: completions of about 30 to 400 tokens, median above 100."""

    task: ClassVar[str] = "long"
    title: ClassVar[str] = "chained arithmetic with a scratchpad"

    median_steps: float = 8.5  # scratchpad lines per problem: log-normal, clipped to [min_steps, max_steps]
    sigma: float = 0.55
    min_steps: int = 2
    max_steps_per_problem: int = 26
    num_train: int = 4000
    num_heldout: int = 100
    hidden_size: int = 128
    num_layers: int = 2
    # Warm start stopped at the first check where greedy decoding writes a whole taught scratchpad (any free
    # choices) for `warmup_target_accuracy` of 100 training problems: one wrong digit anywhere fails, so RL has room.
    warmup_steps: int = 3000
    warmup_target_accuracy: float | None = 0.4
    warmup_check_every: int = 50
    warmup_learning_rate: float = 3e-3
    warmup_batch_size: int = 32
    max_steps: int = 32  # RL optimizer steps
    # Seed of the final held-out set (`final_heldout`): the curve's held-out problems are drawn from seed 1, the
    # training problems from seed 0.
    final_heldout_seed: int = 2
    # The two-digit task's rate. Measured (GRPO, k = 4, seed 0, 4 generation batches): 2e-4 keeps the held-out
    # accuracy (35% -> 34%), 5e-4 loses 11 points (35% -> 24%), as it loses 5 on the two-digit task.
    learning_rate: float = 2e-4
    prompts_per_generation: int = 16
    num_generations: int = 8
    steps_per_generation: int = 2  # k: optimizer steps per generation batch
    gradient_accumulation_steps: int = 1
    max_completion_length: int = 400  # above the longest taught scratchpad (26 lines, 351 tokens)
    eval_every: int = 8

    def lengths(self) -> LengthSettings:
        return LengthSettings(median_steps=self.median_steps, sigma=self.sigma, min_steps=self.min_steps,
                              max_steps=self.max_steps_per_problem)  # fmt: skip

    def per_device_train_batch_size(self) -> int:
        return split_generation_batch(self)

    def load_task(self, num_heldout: int | None = None, *, cache_dir=None, use_cache=True):
        """`(train problems, held-out problems, (model, tokenizer, from_cache))`, independent of the RL settings."""
        num_heldout = self.num_heldout if num_heldout is None else num_heldout
        train, heldout = make_chain_splits(self.num_train, num_heldout, seed=0, lengths=self.lengths())
        warm = WarmStartSettings(
            hidden_size=self.hidden_size, num_layers=self.num_layers, steps=self.warmup_steps,
            batch_size=self.warmup_batch_size, learning_rate=self.warmup_learning_rate,
            target_accuracy=self.warmup_target_accuracy, check_every=self.warmup_check_every,
            max_position_embeddings=1024, group_by_length=True, problems=train,
        )  # fmt: skip
        return train, heldout, load_or_warm_start(warm, cache_dir=cache_dir, use_cache=use_cache, log=print)

    def final_heldout(self, count: int, train: list[ChainProblem], heldout: list[ChainProblem]) -> list[ChainProblem]:
        """`count` problems for a final evaluation, none of them a training problem or a curve (`heldout`) problem.

        A draw of its own seed, after the splits: the training problems, and with them the warm start (keyed by what
        it teaches), are the same whatever `count` is. Drawn from the task's distribution less the problems already
        used, so it leans slightly towards the rarer (longer) chains that the training draw covered less densely."""
        if count < 1:
            raise ValueError(f"final_heldout={count} must be a positive integer (problems in the final evaluation).")
        return generate_chains(count, seed=self.final_heldout_seed, lengths=self.lengths(), exclude={*train, *heldout})
