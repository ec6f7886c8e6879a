"""Realistic planted bugs: apply each single bug to a temporary copy of the repository, run the tests that should
catch it, and report caught / not caught.

Usage: python scripts/planted_bugs.py [--only ID ...] [--json OUT]   (from the repository root, in the venv)

Each bug is one text replacement in `dhpo_trl/`, anchored on one line that states the computation (not on line
numbers). When the named file no longer holds the anchor, the one file of `dhpo_trl/` that holds it exactly once is
used (code moved by a refactor keeps its bug); an anchor found nowhere, or in several places, is reported as
"needs re-anchoring", never silently skipped. A bug is caught when pytest fails on the listed test files.

A hang is a failure too, reported as "caught (hang, killed)": pytest runs in a session of its own, and when it
runs past --timeout, or a test's own process timeout fired inside it (TimeoutExpired in its output), every process
of its tree is stopped (`tests/processes.kill_tree`: torchrun's workers sit in sessions of their own, and a rank
blocked in a collective ignores SIGTERM, hence SIGKILL after the grace period). Afterwards every process still
running from the bug's temporary copy (its path on the command line, or as working directory) is listed, killed,
and the result says "NOT killed" with their number. docs/testing.md lists the bug classes and the tests that catch
them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import processes  # noqa: E402 - kills the whole process group of a run (torchrun workers included)

MATRIX = ["tests/test_feature_matrix.py"]
LOSSES = ["tests/test_losses.py"]
REPLAY = ["tests/test_routing_replay.py", "tests/test_routing_replay_trainer.py"]
REPLAY_TRAINER = ["tests/test_routing_replay_trainer.py"]
ROLLOUT = ["tests/test_rollout_routing.py", "tests/test_routing_replay_rollout.py"]
ZERO3_FORWARDS = ["tests/test_zero3_forwards.py"]
GUARDS = ["tests/test_guard_limits.py", "tests/test_hostile_completions.py"]
COMPILE = ["tests/test_torch_compile.py"]

# id: (file, anchor, replacement, test files, what the bug is)
BUGS = {
    "tool-mask-dropped": (
        "dhpo_trl/training/batching.py",
        'return mask * batch["tool_mask"] if batch.get("tool_mask") is not None else mask',
        'return mask',
        MATRIX, "tool-output tokens train as if the model wrote them",
    ),
    "grpo-row-mean-over-width": (
        "dhpo_trl/core/aggregation.py",
        'return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / window.sequences',
        'return ((per_token_loss * mask).sum(-1) / mask.size(-1)).sum() / window.sequences',
        MATRIX, "eq. 7's per-response mean divides by the padded width (a wrong denominator)",
    ),
    "dapo-normaliser-without-processes": (
        "dhpo_trl/core/aggregation.py",
        'return num_items_in_batch.clamp(min=1.0) / num_processes * accumulation_share',
        'return num_items_in_batch.clamp(min=1.0) * accumulation_share',
        MATRIX, "dapo's token normaliser forgets DDP's mean over processes (right on one process only)",
    ),
    "entropy-bonus-sign": (
        "dhpo_trl/training/trainer.py",
        'loss = loss - entropy_control.applied(self._entropy_state(), entropy_control.control_of(self.args)) * bonus',
        'loss = loss + entropy_control.applied(self._entropy_state(), entropy_control.control_of(self.args)) * bonus',
        MATRIX, "the entropy bonus penalises entropy",
    ),
    "entropy-bonus-not-per-accumulation": (
        "dhpo_trl/core/aggregation.py",
        'return mean * window.share(mask.sum())',
        'return mean',
        MATRIX, "TRL's per-micro-batch entropy bonus is not divided by the accumulation steps",
    ),
    "adaptive-gate-ignored": (
        "dhpo_trl/core/entropy_control.py",
        'return coef if last_world_entropy <= target else 0.0',
        'return coef',
        MATRIX, "the adaptive coefficient applies before any step measured the entropy (and above the target)",
    ),
    "aux-loss-per-micro-step": (
        "dhpo_trl/training/trainer.py",
        'loss = loss + self.router_aux_loss_coef * aux_loss / window.passes',
        'loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps',
        MATRIX, "the MoE aux loss is divided by the micro-steps, not the forward passes, under a token budget",
    ),
    "top-entropy-mask-not-applied": (
        "dhpo_trl/training/trl_mirror.py",
        "per_token_loss = per_token_loss * entropy_mask",
        "per_token_loss = per_token_loss",
        MATRIX, "top_entropy_quantile < 1 computes its mask but the loss keeps every token",
    ),
    "grpo-rows-of-the-micro-batch": (
        "dhpo_trl/core/aggregation.py",
        'return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / window.sequences',
        'return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / per_token_loss.size(0)',
        MATRIX, "eq. 7 divides a dynamically cut micro-batch by its own rows, not the window's",
    ),
    "kl-direction-reversed": (
        "dhpo_trl/training/trl_mirror.py",
        'log_ratio = torch.where(mask.bool(), ref_per_token_logps - per_token_logps, 0.0)',
        'log_ratio = torch.where(mask.bool(), per_token_logps - ref_per_token_logps, 0.0)',
        ["tests/test_trainer.py", "tests/test_metrics.py", "tests/test_dynamic_batching.py"],
        "the k3 KL estimator of KL(pi_ref || pi) instead of KL(pi || pi_ref) (TRL's)",
    ),
    "sequence-ratio-metric-over-empty-rows": (
        "dhpo_trl/core/metrics.py",
        'sums["sequence_ratio"] = (sequence_ratio * rows).sum()',
        'sums["sequence_ratio"] = sequence_ratio.sum()',
        ["tests/test_metrics.py", "tests/test_metrics_distributed.py"],
        "the sequence-ratio mean counts all-padding rows (ratio 1) in its numerator",
    ),
    "sequence-log-ratio-over-width": (
        "dhpo_trl/core/losses.py",
        "return (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)",
        "return (log_ratio * mask).sum(-1) / mask.size(-1)",
        LOSSES + MATRIX, "log s_i (eq. 4) averages over all columns, padding included",
    ),
    "entropy-min-max-over-padding": (
        "dhpo_trl/core/losses.py",
        "low, high = entropies[valid].min(), entropies[valid].max()",
        "low, high = entropies.min(), entropies.max()",
        LOSSES + MATRIX, "DHPO-E's min-max normalisation sees padding entropies",
    ),
    "token-clip-bounds-swapped": (
        "dhpo_trl/core/losses.py",
        "token_low, token_high = 1.0 - epsilon_low_token, 1.0 + epsilon_high_token",
        "token_low, token_high = 1.0 - epsilon_high_token, 1.0 + epsilon_low_token",
        LOSSES + MATRIX, "the token trust region's lower and upper epsilons are swapped",
    ),
    "sequence-ratio-not-stop-gradient": (
        "dhpo_trl/core/losses.py",
        "sequence_ratio = torch.exp(sequence_log_ratio(log_ratio, mask)).detach()  # eq. 4, sg[s_i]",
        "sequence_ratio = torch.exp(sequence_log_ratio(log_ratio, mask))  # eq. 4, sg[s_i]",
        LOSSES + MATRIX, "s_i carries a gradient (eq. 5 wants sg[s_i]): a missing detach",
    ),
    "gmpo-pessimism-reversed": (
        "dhpo_trl/core/losses.py",
        "pessimistic_log_ratio = sign * torch.min(sign * log_ratio, sign * clipped_log_ratio)",
        "pessimistic_log_ratio = sign * torch.max(sign * log_ratio, sign * clipped_log_ratio)",
        LOSSES, "GMPO takes the optimistic of the clipped and unclipped log-ratio",
    ),
    "prompt-trimmed-from-the-wrong-side": (
        "dhpo_trl/training/batching.py",
        "value = value[:, value.size(1) - prompt_width :]",
        "value = value[:, :prompt_width]",
        ["tests/test_batching.py", "tests/test_plan_optimum.py", "tests/test_dynamic_batching.py"],
        "a left-padded prompt is trimmed on the right: real prompt tokens are cut, padding kept",
    ),
    "greedy-cap-off-by-one": (
        "dhpo_trl/training/batching.py",
        "if row > start and (row + 1 - start) * sum(self._widths(candidate, self.completion[row])) > cap:",
        "if row > start and (row - start) * sum(self._widths(candidate, self.completion[row])) > cap:",
        ["tests/test_batching.py", "tests/test_plan_optimum.py", "tests/test_dynamic_batching.py"],
        "the greedy cut counts one row too few: groups exceed the cap / token budget",
    ),
    "last-number-becomes-first": (
        "dhpo_trl/scoring/rewards.py",
        "return numbers[-1] if numbers else None",
        "return numbers[0] if numbers else None",
        ["tests/test_rewards.py"], "the fallback answer is the first number of the completion, not the last",
    ),
    # An undetached pi_old, the length plan's sort key and widths, the window's token count, an unagreed pass count.
    "on-policy-pi-old-not-detached": (
        "dhpo_trl/training/trainer.py",
        "old_per_token_logps = per_token_logps.detach()",
        "old_per_token_logps = per_token_logps",
        MATRIX, "on-policy pi_old keeps its graph: every ratio's gradient cancels and GRPO stops learning",
    ),
    "sort-key-ignores-prompt-length": (
        "dhpo_trl/training/batching.py",
        "self.order = sorted(range(len(prompt)), key=lambda row: (completion[row], prompt[row]))",
        "self.order = sorted(range(len(prompt)), key=lambda row: completion[row])",
        ["tests/test_batching.py", "tests/test_plan_optimum.py"], "rows sorted by one of their two lengths",
    ),
    "round-up-an-aligned-width": (
        "dhpo_trl/training/batching.py",
        "width = math.ceil(width / multiple) * multiple",
        "width = (width // multiple + 1) * multiple",
        ["tests/test_batching.py", "tests/test_plan_optimum.py"], "pad_to_multiple_of adds a block to a width already aligned",
    ),
    "window-tokens-drop-the-tool-mask": (
        "dhpo_trl/training/batching.py",
        "return planned_window(loss_mask(window), passes, dapo)",
        'return planned_window(window["completion_mask"], passes, dapo)',
        MATRIX, "the window's token count includes tool-output tokens that some runs mask",
    ),
    "pass-count-not-agreed": (
        "dhpo_trl/training/collectives.py",
        'return [int(value) for value in reduce(torch.tensor([float(v) for v in values]), "max").tolist()]',
        "return [int(value) for value in values]",
        MATRIX, "each process runs its own number of forwards: ZeRO-3 hangs, DDP desynchronises",
    ),
    "question-rule-case-sensitive": (
        "dhpo_trl/scoring/golds.py",
        "    re.IGNORECASE,\n)",
        "    0,\n)",
        ["tests/test_golds.py"], "'Find the Equation of the line' no longer keeps the equation",
    ),
    "shared-prefix-keys-detached": (
        "dhpo_trl/training/shared_prompts.py",
        "k, v = torch.cat([keys[prefix], k], 2), torch.cat([values[prefix], v], 2)",
        "k, v = torch.cat([keys[prefix].detach(), k], 2), torch.cat([values[prefix], v], 2)",
        ["tests/test_shared_prompts.py"], "a shared prompt's keys get no gradient from its completions (same log-probs)",
    ),
    "shared-suffix-positions-off-by-one": (
        "dhpo_trl/training/shared_prompts.py",
        "start = prompt - 1 if shared else 0",
        "start = prompt if shared else 0",
        ["tests/test_shared_prompts.py"], "a completion's positions continue one past the prompt's",
    ),
    "shared-suffix-mask-hides-the-diagonal": (
        "dhpo_trl/training/shared_prompts.py",
        ".tril(width))",
        ".tril(width - 1))",
        ["tests/test_shared_prompts.py"], "a completion token does not attend to itself (mask off by one)",
    ),
    "shared-row-tokens-miss-the-repeated-token": (
        "dhpo_trl/training/shared_prompts.py",
        "return prompt - 1 + len(members) + completions",
        "return prompt - 1 + completions",
        ["tests/test_shared_prompts.py"], "the plan's token count forgets each suffix's repeated last prompt token",
    ),
    # Kinds not in the lists above. The cross-process ones are caught by the
    # two-process cells of the feature matrix; the resume and gold ones by behaviour tests written for them.
    "top-entropy-quantile-over-tool-tokens": (
        "dhpo_trl/training/trl_mirror.py",
        "entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)",
        'entropy_mask = trainer.get_high_entropy_mask(entropies, inputs["completion_mask"], 1 - trainer.top_entropy_quantile)',
        MATRIX, "the top-entropy quantile is taken over tool-output tokens too (the wrong mask)",
    ),
    "global-entropy-range-not-reduced": (
        "dhpo_trl/training/trainer.py",
        "_, maxima = self._reduce({}, metrics.entropy_range_maxima(entropies, mask))",
        "maxima = metrics.entropy_range_maxima(entropies, mask)",
        MATRIX, "entropy_norm_scope='global' takes DHPO-E's min-max on this process only",
    ),
    "adaptive-world-entropy-not-reduced": (
        "dhpo_trl/training/trainer.py",
        'sums, _ = self._reduce({"sum": state.window[0], "count": state.window[1]}, {})',
        'sums = {"sum": float(state.window[0]), "count": float(state.window[1])}',
        MATRIX, "the adaptive controller reads this process's window entropy, not the world's",
    ),
    "gsm8k-first-hashes": (
        "dhpo_trl/scoring/golds.py",
        'text = text.rsplit("####", 1)[1].replace(",", "")',
        'text = text.split("####", 1)[1].replace(",", "")',
        ["tests/test_golds.py"], "a GSM8K gold is read after its first ####, not its last",
    ),
    "large-negative-float-gold": (
        "dhpo_trl/scoring/golds.py",
        "return str(int(raw)) if raw.is_integer() and abs(raw) < 1e16 else repr(raw)",
        "return str(int(raw)) if raw.is_integer() and raw < 1e16 else repr(raw)",
        ["tests/test_golds.py"], "-1e23 becomes -99999999999999991611392 (the bound forgets the sign)",
    ),
    "base-digit-equal-to-the-base": (
        "dhpo_trl/scoring/golds.py",
        "not all(int(d, 36) < int(match[2]) for d in match[1])",
        "not all(int(d, 36) <= int(match[2]) for d in match[1])",
        ["tests/test_golds.py"], "18_8 is read as a base-8 number (a digit equal to the base; off by one)",
    ),
    "one-option-makes-a-choice": (
        "dhpo_trl/scoring/golds.py",
        'len(set(re.findall(r"\(([A-E])\)", question))) >= 2',
        'len(set(re.findall(r"\(([A-E])\)", question))) >= 1',
        ["tests/test_golds.py"], "a question with one '(A)' makes the gold letter a multiple-choice answer",
    ),
    "bracket-display-math-ignored": (
        "dhpo_trl/scoring/golds.py",
        r'segments = re.findall(r"\$\$?(.+?)\$\$?|\\\((.+?)\\\)|\\\[(.+?)\\\]", question, re.DOTALL)',
        r'segments = re.findall(r"\$\$?(.+?)\$\$?|\\\((.+?)\\\)", question, re.DOTALL)',
        ["tests/test_golds.py"], "a variable named only in \\[...\\] display math is dropped as a unit letter",
    ),
    "unit-letter-case-sensitive": (
        "dhpo_trl/scoring/golds.py",
        "if question is None or not match or match[2].lower() not in _UNIT_WORDS:",
        "if question is None or not match or match[2] not in _UNIT_WORDS:",
        ["tests/test_golds.py"], "'250 mL' keeps its unit (the unit words are lower case)",
    ),
    "checkpoints-sorted-by-name": (
        "dhpo_trl/training/resume.py",
        "((checkpoint_step(name), os.path.join(output_dir, name)) for name in os.listdir(output_dir)",
        "((name, os.path.join(output_dir, name)) for name in os.listdir(output_dir)",
        ["tests/test_resume.py"], "'latest' picks checkpoint-9 over checkpoint-10 (sorted as text)",
    ),
    "deepspeed-checkpoint-weights-only": (
        "dhpo_trl/training/resume.py",
        'weights_only = not any(name.startswith(("optimizer", "global_step")) for name in names)',
        'weights_only = not any(name.startswith("optimizer") for name in names)',
        ["tests/test_resume.py"], "an older DeepSpeed checkpoint (optimizer in global_step<N>/) is refused",
    ),
    "rerun-keeps-the-generation-buffer": (
        "dhpo_trl/training/trainer.py",
        "callbacks = resume.start_fresh(self) if checkpoint is None else resume.restore(self, checkpoint)",
        "callbacks = [] if checkpoint is None else resume.restore(self, checkpoint)",
        ["tests/test_notebook_session.py"], "train() again after an interrupt trains on the old run's buffered rest",
    ),
    "rerun-keeps-the-entropy-controller": (
        "dhpo_trl/training/resume.py",
        "trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = entropy_control.initial(",
        "_ = entropy_control.initial(",
        ["tests/test_notebook_session.py::test_a_second_train_is_the_run_a_new_trainer_does_from_the_same_weights"],
        "train() again starts the adaptive entropy coefficient where the last run left it, not at entropy_coef",
    ),
    "rerun-keeps-the-random-state": (
        "dhpo_trl/training/resume.py",
        "set_seed(trainer.args.seed, device_specific=True)  # as TRL's __init__ seeds, last",
        "pass",
        ["tests/test_notebook_session.py::test_a_second_train_is_the_run_a_new_trainer_does_from_the_same_weights"],
        "train() again generates from the last run's random state, not from seed",
    ),
    "rerun-keeps-the-optimizer": (
        "dhpo_trl/training/resume.py",
        "trainer.optimizer = None  # transformers makes a new one as training starts",
        "pass",
        ["tests/test_notebook_session.py::test_a_second_train_is_the_run_a_new_trainer_does_from_the_same_weights",
         "tests/test_notebook_session.py::test_a_train_after_a_resumed_run_is_the_run_a_new_trainer_does_from_the_same_weights"],
        "train() again, or a resume on the same trainer, steps with the last run's Adam moments and step count",
    ),
    "first-train-reseeds": (
        "dhpo_trl/training/resume.py",
        "if trainer._last_run is not None:",
        "set_seed(trainer.args.seed, device_specific=True)\n    if trainer._last_run is not None:",
        ["tests/test_notebook_session.py::test_a_seed_set_after_building_the_trainer_acts_on_its_first_train"],
        "the first train() seeds again from `seed`: a seed the caller set after building the trainer does not act",
    ),
    "rerun-drops-the-callers-optimizer": (
        "dhpo_trl/training/resume.py",
        "if trainer.optimizer is not None and any(trainer.optimizer is optimizer for optimizer in made):",
        "if trainer.optimizer is not None:",
        ["tests/test_notebook_session.py::test_an_optimizer_the_caller_set_or_passed_steps_every_train"],
        "train() again replaces the optimizer the caller set or passed with the AdamW transformers makes",
    ),
    "last-run-recorded-at-train-end": (
        "dhpo_trl/training/resume.py",
        "def on_train_begin(self, args, state, control, **kwargs):\n        trainer, self.trainer = self.trainer, None",
        "def on_train_end(self, args, state, control, **kwargs):\n        trainer, self.trainer = self.trainer, None",
        ["tests/test_notebook_session.py::test_a_second_train_is_the_run_a_new_trainer_does_from_the_same_weights"],
        "a run an interrupt cut short is not recorded: train() again keeps its random state and Adam's moments",
    ),
    "last-run-records-the-inner-optimizer": (
        "dhpo_trl/training/resume.py",
        "self.optimizer = trainer.optimizer if self.made else None",
        'self.optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer) if self.made else None',
        ["tests/test_notebook_session.py::test_a_second_train_is_the_run_a_new_trainer_does_from_the_same_weights"],
        "the run's optimizer recorded without accelerate's wrapper: never the trainer's, so train() again keeps it",
    ),
    "failed-train-keeps-its-optimizer": (
        "dhpo_trl/training/resume.py",
        "    if trainer._making_optimizer and isinstance(trainer.optimizer, AcceleratedOptimizer):",
        "    if False:",
        ["tests/test_notebook_session.py::test_a_train_after_one_that_failed_as_it_began_is_the_run_a_new_trainer_does"],
        "the optimizer a train() that failed before its run began made is the caller's to every later run, moments too",
    ),
    "failed-train-drops-the-callers-optimizer": (
        "dhpo_trl/training/resume.py",
        "    if trainer._making_optimizer and isinstance(trainer.optimizer, AcceleratedOptimizer):",
        "    if trainer._making_optimizer:",
        ["tests/test_notebook_session.py::test_an_optimizer_the_caller_sets_after_a_train_that_failed_as_it_began_steps_every_train"],
        "after a train() that failed before its run began, an optimizer the caller set since is replaced by AdamW",
    ),
    "new-run-keeps-the-vllm-step": (
        "dhpo_trl/training/resume.py",
        "    if trainer.use_vllm:\n        trainer._last_loaded_step = -1\n    drop_made_optimizer(trainer)",
        "    drop_made_optimizer(trainer)",
        ["tests/test_resume_vllm.py::test_a_second_train_sends_the_weights_before_its_first_generation",
         "tests/test_resume_vllm.py::test_a_resume_in_the_same_trainer_sends_the_checkpoints_weights_before_its_first_generation"],
        "train() again, or a resume in the same trainer, generates from the weights vLLM got in the last run, not the "
        "model's",
    ),
    "rerun-logs-the-interrupted-evaluation": (
        "dhpo_trl/training/resume.py",
        'trainer._metrics = {mode: defaultdict(list) for mode in trainer._metrics}  # "train", "eval"',
        'trainer._metrics["train"] = defaultdict(list)',
        ["tests/test_notebook_session.py::test_a_second_train_logs_none_of_the_metrics_an_interrupted_evaluation_left"],
        "train() again logs an interrupted evaluation's metrics with its first evaluation's",
    ),
    "rerun-logs-the-interrupted-reward-metrics": (
        "dhpo_trl/training/resume.py",
        "trainer._pending_metrics.clear()",
        "pass",
        ["tests/test_notebook_session.py::test_a_second_train_logs_none_of_the_metrics_an_interrupted_reward_call_left"],
        "train() again logs a reward function's metric from the batch an interrupt cut short with its first batch's",
    ),
    "over-budget-counts-left-from-before": (
        "dhpo_trl/training/trainer.py",
        "pop_grading_counts()  # process-wide: those graded before (an evaluation, a reward call cut short) are not its",
        "pass",
        ["tests/test_trainer.py::test_over_budget_is_the_training_batch_own_count_not_a_held_out_evaluations",
         "tests/test_trainer.py::test_over_budget_after_an_interrupted_reward_call_is_the_next_batch_own_count"],
        "reward/over_budget adds a held-out evaluation's cut answers, or an interrupted batch's, to the next batch's",
    ),
    "config-after-trainer-unguarded": (
        "dhpo_trl/training/trainer.py",
        "main, processes = session.check_accelerate_state(self.accelerator)",
        "main, processes = self.accelerator.is_main_process, self.accelerator.num_processes",
        ["tests/test_notebook_session.py"], "train() after a newer config dies inside accelerate (AttributeError)",
    ),
    "finished-run-resumed": (
        "dhpo_trl/training/resume.py",
        "    if 0 < max_steps <= step:",
        "    if 0 < max_steps < step:",
        ["tests/test_notebook_session.py"], "a checkpoint at max_steps resumes and trains one step past it",
    ),
    "epoch-run-resume-refused": (
        "dhpo_trl/training/resume.py",
        "    if 0 < max_steps <= step:",
        "    if max_steps <= step:",
        ["tests/test_notebook_session.py"], "an epoch-based run (max_steps=-1) is refused at every resume",
    ),
    "fractional-epochs-resumed": (
        "dhpo_trl/training/resume.py",
        "    check_epochs_unfinished(trainer, checkpoint)\n",
        "",
        ["tests/test_notebook_session.py"], "a run finished by num_train_epochs=1.5 resumes one step past its end",
    ),
    "new-setting-unchecked": (
        "dhpo_trl/training/resume.py",
        "return [name for name in dict.fromkeys([*saved, *current]) if saved.get(name) != current.get(name)]",
        "return [name for name in saved if saved.get(name) != current.get(name)]",
        ["tests/test_resume.py"], "a setting the checkpoint did not record is never compared",
    ),
    "older-checkpoint-step-without-accumulation": (
        "dhpo_trl/training/resume.py",
        "trainer._step = global_step * trainer.args.gradient_accumulation_steps",
        "trainer._step = global_step",
        ["tests/test_resume.py"], "an older checkpoint resumes its micro-step counter at optimizer steps",
    ),
    # Bugs in the update-path seam and the entropy controller.
    "entropy-window-not-reset": (
        "dhpo_trl/core/entropy_control.py",
        "return State(coef, world_entropy, None)",
        "return State(coef, world_entropy, state.window)",
        ["tests/test_entropy_control.py"] + MATRIX,
        "the adaptive controller's window keeps the previous steps' entropy (an unbounded running mean)",
    ),
    "budget-passes-not-agreed": (
        "dhpo_trl/training/batching.py",
        "return [math.ceil(count / micro_steps) for count in agree(needed)]",
        "return [math.ceil(count / micro_steps) for count in needed]",
        ["tests/test_batching.py", "tests/test_shared_prompts.py", "tests/test_padding_free.py"],
        "a token budget's pass count is each process's own (ZeRO-3 hangs, DDP desynchronises)",
    ),
    "no-grad-forwards-ignore-the-budget": (
        "dhpo_trl/training/batching.py",
        "return count if budget is None else agree([max(count, needed())])[0]",
        "return count if budget is None else agree([count])[0]",
        ["tests/test_dynamic_batching.py", "tests/test_padding_free.py", "tests/test_shared_prompts.py"],
        "the old / reference log-prob passes keep TRL's chunk count whatever the token budget",
    ),
    "automatic-ignores-trl-settings": (
        "dhpo_trl/training/update_path.py",
        "if trl_only is not None:  # the config refuses an explicit request: only the automatic choice gets here",
        "if False:",
        ["tests/test_update_path.py", "tests/test_trainer_paths.py"],
        "loss_type='bnpo' is dynamically batched: its per-micro-batch normaliser changes meaning",
    ),
    "empty-sequence-guard-past-the-prompt": (
        "dhpo_trl/training/packing.py",
        "mask[~mask.any(1), max(prompt_width - 1, 0)] = True",
        "mask[~mask.any(1), prompt_width] = True",
        ["tests/test_padding_free.py", "tests/test_shared_prompts.py"],
        "a sequence with no attended token forwards its first completion column, not its last prompt column",
    ),
    "replayed-gate-not-renormalised": (
        "dhpo_trl/training/routing_replay.py",
        'weights = weights / weights.sum(dim=-1, keepdim=True)',
        'weights = weights',
        REPLAY, "replayed gate weights skip the renormalisation the model applies (norm_topk_prob, Mixtral)",
    ),
    "replayed-gate-detached": (
        "dhpo_trl/training/routing_replay.py",
        'weights = F.softmax(router_logits.float(), dim=-1).gather(-1, experts.long())',
        'weights = F.softmax(router_logits.detach().float(), dim=-1).gather(-1, experts.long())',
        REPLAY, "replayed gate weights from detached logits: the router gets no gradient",
    ),
    "replay-counted-on-recompute": (
        "dhpo_trl/training/routing_replay.py",
        'if layer not in forward.counted:',
        'if True:',
        REPLAY, "gradient checkpointing's recomputed forward counts the replayed decisions again",
    ),
    "shared-prompt-prefix-dropped": (
        "dhpo_trl/training/routing_replay.py",
        'keys = keys + offsets[segment]',
        'keys = keys',
        REPLAY, "a shared-prompt completion's keys forget the prompt before it",
    ),
    "reference-pass-not-replayed": (
        "dhpo_trl/training/routing_replay.py",
        'with self.hooks.replay(held["routing"]):',
        'with self.hooks.record():',
        REPLAY_TRAINER, "the reference pass routes live instead of replaying pi_old's routing",
    ),
    "policy-pass-not-replayed": (
        "dhpo_trl/training/routing_replay.py",
        'with self.hooks.replay(from_rows(batch[ROUTED_EXPERTS], *sequence_inputs(batch))) as stats:',
        'with contextlib.nullcontext(Stats()) as stats:',
        REPLAY_TRAINER, "the policy pass routes live: routing_replay='old' acts nowhere",
    ),
    "rollout-prompt-routing-of-the-first-prompt": (
        "dhpo_trl/training/rollout_routing.py",
        'prompt_routing = decode_experts(own if own is not None else shared[prompt], f"prompt_routed_experts[{prompt}]")',
        'prompt_routing = decode_experts(own if own is not None else shared[0], f"prompt_routed_experts[{prompt}]")',
        ROLLOUT, "R3: every choice gets the first prompt's routing from the reply, not its own prompt's",
    ),
    "rollout-experts-not-transposed": (
        "dhpo_trl/training/rollout_routing.py",
        "experts = torch.from_numpy(np.concatenate([rows for _, rows in samples])).permute(1, 0, 2).contiguous()",
        "experts = torch.from_numpy(np.concatenate([rows for _, rows in samples])).reshape(-1, ids.numel(), "
        "samples[0][1].shape[2])",
        ROLLOUT, "R3: (tokens, layers, top_k) rows reshaped, not transposed, to (layers, tokens, top_k)",
    ),
    "rollout-slice-of-process-0": (
        "dhpo_trl/training/rollout_routing.py",
        "every, start = held[0], accelerator.process_index * len(prompts)",
        "every, start = held[0], 0",
        ROLLOUT, "R3: every process keeps the routing of process 0's completions",
    ),
    "rollout-colocated-engine-without-routing": (
        "dhpo_trl/training/rollout_routing.py",
        "vllm_generation.LLM = functools.partial(build, enable_return_routed_experts=True)",
        "vllm_generation.LLM = build",
        ROLLOUT, "R3 colocated: TRL's engine is built without enable_return_routed_experts",
    ),
    "rollout-last-token-fill-shifts": (
        "dhpo_trl/training/rollout_routing.py",
        "completion_routing = np.concatenate([completion_routing, completion_routing[-1:]])",
        "completion_routing = np.concatenate([completion_routing[:1], completion_routing])",
        ROLLOUT, "R3: the missing last token's routing is filled at the front, shifting the completion's by one",
    ),
    "rollout-log-prob-passes-record-live": (
        "dhpo_trl/training/routing_replay.py",
        '                held["routing"] = self._batch_routing()\n            if held["routing"] is None:',
        '                pass\n            if held["routing"] is None:',
        ROLLOUT, "R3: the pi_old pass records its live routing instead of replaying the server's",
    ),
    "sapo-temperature-on-the-wrong-sign": (
        "dhpo_trl/core/losses.py",
        "temperature = torch.where(advantages > 0, temperature_pos, temperature_neg).to(ratio.dtype)",
        "temperature = torch.where(advantages < 0, temperature_pos, temperature_neg).to(ratio.dtype)",
        LOSSES, "SAPO's positive-advantage temperature gates the negative advantages",
    ),
    "luspo-mean-over-passes": (
        "dhpo_trl/core/aggregation.py",
        "return (per_token_loss * mask).sum() / window.sequences",
        "return (per_token_loss * mask).sum() / window.passes",
        LOSSES, "LUSPO's per-response sum is divided by the accumulation passes, not the responses (a wrong denominator)",
    ),
    "vespo-mean-log-ratio": (
        "dhpo_trl/core/losses.py",
        "log_w = (log_ratio * mask.to(log_ratio.dtype)).sum(-1, keepdim=True)",
        "log_w = sequence_log_ratio(log_ratio, mask).unsqueeze(1)",
        LOSSES, "VESPO's sequence weight from the mean log-ratio (GSPO's) instead of the sum (the product of ratios)",
    ),
    # A no-gradient pass whose count is not agreed: caught only where every forward gathers parameters (ZeRO-3 with
    # stage3_param_persistence_threshold 0; the tiny models' parameters stay resident at DeepSpeed's default).
    "no-grad-forwards-not-agreed": (
        "dhpo_trl/training/batching.py",
        "return count if budget is None else agree([max(count, needed())])[0]",
        "return count if budget is None else max(count, needed())",
        ZERO3_FORWARDS, "the no-gradient passes over the generation batch run each process's own number of forwards",
    ),
    "packed-no-grad-rows-not-agreed": (
        "dhpo_trl/training/packing.py",
        "lambda: batching.rows_needed(lengths, budget),\n                                       budget, max_over_processes)",
        "lambda: batching.rows_needed(lengths, budget),\n                                       budget)",
        ZERO3_FORWARDS, "the packed path's no-gradient rows are this process's own count (the agreement not passed)",
    ),
    "dynamic-no-grad-chunks-not-agreed": (
        "dhpo_trl/training/batching.py",
        "lambda: plan.groups_needed(budget), budget,\n                          max_over_processes)",
        "lambda: plan.groups_needed(budget), budget)",
        ZERO3_FORWARDS, "dynamic batching's no-gradient chunks are this process's own count (the agreement not passed)",
    ),
    "shared-no-grad-rows-not-agreed": (
        "dhpo_trl/training/shared_prompts.py",
        "lambda: rows_needed(seqs, budget), budget,\n                                       max_over_processes)",
        "lambda: rows_needed(seqs, budget), budget)",
        ZERO3_FORWARDS, "shared rows' no-gradient passes are this process's own count (the agreement not passed)",
    ),
    "routing-recording-checked-on-rank-0": (
        "dhpo_trl/training/routing_replay.py",
        '                held["routing"] = out[0]\n                return result',
        '                held["routing"] = out[0]\n                if trainer.accelerator.is_main_process:\n'
        '                    with self.hooks.replay(held["routing"]):\n'
        '                        original(*args, **kwargs)\n                return result',
        ["tests/test_routing_replay_trainer.py::test_two_processes_replay_the_recorded_experts[zero3]"],
        "R2: rank 0 alone replays the recorded routing in one more no-gradient forward, to check it",
    ),
    "evaluation-gathered-on-rank-0-only": (
        "dhpo_trl/evaluation/callback.py",
        'gather_deepspeed3_params=getattr(args, "ds3_gather_for_generation", True),',
        'gather_deepspeed3_params=getattr(args, "ds3_gather_for_generation", True) and accelerator.is_main_process,',
        ["tests/test_evaluation_callback_distributed.py::"
         "test_zero3_gathers_the_weights_once_and_logs_single_process_scores"],
        "the evaluation's weights gathered for generation on rank 0 only; rank 1 generates from its partition",
    ),
    # The update path decided on a model whose attention a packed forward already switched.
    "packed-model-decides-on-its-dispatching-name": (
        "dhpo_trl/training/packing.py",
        "return implementation.removeprefix(DISPATCHING_PREFIX)",
        "return implementation",
        ["tests/test_update_path.py"],
        "a model that already ran packed reads as 'dhpo_packed_sdpa': a second trainer refuses or stops packing it",
    ),
    # Scoring from several threads at once.
    "grader-calls-interleaved": (
        "dhpo_trl/scoring/rewards.py",
        "        with self._lock:\n            results: dict[tuple[str, str], bool] = {}",
        "        if True:\n            results: dict[tuple[str, str], bool] = {}",
        ["tests/test_rewards.py"],
        "two threads' calls share the workers at once: a quick call's budget runs out behind another's slow answers",
    ),
    # Guard limits off by a factor, either way (each is approached from below and above).
    "integer-digits-limit-tenfold": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_INTEGER_DIGITS = 100 ", "MAX_INTEGER_DIGITS = 1000 ",
        GUARDS, "a 1000-digit integer reaches the parser",
    ),
    "exponent-limit-a-tenth": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_EXPONENT = 10_000 ", "MAX_EXPONENT = 1_000 ",
        GUARDS, "2^{1009} (an answer of the benchmarks) is refused",
    ),
    "power-digits-limit-doubled": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_POWER_DIGITS = 20_000 ", "MAX_POWER_DIGITS = 40_000 ",
        GUARDS, "twice the digits of powers reach sympy",
    ),
    "factorial-limit-tenfold": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_FACTORIAL = 1_000 ", "MAX_FACTORIAL = 10_000 ",
        GUARDS, "10000! reaches sympy",
    ),
    "binomial-limit-a-tenth": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_BINOMIAL = 10_000 ", "MAX_BINOMIAL = 1_000 ",
        GUARDS, "binom{5000}{2} is refused",
    ),
    "sum-terms-limit-tenfold": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_SUM_TERMS = 1_000 ", "MAX_SUM_TERMS = 10_000 ",
        GUARDS, "a sum of 10000 terms reaches sympy",
    ),
    "nesting-limit-halved": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_NESTING = 10 ", "MAX_NESTING = 5 ",
        GUARDS, "an answer nested 8 deep is refused",
    ),
    "matrix-separators-limit-doubled": (
        "dhpo_trl/scoring/_math_verify_core.py", "MAX_MATRIX_SEPARATORS = 64 ", "MAX_MATRIX_SEPARATORS = 128 ",
        GUARDS, "a 16x8 matrix reaches latex2sympy",
    ),
    "answer-length-limit-halved": (
        "dhpo_trl/scoring/rewards.py", "MAX_ANSWER_CHARS = 1_000 ", "MAX_ANSWER_CHARS = 500 ",
        GUARDS, "a boxed answer of 600 characters is not read",
    ),
    # The release at the end of a run.
    "release-without-barrier": (
        "dhpo_trl/training/teardown.py",
        "            dist.barrier()",
        "            pass",
        ["tests/test_teardown.py::test_two_processes_release_no_rank_before_every_rank_has_entered"],
        "a rank destroys its groups while its peer may still be in a collective with it",
    ),
    "deepspeed-engines-not-destroyed": (
        "dhpo_trl/training/teardown.py",
        "        engine.destroy()",
        "        pass",
        ["tests/test_teardown.py::test_release_destroys_every_deepspeed_engine"],
        "a ZeRO-3 engine's hooks stay: the engine, its optimizer and groups live on",
    ),
    # Routing replay's keys and rows, R3's reply, the update path's fallback, the resume marker, the grader's second
    # pass, the shared-prompt metric, the long task's splits, the epoch sampler, the release's keyword defaults.
    "routing-expert-zero-read-as-padding": (
        "dhpo_trl/training/routing_replay.py",
        "recorded = rows[:, :, 0, 0] >= 0",
        "recorded = rows[:, :, 0, 0] > 0",
        REPLAY, "a token routed to expert 0 in the first layer reads as padding in the batch's routing rows",
    ),
    "routing-positions-from-columns": (
        "dhpo_trl/training/routing_replay.py",
        "positions = (torch.cumsum(mask.long(), 1) - 1)[mask]",
        "positions = mask.nonzero(as_tuple=True)[1]",
        REPLAY, "a padded row's token positions are its columns: left padding changes every key",
    ),
    "routing-flips-counted-in-top-k-order": (
        "dhpo_trl/training/routing_replay.py",
        "return (live.sort(-1).values != replayed.sort(-1).values).any(-1)",
        "return (live != replayed).any(-1)",
        ["tests/test_routing_replay_counts.py"] + REPLAY,
        "moe/ flipped decisions count a top-k set listed in another order as a flip",
    ),
    "rollout-choices-read-choice-major": (
        "dhpo_trl/training/rollout_routing.py",
        "prompt = index // n",
        "prompt = index % n",
        ROLLOUT, "R3: a reply's choices read as choice-major: a choice gets another prompt's routing",
    ),
    "update-path-fallback-warns-every-step": (
        "dhpo_trl/training/update_path.py",
        "self.warned = True",
        "pass",
        ["tests/test_update_path.py", "tests/test_trainer_paths.py"],
        "a batch the path cannot plan warns at every generation batch, not once",
    ),
    "marker-misses-a-grown-file": (
        "dhpo_trl/training/resume.py",
        "if actual != size:",
        "if actual < size:",
        ["tests/test_resume_epochs.py::test_file_mismatch_names_the_first_differing_file",
         "tests/test_resume_epochs.py::test_latest_skips_a_checkpoint_whose_files_differ_from_the_marker"],
        "a checkpoint file overwritten with more bytes than the marker records is loaded",
    ),
    "grader-second-pass-keeps-the-short-deadline": (
        "dhpo_trl/scoring/rewards.py",
        "queue.append((index, timeout_s))  # the second pass, with the full deadline",
        "queue.append((index, deadline))  # the second pass, with the full deadline",
        ["tests/test_rewards.py"], "an answer that overran the first pass's short deadline is retried with it again",
    ),
    "grader-second-pass-skipped": (
        "dhpo_trl/scoring/rewards.py",
        "queue.append((index, timeout_s))  # the second pass, with the full deadline",
        "give_up(index)  # the second pass, with the full deadline",
        ["tests/test_rewards.py"], "an answer that overran the first pass's deadline scores 0 without a second pass",
    ),
    "grader-first-pass-planned-on-the-budget": (
        "dhpo_trl/scoring/rewards.py",
        "FIRST_PASS_SHARE * window * len(workers)",
        "FIRST_PASS_SHARE * budget_s * len(workers)",
        ["tests/test_rewards.py"], "with budget_s <= 1 s the first pass fills the answers' time: no slack, no second pass",
    ),
    "grader-budget-without-the-kill-margin": (
        "dhpo_trl/scoring/rewards.py",
        "window = max(budget_s - _KILL_MARGIN_S, budget_s / 2)",
        "window = budget_s",
        ["tests/test_rewards.py"], "a call whose last answer is stuck in C code returns the kill margin past its budget",
    ),
    "grader-overrun-counted-over-budget": (
        "dhpo_trl/scoring/rewards.py",
        "            results[pairs[index]] = False\n            overran.add(pairs[index])",
        "            overran.add(pairs[index])",
        ["tests/test_rewards.py"], "an answer over its full deadline is counted over the budget as well",
    ),
    "grader-stuck-answer-retried-past-the-budget": (
        "dhpo_trl/scoring/rewards.py",
        "if time.monotonic() < end:  # stuck past its deadline, not cut by the budget",
        "if True:  # stuck past its deadline, not cut by the budget",
        ["tests/test_rewards.py"], "an answer whose worker the budget's end killed is counted over its deadline",
    ),
    "grader-warm-up-after-ready": (
        "dhpo_trl/scoring/_math_verify_core.py",
        '    _warm_up()\n    print("ready", flush=True)',
        '    print("ready", flush=True)\n    _warm_up()',
        ["tests/test_rewards.py"], "the worker warms up after it says it is ready: the first call's answers pay for it",
    ),
    "shared-prompt-metric-forgets-repeated-tokens": (
        "dhpo_trl/training/shared_prompts.py",
        "shared += prompt - 1 + len(group) if shares(prompt, len(group)) else prompt * len(group)",
        "shared += prompt if shares(prompt, len(group)) else prompt * len(group)",
        ["tests/test_shared_prompts.py"],
        "batching/prompt_tokens_saved forgets each completion's repeated last prompt token",
    ),
    "long-task-heldout-in-train": (
        "dhpo_trl/demo/long_arithmetic.py",
        "train = generate_chains(num_train, seed=seed, lengths=lengths, exclude=set(heldout))",
        "train = generate_chains(num_train, seed=seed, lengths=lengths)",
        ["tests/test_long_task.py"], "the long task's held-out problems may also be training problems",
    ),
    "sampler-set-epoch-ignored": (
        "dhpo_trl/training/sampler.py",
        "self.epoch = int(epoch)",
        "pass",
        ["tests/test_resume_epochs.py::test_the_epoch_sampler_draws_trls_sequence_of_permutations"],
        "set_epoch is a no-op: a run resumed in a later epoch draws the first epoch's order",
    ),
    "teardown-keyword-defaults-kept": (
        "dhpo_trl/training/teardown.py",
        "if keywords and any(isinstance(value, ProcessGroup) for value in keywords.values()):",
        "if False:",
        ["tests/test_teardown_units.py", "tests/test_teardown.py::test_release_leaves_no_gloo_thread"],
        "a keyword-only default holding the world group keeps it (and its gloo threads) past the release",
    ),
    "release-skipped-with-a-live-group": (
        "dhpo_trl/training/teardown.py",
        "    if not holds_any_group(dist):",
        '    if "deepspeed.runtime.engine" not in sys.modules:',
        ["tests/test_teardown.py::test_release_leaves_no_gloo_thread"],
        "a DDP run's group (no DeepSpeed) is left to interpreter finalisation",
    ),
    "release-scans-without-a-group": (
        "dhpo_trl/training/teardown.py",
        "    return \"deepspeed.runtime.engine\" in sys.modules or bool(gloo_threads())",
        "    return True",
        ["tests/test_teardown.py::test_release_in_a_process_that_holds_no_group_scans_nothing"],
        "an input error's exit scans the heap three times (seconds in a large process)",
    ),
    "debug-keeps-the-nonfinite-line": (
        "dhpo_trl/scale_out/cli.py",
        'report("dhpo-train", error, debug=debug)',
        'report("dhpo-train", error)',
        ["tests/test_debug_flag.py"], "dhpo-train --debug prints a non-finite gradient norm on one line, no traceback",
    ),
    "debug-prints-the-line-instead": (
        "dhpo_trl/user_errors.py",
        "        traceback.print_exception(error, file=sys.stderr)",
        '        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)',
        ["tests/test_debug_flag.py"], "--debug shows the one-line message, no traceback, on every command",
    ),
    "debug-traces-a-usage-error": (
        "dhpo_trl/user_errors.py",
        "    if debug and not isinstance(error, UsageError):",
        "    if debug:",
        ["tests/test_debug_flag.py"], "dhpo-train --debug prints a traceback for an unknown flag, argparse's commands one line",
    ),
    "unknown-flag-a-value-error": (
        "dhpo_trl/scale_out/cli.py",
        'raise UsageError(f"Unrecognized argument(s): {_with_suggestions(flags, options)}{hint}.")',
        'raise ValueError(f"Unrecognized argument(s): {_with_suggestions(flags, options)}{hint}.")',
        ["tests/test_debug_flag.py"], "dhpo-train's own unknown-flag check is not a usage error: --debug traces it",
    ),
    "dhpo-train-parser-named-by-argv": (
        "dhpo_trl/scale_out/cli.py",
        'prog="dhpo-train", usage=USAGE',
        "usage=USAGE",
        ["tests/test_debug_flag.py"], "argparse's errors in dhpo-train carry the launched file's name (cli.py)",
    ),
    "config-help-dropped": (
        "dhpo_trl/core/config.py",
        'return field(default=default, metadata={"help": help})',
        "return field(default=default)",
        ["tests/test_cli_units.py::test_help_shows_every_dhpo_field_with_its_own_help"],
        "DHPOConfig's own fields lose their --help text",
    ),
    "worker-stop-signal-a-death": (
        "dhpo_trl/demo/cell_pool.py",
        "stopped = [signum.name for signum in STOP_SIGNALS if exitcode == -signum]",
        "stopped = []",
        ["tests/test_cell_pool.py::test_a_worker_that_a_stop_signal_ended_stops_the_block_with_its_status",
         "tests/test_study_stops.py"],
        "a SIGTERM to a study worker outside training (warm start, evaluation) ends the study with 1, not 143",
    ),
    "cell-pool-kills-every-child": (
        "dhpo_trl/demo/cell_pool.py",
        "    for process in list(workers):",
        "    for process in multiprocessing.active_children():",
        ["tests/test_cell_pool.py"], "a study's stop kills every child of the main process, not only the pool's",
    ),
    "cell-pool-reads-one-pid": (
        "dhpo_trl/demo/cell_pool.py",
        "    while not started.empty():",
        "    if not started.empty():",
        ["tests/test_cell_pool.py"],
        "the watchdog reads one report a poll: a worker that reported, then died, is said to have died starting",
    ),
    "cell-pool-kills-the-reported-only": (
        "dhpo_trl/demo/cell_pool.py",
        "if close(pool, context.workers):",
        "if close(pool, [p for p in context.workers if (p.pid, p.name) in drain(started, watchdog.reported)]):",
        ["tests/test_cell_pool.py"],
        "the stop kills only the workers that reported: a replacement still importing outlives the block",
    ),
    "cell-pool-exit-zero-is-no-death": (
        "dhpo_trl/demo/cell_pool.py",
        "ended = [(process, exitcode) for process, exitcode in ended if exitcode is not None]",
        "ended = [(process, exitcode) for process, exitcode in ended if exitcode not in (None, 0)]",
        ["tests/test_cell_pool.py"], "a cell's os._exit(0) ends its worker unnoticed: the study waits forever",
    ),
    "cell-pool-reaped-worker-not-a-death": (
        "dhpo_trl/demo/cell_pool.py",
        "ended = [(process, process.exitcode) for process in list(self.workers)]",
        "ended = [(process, process.exitcode) for process in multiprocessing.active_children() if process in self.workers]",
        ["tests/test_cell_pool.py::test_the_watchdog_reports_the_first_worker_that_died_reported_or_not_and_nothing_else"],
        "a worker that dies before the watchdog's look (reaped by the pool) leaves the study waiting forever",
    ),
    "cell-pool-unreported-death-ignored": (
        "dhpo_trl/demo/cell_pool.py",
        """        ended = [(process, exitcode) for process, exitcode in ended if exitcode is not None]
        # After the ends: a worker that reported had its report in the queue's pipe before it ended.
        drain(self.started, self.reported)""",
        """        drain(self.started, self.reported)
        ended = [(p, code) for p, code in ended if code is not None and (p.pid, p.name) in self.reported]""",
        ["tests/test_cell_pool.py"],
        "a worker whose import or initializer fails in the spawned process is replaced forever: the study hangs",
    ),
    "cell-pool-workers-unrecorded": (
        "dhpo_trl/demo/cell_pool.py",
        "pool = CellPool(workers, initializer=report_worker, initargs=(started,), context=context)",
        "pool = CellPool(workers, initializer=report_worker, initargs=(started,), context=multiprocessing.get_context('spawn'))",
        ["tests/test_cell_pool.py"], "the pool's workers are made through a context that keeps none: no death is seen",
    ),
    "cell-pool-start-death-said-a-lost-cell": (
        "dhpo_trl/demo/cell_pool.py",
        "return worker_end(process.name, process.pid, exitcode, (process.pid, process.name) in self.reported)",
        "return worker_end(process.name, process.pid, exitcode)",
        ["tests/test_cell_pool.py"],
        "a worker that died as it started is reported as a lost cell: the line hides what to fix before the rerun",
    ),
    "cell-pool-start-death-cause-swapped": (
        "dhpo_trl/demo/cell_pool.py",
        '    if exitcode < 0:\n        return "it was killed as it started',
        '    if exitcode > 0:\n        return "it was killed as it started',
        ["tests/test_cell_pool.py"], "a kill as a worker starts is blamed on its import, a failed import on memory",
    ),
    "cell-pool-watchdog-during-terminate": (
        "dhpo_trl/demo/cell_pool.py",
        """        try:
            watchdog.stop()  # before the pool's SIGTERMs: those are no death
        finally:
            # Also when a death found as the block ended is raised in `stop` (at most once: `take_death`).
            watchdog.join()  # the one reader of `started` until then
            if close(pool, context.workers):  # kills what a graceful stop or a cell would leave waiting
                pool.join()
            started.close()
            restore()""",
        """        try:
            close(pool, context.workers)  # kills what a graceful stop or a cell would leave waiting
            pool.join()
        finally:
            watchdog.stop()
            watchdog.join()
            restore()
            started.close()""",
        ["tests/test_cell_pool.py::test_a_block_that_ends_normally_keeps_its_results_and_leaves_no_worker"],
        "the pool's own SIGTERMs at the end of the block are reported as a dead worker",
    ),
    "cell-pool-terminate-waits-for-a-dead-lock": (
        "dhpo_trl/demo/cell_pool.py",
        """    closing.join(grace)  # the rest joins the pool's threads and dead workers, unless it waits for a dead one's lock
    return not closing.is_alive()""",
        """    closing.join()
    return True""",
        ["tests/test_cell_pool.py::test_close_terminates_the_pool_and_kills_the_workers_its_terminate_waits_for"],
        "a worker SIGKILLed as it waits for a task leaves the pool's terminate waiting for its lock: the study hangs",
    ),
    "cell-pool-cell-drops-its-name": (
        "dhpo_trl/demo/cell_pool.py",
        "raise CellExited(exit_message(self.func, args, kwargs, error)) from error",
        "raise CellExited(repr(error)) from error",
        ["tests/test_cell_pool.py"], "a cell's SystemExit(0) ends the study on a line that does not say which cell",
    ),
    "cell-pool-cell-passes-system-exit": (
        "dhpo_trl/demo/cell_pool.py",
        "        except self.carried as error:",
        "        except KeyboardInterrupt as error:",
        ["tests/test_cell_pool.py"], "a cell's SystemExit(0) ends its worker (status 0), reported as a death, unnamed",
    ),
    "cell-pool-map-runs-bare": (
        "dhpo_trl/demo/cell_pool.py",
        "return super().map(Cell(func), *args, **kwargs)",
        "return super().map(func, *args, **kwargs)",
        ["tests/test_cell_pool.py"], "a cell's SystemExit(0) under Pool.map ends its worker",
    ),
    "study-debug-read-from-argv-only": (
        "dhpo_trl/demo/cell_pool.py",
        "    debug = debug_given(sys.argv[1:] if argv is None else argv)",
        "    debug = debug_given(argv or [])",
        ["tests/test_cell_pool.py"], "a study's --debug on the command line (cli(None)) prints the line, no traceback",
    ),
    "staleness-parser-lacks-debug": (
        "benchmarks/staleness.py",
        "    parser.add_argument(DEBUG_FLAG, action=\"store_true\", help=DEBUG_HELP)  # acted on by `cli` (cell_pool.reported)",
        "",
        ["tests/test_debug_flag.py"], "staleness.py --debug is refused as an unrecognized argument (a command missed)",
    ),
    "debug-abbreviation-ignored": (
        "dhpo_trl/user_errors.py",
        "    return any(len(arg) > 2 and DEBUG_FLAG.startswith(arg) for arg in options)",
        "    return DEBUG_FLAG in options",
        ["tests/test_user_errors.py", "tests/test_cell_pool.py"],
        "--deb, which argparse takes for --debug, shows the one-line message on a study and dhpo-evaluate",
    ),
    "study-debug-traces-argparse-exit": (
        "dhpo_trl/demo/cell_pool.py",
        "        if not (debug and isinstance(exited.code, str)):",
        "        if not (debug and exited.code):",
        ["tests/test_cell_pool.py"], "a study's argparse usage error (SystemExit(2)) traced under --debug, status 1",
    ),
    "cell-pool-terminate-allowed": (
        "dhpo_trl/demo/cell_pool.py",
        "    def terminate(self) -> None:",
        "    def _terminate_refused(self) -> None:",
        ["tests/test_cell_pool.py"], "the block's pool.terminate() ends the workers, reported as deaths",
    ),
    "cell-pool-imap-unordered-runs-bare": (
        "dhpo_trl/demo/cell_pool.py",
        "return super().imap_unordered(Cell(func), *args, **kwargs)",
        "return super().imap_unordered(func, *args, **kwargs)",
        ["tests/test_cell_pool.py"], "a cell's SystemExit(0) under imap_unordered (staleness's way) ends its worker",
    ),
    "cell-carries-every-error": (
        "dhpo_trl/demo/cell_pool.py",
        """        except TrainingStopped:  # a stop: `reported` reports it as one
            raise
