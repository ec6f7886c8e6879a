"""`dhpo-train` / `examples/train_dhpo.py`: DHPO (or a baseline) on a math dataset with the math-verify reward.

TRL-style: `TrlParser` over (`DHPOScriptArguments`, `DHPOConfig`, `ModelConfig`), YAML via `--config`, plus any
number of `--overlay file.yaml` applied on top (the algorithm overlays of `examples/recipes/`). Command-line flags
override both. Runs under `python` and `accelerate launch`.

When `prompts_per_generation` / `prompts_per_optimizer_step` are set (the paper's batch in VERL terms: rollout prompt
batch and PPO mini-batch), `steps_per_generation` and `gradient_accumulation_steps` are derived from them for the
number of processes actually launched (`WORLD_SIZE`), so one recipe serves 8 and 32 GPUs alike.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import yaml
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from .config import DHPOConfig
from .data import load_math_dataset
from .rewards import math_verify_reward


@dataclass
class DHPOScriptArguments(ScriptArguments):
    """Dataset and batch options of the training script. Defaults are the paper's data (SimpleRL-Zoo, level 3-5)."""

    dataset_name: str | None = field(
        default="hkust-nlp/SimpleRL-Zoo-Data",
        metadata={"help": "Hub dataset id, or a local .parquet/.jsonl/.json/.csv file or dataset folder."},
    )
    dataset_config: str | None = field(
        default="simplelr_qwen_level3to5",
        metadata={"help": "Hub config, or sub-folder of the dataset repository (SimpleRL-Zoo-Data uses folders)."},
    )
    question_column: str = field(
        default="question", metadata={"help": "Column holding the problem text (dotted for nested fields)."}
    )
    answer_column: str = field(
        default="gt_answer", metadata={"help": "Column holding the ground-truth answer (dotted for nested fields)."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Drop prompts longer than this many tokens (the paper: 1024). TRL 1.16 has no prompt "
            "truncation, and cutting a math problem would change its answer, so long prompts are left out."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N problems (smoke tests)."}
    )
    prompts_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Prompts per generation batch (VERL data.train_batch_size; the paper: 512). With "
            "prompts_per_optimizer_step, sets steps_per_generation and gradient_accumulation_steps for the "
            "launched number of processes."
        },
    )
    prompts_per_optimizer_step: int | None = field(
        default=None,
        metadata={"help": "Prompts per optimizer step (VERL actor.ppo_mini_batch_size; the paper: 256, or 32)."},
    )


_STRATEGY_FIELDS = ("save_strategy", "eval_strategy", "logging_strategy")


def make_parser() -> TrlParser:
    return TrlParser((DHPOScriptArguments, DHPOConfig, ModelConfig))


def parse_args(argv=None, *, num_processes: int | None = None):
    """(script_args, DHPOConfig, ModelConfig) from `--config`, any `--overlay` YAMLs and the command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    config_paths = _pop_all(args, "--config") + _pop_all(args, "--overlay")
    parser = make_parser()
    merged: dict = {}
    for path in config_paths:
        with open(path) as handle:
            values = yaml.safe_load(handle) or {}
        if not isinstance(values, dict):
            raise ValueError(f"Config file {path} must contain a YAML mapping of argument names to values.")  # noqa: TRY004
        for key, value in values.pop("env", {}).items():
            os.environ[key] = str(value)
        merged.update(values)
    for key in _STRATEGY_FIELDS:  # YAML reads a bare `no` as False
        if merged.get(key) is False:
            merged[key] = "no"
    unknown = parser.set_defaults_with_config(**merged)
    if unknown:
        raise ValueError(f"Unknown arguments in {config_paths}: {unknown[::2]}. Check their spelling.")
    # The plan is settled on the raw values, before DHPOConfig exists: its __post_init__ validates the batch.
    raw, _ = parser.parse_known_args(args)
    plan = batch_plan(
        raw.prompts_per_generation,
        raw.prompts_per_optimizer_step,
        per_device_train_batch_size=raw.per_device_train_batch_size,
        num_generations=raw.num_generations,
        num_processes=num_processes or int(os.environ.get("WORLD_SIZE", "1")),  # set by accelerate / torchrun
    )
    for name, value in plan.items():  # last flag wins in argparse
        args += [f"--{name}", str(value)]
    return tuple(parser.parse_args_into_dataclasses(args=args))


def load_recipe(path, overlays=(), *, num_processes: int | None = None, overrides: dict | None = None):
    """(script_args, DHPOConfig, ModelConfig) of a recipe YAML with algorithm overlays, batch-planned for
    `num_processes` (default: the current world size). `overrides` are flags, e.g. {"use_cpu": True}."""
    argv = ["--config", str(path)]
    for overlay in overlays:
        argv += ["--overlay", str(overlay)]
    for key, value in (overrides or {}).items():
        argv += [f"--{key}", str(value)]
    return parse_args(argv, num_processes=num_processes)


def batch_plan(
    prompts_per_generation: int | None,
    prompts_per_optimizer_step: int | None,
    *,
    per_device_train_batch_size: int,
    num_generations: int,
    num_processes: int,
) -> dict[str, int]:
    """`steps_per_generation` and `gradient_accumulation_steps` for the paper's prompt batches on `num_processes`.

    TRL counts completions: a generation batch holds per_device_train_batch_size x num_processes x
    steps_per_generation of them, and one optimizer step consumes per_device_train_batch_size x num_processes x
    gradient_accumulation_steps. Empty when neither prompt batch is set.
    """
    per_generation, per_step = prompts_per_generation, prompts_per_optimizer_step
    if per_generation is None and per_step is None:
        return {}
    if per_generation is None or per_step is None or per_generation % per_step:
        raise ValueError(
            f"prompts_per_generation={per_generation} and prompts_per_optimizer_step={per_step}: set both, with the "
            "first a multiple of the second (the paper: 512 and 256, or 512 and 32 for Qwen3-30B-A3B)."
        )
    completions_per_micro_step = per_device_train_batch_size * num_processes
    plan = {}
    for name, prompts in (("steps_per_generation", per_generation), ("gradient_accumulation_steps", per_step)):
        completions = prompts * num_generations
        if completions % completions_per_micro_step:
            raise ValueError(
                f"{prompts} prompts x num_generations={num_generations} = {completions} completions do not split "
                f"into micro-batches of per_device_train_batch_size={per_device_train_batch_size} x "
                f"{num_processes} processes: choose a per_device_train_batch_size (and a process count) that "
                "divides it."
            )
        plan[name] = completions // completions_per_micro_step
    return plan


def _pop_all(args: list[str], flag: str) -> list[str]:
    values = []
    while flag in args:
        index = args.index(flag)
        if index + 1 >= len(args):
            raise ValueError(f"{flag} needs a file path.")
        values.append(args[index + 1])
        del args[index : index + 2]
    return values


# ------------------------------------------------------------------ training
def train(script_args: DHPOScriptArguments, training_args: DHPOConfig, model_args: ModelConfig):
    """Load tokenizer, data (checked before the model), model; train; save with the DHPO model card; push."""
    from transformers import AutoTokenizer

    from .trainer import DHPOTrainer

    if not model_args.model_name_or_path:
        raise ValueError(
            "--model_name_or_path is required: a Hub model id (e.g. Qwen/Qwen3-1.7B-Base) or a local folder."
        )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    dataset = load_math_dataset(
        script_args.dataset_name,
        split=script_args.dataset_train_split,
        subset=script_args.dataset_config,
        question_column=script_args.question_column,
        answer_column=script_args.answer_column,
        tokenizer=tokenizer,
    )
    if script_args.max_prompt_length is not None:
        dataset = drop_long_prompts(dataset, tokenizer, script_args.max_prompt_length)
    if script_args.max_train_samples is not None:
        dataset = dataset.select(range(min(script_args.max_train_samples, len(dataset))))
    prompts_per_generation = training_args.generation_batch_size // training_args.num_generations
    if len(dataset) < prompts_per_generation:
        raise ValueError(
            f"The dataset has {len(dataset)} usable problems, fewer than one generation batch of "
            f"{prompts_per_generation} prompts (generation_batch_size {training_args.generation_batch_size} / "
            f"num_generations {training_args.num_generations}): use more data or a smaller batch."
        )

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    training_args.model_init_kwargs = model_init_kwargs
    trainer = DHPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[math_verify_reward],
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    hub_dataset = script_args.dataset_name if _is_hub_id(script_args.dataset_name) else None
    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(dataset_name=hub_dataset)  # the final folder carries the DHPO card, not only checkpoints
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=hub_dataset)
    return trainer


def drop_long_prompts(dataset, tokenizer, max_tokens: int):
    """Keep the problems whose rendered prompt has at most `max_tokens` tokens."""

    def prompt_length(row) -> dict:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(prompt)["input_ids"]
        return {"prompt_tokens": len(ids)}

    measured = dataset.map(prompt_length)
    kept = measured.filter(lambda row: row["prompt_tokens"] <= max_tokens).remove_columns("prompt_tokens")
    if len(kept) == 0:
        raise ValueError(f"Every prompt is longer than max_prompt_length={max_tokens} tokens: raise it.")
    if len(kept) < len(dataset):
        print(f"Dropped {len(dataset) - len(kept)} of {len(dataset)} prompts longer than {max_tokens} tokens.")
    return kept


def _is_hub_id(name) -> bool:
    return isinstance(name, str) and not os.path.exists(name) and name.count("/") == 1


def main(argv=None) -> None:
    """Console entry point (`dhpo-train`): parse `argv` (default: sys.argv) and train."""
    train(*parse_args(argv))


if __name__ == "__main__":
    main()