""",
        "",
        ["tests/test_cell_pool.py"], "a worker's TrainingStopped (a stop signal to it) is reported as a lost cell",
    ),
    "cell-message-spans-lines": (
        "dhpo_trl/demo/cell_pool.py",
        "    raised = \" \".join(repr(error).splitlines())",
        "    raised = repr(error)",
        ["tests/test_cell_pool.py"], "a cell's exit status with a multi-line repr breaks the one-line report",
    ),
    "staleness-one-worker-cell-bare": (
        "benchmarks/staleness.py",
        "map(Cell(_run_cell, (SystemExit,)), jobs)",
        "map(_run_cell, jobs)",
        ["tests/test_staleness.py"], "staleness --workers 1: a cell's SystemExit(0) ends the study, status 0, no page",
    ),
    "usage-error-no-value-error": (
        "dhpo_trl/user_errors.py",
        "class UsageError(ValueError):",
        "class UsageError(Exception):",
        ["tests/test_debug_flag.py"], "dhpo-train's unknown flag is no input error: a traceback and status 1",
    ),
    "debug-reports-every-error": (
        "dhpo_trl/user_errors.py",
        "    except USER_ERROR_TYPES as error:",
        "    except (Exception if debug else USER_ERROR_TYPES) as error:",
        ["tests/test_user_errors.py"], "--debug turns a bug in a command's setup into an input error's status 2",
    ),
    "config-warning-one-frame-too-far": (
        "dhpo_trl/core/config.py",
        "stacklevel=5,  # the caller of DHPOConfig(...)",
        "stacklevel=6,  # the caller of DHPOConfig(...)",
        ["tests/test_config.py"], "the on-policy warning names the line above the one that built the config",
    ),
    "config-checks-before-trl-resolves": (
        "dhpo_trl/core/config.py",
        "        super().__post_init__()  # TRL resolves steps_per_generation here\n        self._check_after_trl()",
        "        self._check_after_trl()\n        super().__post_init__()  # TRL resolves steps_per_generation here",
        ["tests/test_config.py"], "the batching check and the on-policy warning read steps_per_generation before TRL sets it",
    ),
    "watchdog-stopped-by-a-stray-sigchld": (
        "dhpo_trl/demo/cell_pool.py",
        "            if death is not None:\n                self.stopping.set()\n            return death",
        "            self.stopping.set()\n            return death",
        ["tests/test_cell_pool.py"], "another child's SIGCHLD stops the watchdog: a later dead worker hangs Pool.map",
    ),
    "watchdog-lock-not-reentrant": (
        "dhpo_trl/demo/cell_pool.py",
        "        self.lock = threading.RLock()",
        "        self.lock = threading.Lock()",
        ["tests/test_cell_pool.py"],
        "a child's SIGCHLD while the main thread holds the watchdog's lock deadlocks it: the study hangs",
    ),
    "cell-pool-stop-raised-while-closing": (
        "dhpo_trl/demo/cell_pool.py",
        "        if not ending:\n            raise stop\n",
        "        raise stop\n",
        ["tests/test_cell_pool.py"],
        "a stop signal as the block's end closes the pool leaves it running: the study waits for a graceful worker",
    ),
    "watchdog-names-the-last-death": (
        "dhpo_trl/demo/cell_pool.py",
        "process, exitcode = ended[0]",
        "process, exitcode = ended[-1]",
        ["tests/test_cell_pool.py"], "the line names the last failed replacement, not the first worker that died",
    ),
    "watchdog-reads-reports-before-ends": (
        "dhpo_trl/demo/cell_pool.py",
        """        ended = [(process, process.exitcode) for process in list(self.workers)]
        ended = [(process, exitcode) for process, exitcode in ended if exitcode is not None]
        # After the ends: a worker that reported had its report in the queue's pipe before it ended.
        drain(self.started, self.reported)""",
        """        drain(self.started, self.reported)
        ended = [(process, process.exitcode) for process in list(self.workers)]
        ended = [(process, exitcode) for process, exitcode in ended if exitcode is not None]""",
        ["tests/test_cell_pool.py"],
        "a worker that reports, then dies, as the watchdog looks is said to have died as it started: no cell lost",
    ),
    "cell-pool-sigchld-not-chained": (
        "dhpo_trl/demo/cell_pool.py",
        "        if callable(previous[signal.SIGCHLD]):\n            previous[signal.SIGCHLD](signum, frame)\n",
        "",
        ["tests/test_cell_pool.py"], "the program's own SIGCHLD handler is not called while the block runs",
    ),
    "close-kills-an-unstarted-worker": (
        "dhpo_trl/demo/cell_pool.py",
        "        if process.pid is not None:  # started",
        "        if process.exitcode is None:  # running",
        ["tests/test_cell_pool.py"],
        "the stop kills a worker the pool made but has not started: AttributeError, the pool left running",
    ),
    "profile-range-end-inclusive": (
        "dhpo_trl/training/step_profile.py",
        'return index >= 0 and event["start"] < windows[index][1]',
        'return index >= 0 and event["start"] <= windows[index][1]',
        ["tests/test_step_profile.py"], "an operator that starts as a micro-step's range ends is counted in it",
    ),
    "compile-packed-attention-traced": (
        "dhpo_trl/training/packing.py",
        "@torch.compiler.disable\ndef packed_sdpa_attention(",
        "def packed_sdpa_attention(",
        COMPILE, "torch_compile traces packed rows' attention: a compilation per row layout, then eager past the limit",
    ),
    "compile-shared-attention-traced": (
        "dhpo_trl/training/shared_prompts.py",
        "@torch.compiler.disable\ndef shared_sdpa_attention(",
        "def shared_sdpa_attention(",
        COMPILE, "torch_compile traces shared rows' attention: a compilation per row layout, then eager past the limit",
    ),
    "compile-fallback-not-taken": (
        "dhpo_trl/training/update_path.py",
        "reason = packing.automatic_reason(list(models.values()), device_type) or uncompiled",
        "reason = packing.automatic_reason(list(models.values()), device_type)",
        COMPILE, "padding_free=None packs under torch_compile and checkpointing, where nothing of the layers compiles",
    ),
    "compile-refusal-without-checkpointing": (
        "dhpo_trl/core/config.py",
        "if config.torch_compile and config.gradient_checkpointing:",
        "if config.torch_compile:",
        COMPILE, "packed rows are refused under torch_compile without checkpointing too, where they compile",
    ),
    "compile-update-forwards-unwrapped-model": (
        "dhpo_trl/training/trainer.py",
        "return self._update.forward(model, trl,",
        "return self._update.forward(self.model, trl,",
        COMPILE, "packed and shared rows forward the uncompiled model: torch_compile does nothing on those paths",
    ),
    "input-hooks-not-removed": (
        "dhpo_trl/training/trainer.py",
        "self._routing.generation_batch(self) as recorded, input_grad_hooks.replaced_hooks_removed(self.model):",
        "self._routing.generation_batch(self) as recorded:",
        COMPILE, "an input-embedding hook more each generation batch: a compiled model recompiles every one",
    ),
    "input-hooks-kept-when-the-batch-raises": (
        "dhpo_trl/training/input_grad_hooks.py",
        "    try:\n        yield\n    finally:",
        "    yield\n    if True:",
        COMPILE, "a generation batch that raises (and is caught) leaves the hooks it replaced",
    ),
    "cell-pool-refused-start-traceback": (
        "dhpo_trl/demo/cell_pool.py",
        "    except OSError:  # the pool terminated and joined the workers it had started",
        "    except ZeroDivisionError:",
        ["tests/test_cell_pool.py::test_a_worker_the_system_refuses_to_start_ends_the_block_on_one_line_with_status_1"],
        "a worker the system refuses to start (EAGAIN, ENOMEM) ends the study with a traceback, not what to do",
    ),
    "cell-pool-refused-replacement-unseen": (
        "dhpo_trl/demo/cell_pool.py",
        "        if refused:\n            return WorkerNotStarted(start_message(refused[0].name, refused[0].start_error))",
        "        if False:\n            return WorkerNotStarted(start_message(refused[0].name, refused[0].start_error))",
        ["tests/test_cell_pool.py"],
        "a replacement worker the system refuses to start is not reported: the line blames the death, not the system",
    ),
    "cell-pool-cell-error-unnamed": (
        "dhpo_trl/demo/cell_pool.py",
        "            raise CellFailed(exit_message(self.func, args, kwargs, error, FAILED)) from error",
        "            raise",
        ["tests/test_cell_pool.py", "tests/test_study_stops.py"],
        "a cell that raises ends the study with a traceback that does not say which cell (objective, seed)",
    ),
    "study-waits-for-every-cell": (
        "benchmarks/study.py",
        "summaries = in_plan_order(jobs, pool.imap_unordered(_run_one, jobs))",
        "summaries = in_plan_order(jobs, pool.map(_run_one, jobs, chunksize=1))",
        ["tests/test_study_stops.py"],
        "a cell that raises is reported only once every other cell finished (hours into a study)",
    ),
    "resume-path-cause-unnamed": (
        "dhpo_trl/training/resume.py",
        "        cause, changed = path_cause(*causes) if automatic else (None, {})",
        "        cause, changed = None, {}",
        ["tests/test_resume_marker.py", "tests/test_resume_epochs.py"],
        "torch_compile toggled on resume is refused naming only padding_free, which the user never changed",
    ),
    "resume-path-causes-compared": (
        "dhpo_trl/training/resume.py",
        "    causes = [{name: side.pop(name) for name in PATH_CAUSES if name in side} for side in (saved, current)]",
        "    causes = [{name: side.get(name) for name in PATH_CAUSES if name in side} for side in (saved, current)]",
        ["tests/test_resume_marker.py"],
        "torch_compile is compared on resume: a change that leaves the update path as it was is refused",
    ),
    "resume-aux-loss-recorded-as-passed": (
        "dhpo_trl/training/resume.py",
        "    if value is None:\n        return default\n    return float(value)",
        "    return value",
        ["tests/test_resume_marker.py", "tests/test_resume_epochs.py"],
        "router_aux_loss_coef is recorded as passed: None (an MoE model's own coefficient) resumes under 0.0 (none)",
    ),
    "resume-aux-loss-compared-as-passed": (
        "dhpo_trl/training/resume.py",
        "    saved, current = aux_loss_settings(saved, current, aux_default)",
        "    pass",
        ["tests/test_resume_marker.py"],
        "a checkpoint that recorded router_aux_loss_coef=None refuses 0.0, the same on a dense model (no aux loss)",
    ),
    "resume-aux-loss-default-not-wired": (
        "dhpo_trl/training/resume.py",
        '    return {"packed": trainer._update.padding_free, "aux_default": aux_loss_default(trainer.model)}',
        '    return {"packed": trainer._update.padding_free, "aux_default": None}',
        ["tests/test_resume_epochs.py"],
        "the trainer records router_aux_loss_coef as passed (None), so a resume passing 0.0 compares it undecided",
    ),
    "cell-pool-exec-failure-blames-a-traceback": (
        "dhpo_trl/demo/cell_pool.py",
        "    if exitcode == EXEC_FAILED:",
        "    if False:",
        ["tests/test_cell_pool.py"],
        "a worker whose interpreter cannot run (status 255) is told to read a traceback that no Python printed",
    ),
    "cell-pool-partial-named-by-type": (
        "dhpo_trl/demo/cell_pool.py",
        "    while isinstance(func, functools.partial):",
        "    while False:",
        ["tests/test_cell_pool.py"],
        "a partial cell is named 'partial', its bound arguments (the objective, the seed) left out",
    ),
    "resume-aux-none-undecided-one-side": (
        "dhpo_trl/training/resume.py",
        "    if saved[AUX_LOSS] is None or current[AUX_LOSS] is None:",
        "    if saved[AUX_LOSS] is None:",
        ["tests/test_resume_marker.py"],
        "an MoE checkpoint resumed with router_aux_loss_coef=None is refused before its model loads (undecided)",
    ),
    "resume-path-cause-without-its-reason": (
        "dhpo_trl/training/resume.py",
        "    if (reasons[0] is None) == (reasons[1] is None):\n        return None, {}",
        "    if False:\n        return None, {}",
        ["tests/test_resume_marker.py"],
        "a path the machine changed is blamed on a torch_compile change that decides nothing without checkpointing",
    ),
    "resume-path-cause-advises-current-value": (
        "dhpo_trl/training/resume.py",
        "    changed = {name: saved[name] for name in PATH_CAUSES if saved[name] != current[name]}",
        "    changed = {name: current[name] for name in PATH_CAUSES if saved[name] != current[name]}",
        ["tests/test_resume_marker.py"],
        "the refusal advises resuming with this run's torch_compile, the value that changed the path",
    ),
    "resume-compiled-path-undecided-early": (
        "dhpo_trl/training/resume.py",
        "    packed = False if packed is None and compiled_packing_reason(args) else packed",
        "    pass",
        ["tests/test_resume_marker.py", "tests/test_resume_epochs.py"],
        "a resume whose torch_compile changed the path is refused after the model loads, not by dhpo-train's check",
    ),
    "study-rows-in-finishing-order": (
        "benchmarks/study.py",
        "    return [by_cell[algorithm, seed] for algorithm, seed, _, _ in jobs]",
        "    return list(by_cell.values())",
        ["tests/test_study_pages.py"],
        "the study's rows follow the order the cells finished in, not the plan's",
    ),
}


def copy_repository(destination: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", "runs", "outputs")
    for entry in ROOT.iterdir():
        if entry.name in {".git", ".venv"}:
            continue
        if entry.is_dir():
            shutil.copytree(entry, destination / entry.name, ignore=ignore, symlinks=True)
        else:
            shutil.copy2(entry, destination / entry.name)


def locate(root: Path, path: str, anchor: str) -> str | None:
    """The file holding `anchor` exactly once: `path`, or else the one file of dhpo_trl/ that does (code moved by a
    refactor keeps its bug); None when no single place matches."""
    if (root / path).is_file() and (root / path).read_text().count(anchor) == 1:
        return path
    hits = [f for f in sorted((root / "dhpo_trl").rglob("*.py")) if anchor in f.read_text()]
    if len(hits) == 1 and hits[0].read_text().count(anchor) == 1:
        return str(hits[0].relative_to(root))
    return None


def leftovers(copy: Path) -> list[int]:
    """Live processes started from the temporary copy `copy`: its path on their command line or as their working
    directory (torchrun's workers run the copy's tests/dist_scripts; pytest runs in the copy)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                if handle.read().rsplit(") ", 1)[1].startswith("Z"):
                    continue  # a zombie runs nothing
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except (OSError, IndexError):
            continue
        if str(copy) in cmdline or cwd == str(copy) or cwd.startswith(f"{copy}/"):
            found.append(int(entry))
    return found


def run_bug(bug_id: str, timeout: float) -> dict:
    path, anchor, replacement, tests, what = BUGS[bug_id]
    with tempfile.TemporaryDirectory(prefix=f"planted-{bug_id}-") as tmp:
        copy = Path(tmp)
        copy_repository(copy)
        path = locate(copy, path, anchor)
        if path is None:
            return {"id": bug_id, "file": BUGS[bug_id][0], "result": "needs re-anchoring (anchor not found once)"}
        source = (copy / path).read_text()
        (copy / path).write_text(source.replace(anchor, replacement))
        env = dict(os.environ, PYTHONPATH=str(copy), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   CUDA_VISIBLE_DEVICES="")
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", *tests]
        start = time.monotonic()
        try:
            result = processes.run(command, env=env, cwd=copy, timeout=timeout)
            lines = result.stdout.strip().splitlines()
            caught, tail = result.returncode != 0, lines[-1:] or [""]
            failed = [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))][:1]
            hang = caught and "TimeoutExpired" in result.stdout  # a test's own process timeout fired
        except subprocess.TimeoutExpired:
            caught, tail, failed, hang = True, [f"pytest timed out after {timeout:.0f} s"], [], True
        left = leftovers(copy)
        for pid in left:
            processes.kill_tree(pid, grace=2.0)
        verdict = "caught" if caught else "NOT caught"
        if hang:
            verdict = "caught (hang, killed)" if not left else f"caught (hang, NOT killed: {len(left)} processes)"
        elif left:
            verdict += f" ({len(left)} processes left, killed now)"
        return {"id": bug_id, "file": path, "result": verdict, "what": what, "left": left,
                "tests": tests, "caught_by": failed[0] if failed else None, "pytest": tail[0],
                "seconds": round(time.monotonic() - start, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="bug ids to run (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per bug before it counts as a hang")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup (kill the running pytest's group)
    ids = args.only or list(BUGS)
    unknown = [i for i in ids if i not in BUGS]
    if unknown:
        parser.error(f"--only: unknown bug ids {unknown}; known: {list(BUGS)}")
    results = []
    for bug_id in ids:
        results.append(run_bug(bug_id, args.timeout))
        r = results[-1]
        print(f"{r['result']:>21}  {bug_id:40s} {r.get('seconds', '')} s  {r.get('pytest', '')}  "
              f"{r.get('caught_by') or ''}", flush=True)
        if args.json:  # after every bug: a run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
    caught = sum(r["result"].startswith("caught") for r in results)
    print(f"\n{caught}/{len(results)} planted bugs caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
