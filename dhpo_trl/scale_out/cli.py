"""`dhpo-train` / `examples/train_dhpo.py`: DHPO (or a baseline) on a math dataset with the math-verify reward.

TRL-style: `TrlParser` over (`DHPOScriptArguments`, `DHPOConfig`, `ModelConfig`), YAML via `--config`, plus any
number of `--overlay file.yaml` applied on top (the algorithm overlays of `examples/recipes/`). Command-line flags
override both. Runs under `python` and `accelerate launch`.

When `prompts_per_generation` / `prompts_per_optimizer_step` are set (the paper's batch in VERL terms: rollout prompt
batch and PPO mini-batch), `steps_per_generation` and `gradient_accumulation_steps` are derived from them for the
number of processes actually launched (`WORLD_SIZE`), so one recipe serves 8 and 32 GPUs alike.

Input is read cheapest first (flags and YAML keys, the device, the batch plan, the config values, the model path, the
data, then the tokenizer and the model); a mistake in it is one `dhpo-train: error: ...` line with exit status 2
(`dhpo_trl.user_errors`), a failure during training keeps its traceback. A non-finite gradient norm
(`stop_on_nonfinite_gradients`) stops every process at the same step: one `dhpo-train: error: ...` line naming the
step and the checkpoint to resume, exit status 1.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from dataclasses import dataclass, field, fields

import yaml
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from ..core.config import DHPOConfig
from ..scoring.data import load_math_dataset
from ..scoring.rewards import math_verify_reward
from ..training.nonfinite import NonFiniteGradientError
from ..training.reward_checks import check_reward_weights
from ..training.teardown import release_process_groups
from ..user_errors import UsageError, check_model_path, make_folder, pop_debug_flag, report, run_command

# The paper's training data and its subset (a folder of the repository); the subset is the default only for it.
PAPER_DATASET, PAPER_SUBSET = "hkust-nlp/SimpleRL-Zoo-Data", "simplelr_qwen_level3to5"


@dataclass
class DHPOScriptArguments(ScriptArguments):
    """Dataset and batch options of the training script. Defaults are the paper's data (SimpleRL-Zoo, level 3-5)."""

    dataset_name: str | None = field(
        default=PAPER_DATASET,
        metadata={"help": "Hub dataset id, or a local .parquet/.jsonl/.json/.csv file or dataset folder."},
    )
    dataset_config: str | None = field(
        default=None,
        metadata={"help": "Hub config, or sub-folder of the dataset repository (SimpleRL-Zoo-Data uses folders; for "
                  f"{PAPER_DATASET} it defaults to {PAPER_SUBSET}). A single file or a saved dataset has none."},
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
USAGE = "%(prog)s [--config FILE.yaml] [--overlay FILE.yaml ...] [--debug] [--FIELD VALUE ...]"
EPILOG = (
    "Input errors (flags, config values, files, data columns, the model path, missing packages, the vLLM server) are "
    "reported on one line with exit status 2, a non-finite gradient norm with 1; --debug (no value) shows their "
    "traceback instead, with the same status, except for a usage error (an unknown flag, a value of the wrong type), "
    "which stays one line. `--debug VALUE` stays transformers' debug option."
)


def make_parser() -> TrlParser:
    # prog: the name the one-line errors carry, also when launched as a file (`accelerate launch .../cli.py`).
    return TrlParser((DHPOScriptArguments, DHPOConfig, ModelConfig), prog="dhpo-train", usage=USAGE, epilog=EPILOG)


def parse_args(argv=None, *, num_processes: int | None = None):
    """(script_args, DHPOConfig, ModelConfig) from `--config`, any `--overlay` YAMLs and the command line.

    Order of the checks: config files, unknown flags and keys, the device, the batch plan, then the values
    (DHPOConfig's own validation). Every problem is a ValueError naming the flag or key and the fix.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    config_paths = _pop_all(args, "--config") + _pop_all(args, "--overlay")
    parser = make_parser()
    merged: dict = {}
    for path in config_paths:
        values = _read_config(path)
        env = values.pop("env", {})
        if not isinstance(env, dict):
            raise ValueError(f"Config file {path}: `env` must be a mapping of environment variables to values.")  # noqa: TRY004
        for key, value in env.items():
            os.environ[key] = str(value)
        merged.update(values)
    for key in _STRATEGY_FIELDS:  # YAML reads a bare `no` as False
        if merged.get(key) is False:
            merged[key] = "no"
    unknown = parser.set_defaults_with_config(**merged)
    if unknown:
        keys = _with_suggestions([flag.removeprefix("--") for flag in unknown[::2]], _field_names(parser))
        raise ValueError(f"Unknown key(s) in {', '.join(config_paths)}: {keys}.")
    # The plan is settled on the raw values, before DHPOConfig exists: its __post_init__ validates the batch.
    raw, extra = parser.parse_known_args(args)
    if extra:
        flags = [item for item in extra if item.startswith("-")] or extra
        options = [option for action in parser._actions for option in action.option_strings]
        yaml_given = any(item.endswith((".yaml", ".yml")) for item in extra)
        hint = " (a YAML file goes after --config)" if yaml_given else ""
        raise UsageError(f"Unrecognized argument(s): {_with_suggestions(flags, options)}{hint}.")
    for name in ("per_device_train_batch_size", "num_generations"):  # the batch plan divides by them
        value = getattr(raw, name)
        if not isinstance(value, int) or value < 1:  # None: a key left empty in the YAML
            raise ValueError(f"--{name} must be a positive whole number, got {value}.")
    check_device(raw)
    plan = batch_plan(
        raw.prompts_per_generation,
        raw.prompts_per_optimizer_step,
        per_device_train_batch_size=raw.per_device_train_batch_size,
        num_generations=raw.num_generations,
        # The total over all nodes (accelerate and torchrun set it), not the node's LOCAL_WORLD_SIZE.
        num_processes=num_processes or int(os.environ.get("WORLD_SIZE", "1")),
    )
    for name, value in plan.items():  # last flag wins in argparse
        args += [f"--{name}", str(value)]
    try:
        return tuple(parser.parse_args_into_dataclasses(args=args))
    except TypeError as error:  # a YAML value of the wrong type (argparse converts only strings), e.g. `key:` empty
        empty = [key for key, value in merged.items() if value is None]
        hint = f" Keys left empty in the YAML: {', '.join(empty)}." if empty else " Check the YAML values."
        raise ValueError(f"A config value has the wrong type ({error}).{hint}") from error


def check_device(raw) -> None:
    """Say what to pass where transformers would stop with "Your setup doesn't support bf16/gpu" (same condition).

    A run meant for GPUs is never moved to CPU behind the user's back: a recipe started on a machine where CUDA is
    not visible stops here, at once, with the two flags that make it a CPU run if that is what was meant.
    """
    import torch
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    bf16 = (not raw.fp16) if raw.bf16 is None else raw.bf16  # TRL's default: bf16 unless fp16
    if not (bf16 or raw.bf16_full_eval) or raw.use_cpu or is_torch_bf16_gpu_available() or is_torch_xla_available():
        return
    source = " (TRL's default)" if raw.bf16 is None else ""
    if torch.cuda.is_available():
        raise ValueError(
            f"bf16 is on{source} but this GPU has no bfloat16 support (Ampere or newer): pass --bf16 false "
            "(and --fp16 true for float16 mixed precision)."
        )
    raise ValueError(
        f"No GPU is visible (torch.cuda.is_available() is False) and bf16 is on{source}: to train on CPU pass "
        "--use_cpu true --bf16 false; on a GPU machine, check CUDA_VISIBLE_DEVICES and that torch was built with "
        "CUDA."
    )


def _read_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"Config file {path} does not exist.")
    try:
        with open(path) as handle:
            values = yaml.safe_load(handle) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"Config file {path} is not valid YAML: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"Config file {path} must contain a YAML mapping of argument names to values.")  # noqa: TRY004
    return values


def _field_names(parser) -> list[str]:
    return [action.dest for action in parser._actions if action.option_strings]


def _with_suggestions(names: list[str], known: list[str]) -> str:
    described = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        described.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return ", ".join(described)


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
    """Remove every `flag PATH` and `flag=PATH` from `args`; return the paths in order."""
    values, index = [], 0
    while index < len(args):
        if args[index] == flag:
            if index + 1 >= len(args) or args[index + 1].startswith("--"):
                raise ValueError(f"{flag} needs a file path.")
            values.append(args[index + 1])
            del args[index : index + 2]
        elif args[index].startswith(flag + "="):
            values.append(args.pop(index).split("=", 1)[1])
        else:
            index += 1
    return values


# ------------------------------------------------------------------ training
def build_trainer(script_args: DHPOScriptArguments, training_args: DHPOConfig, model_args: ModelConfig):
    """Check the model path, load and check the data, then the tokenizer and the model; return the trainer.

    Everything the run reads from the user is read here, cheapest first, so that a wrong column or path costs
    seconds: the data is checked before the tokenizer and the model load.
    """
    from transformers import AutoTokenizer

    from ..training.trainer import DHPOTrainer

    if not model_args.model_name_or_path:
        raise ValueError(
            "--model_name_or_path is required: a Hub model id (e.g. Qwen/Qwen3-1.7B-Base) or a local folder."
        )
    check_trackers(training_args.report_to)
    check_model_flags_act(model_args)
    check_reward_weights(training_args.reward_weights, REWARD_FUNCS)  # before the data loads
    check_model_path(model_args.model_name_or_path, label="--model_name_or_path")
    training_args.resume_from_checkpoint = resolve_resume(training_args)
    make_folder(training_args.output_dir, "--output_dir")  # not at the first save, hours in
    load_training_data(script_args)  # plain-text prompts: only the check matters here
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    # The prompt format depends on the tokenizer (chat template or not): format again, from the datasets cache.
    dataset = load_training_data(script_args, tokenizer, quiet=True)
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
    return DHPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=REWARD_FUNCS,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )


REWARD_FUNCS = [math_verify_reward]  # the paper's one reward

# TRL's `get_peft_config` reads these only with `use_peft`, `get_quantization_config` these only with `load_in_4bit`.
MODEL_FLAGS_NEEDING = {
    "use_peft": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                 "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora"),
    "load_in_4bit": ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"),
}  # fmt: skip


def check_model_flags_act(model_args: ModelConfig) -> None:
    """A LoRA flag without `--use_peft true`, or a 4-bit flag without `--load_in_4bit true`, would not act."""
    defaults = {item.name: item.default for item in fields(ModelConfig)}
    for switch, names in MODEL_FLAGS_NEEDING.items():
        for name in names if not getattr(model_args, switch) else ():
            if getattr(model_args, name) != defaults[name]:
                raise ValueError(f"--{name} acts only with --{switch} true: add --{switch} true, or drop --{name}.")


def resolve_resume(training_args: DHPOConfig) -> str | None:
    """The checkpoint `--resume_from_checkpoint` names, resolved and checked before anything loads, by the one
    resolver `DHPOTrainer.train()` uses too (`resume.resolve_for_run`): a folder that is not a complete checkpoint,
    or one saved under other settings, is refused naming the file or the setting."""
    from ..training import resume

    main_process = int(os.environ.get("RANK", "0")) == 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoint = resume.resolve_for_run(training_args.resume_from_checkpoint, training_args, world_size, main_process)
    if checkpoint is not None and main_process:
        print(f"Resuming from {checkpoint}.")
    return checkpoint


def check_trackers(report_to) -> None:
    """The trackers of `--report_to` are installed (transformers would stop with a RuntimeError, after the model)."""
    from transformers.integrations import get_reporting_integration_callbacks

    for callback in get_reporting_integration_callbacks(report_to):  # also refuses an unknown name (ValueError)
        try:
            callback()  # the integrations check their package when built, and do nothing else until training
        except RuntimeError as error:
            raise ImportError(f"--report_to: {error}") from error


def load_training_data(script_args: DHPOScriptArguments, tokenizer=None, *, quiet: bool = False):
    """The `prompt` / `answer` dataset of the script's data flags (see `dhpo_trl.scoring.data.load_math_dataset`)."""
    data_logger = logging.getLogger(load_math_dataset.__module__)
    was_disabled, data_logger.disabled = data_logger.disabled, quiet or data_logger.disabled  # warned once already
    try:
        return load_math_dataset(
            script_args.dataset_name,
            split=script_args.dataset_train_split,
            subset=script_args.dataset_config or (PAPER_SUBSET if script_args.dataset_name == PAPER_DATASET else None),
            question_column=script_args.question_column,
            answer_column=script_args.answer_column,
            tokenizer=tokenizer,
        )
    finally:
        data_logger.disabled = was_disabled


def run_training(trainer, script_args: DHPOScriptArguments):
    """Train; save with the DHPO model card; push when asked."""
    training_args = trainer.args
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    stop = getattr(trainer, "graceful_stop", None)
    if stop is not None:  # preempted: the checkpoint is the run's state; no final model, no push
        if trainer.accelerator.is_main_process:
            full = ", a full one despite save_only_model" if training_args.save_only_model else ""
            print(f"dhpo-train: stopped by {stop['signal']} after step {stop['step']}; checkpoint {stop['checkpoint']} "
                  f"(resume with --resume_from_checkpoint latest{full}).", flush=True)  # fmt: skip
        return trainer
    hub_dataset = script_args.dataset_name if _is_hub_id(script_args.dataset_name) else None
    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(dataset_name=hub_dataset)  # the final folder carries the DHPO card, not only checkpoints
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=hub_dataset)
    return trainer


def train(script_args: DHPOScriptArguments, training_args: DHPOConfig, model_args: ModelConfig):
    """Load tokenizer, data (checked before the model), model; train; save with the DHPO model card; push."""
    return run_training(build_trainer(script_args, training_args, model_args), script_args)


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


def main(argv=None) -> int:
    """Console entry point (`dhpo-train`): parse `argv` (default: sys.argv), build the trainer, train.

    Returns 0, 2 after a one-line `dhpo-train: error: ...` for bad input (see `dhpo_trl.user_errors`), or 1 after
    one for a non-finite gradient norm (`stop_on_nonfinite_gradients`); `--debug` prints the traceback instead of
    the line, with the same status.
    """
    argv, debug = pop_debug_flag(sys.argv[1:] if argv is None else argv)
    from ..training import trainer  # noqa: F401 - imported outside the input checks: an ImportError in it is a bug

    def setup():
        script_args, training_args, model_args = parse_args(argv)
        return build_trainer(script_args, training_args, model_args), script_args

    try:
        status = run_command("dhpo-train", setup, lambda built: run_training(*built), debug=debug)
    except NonFiniteGradientError as error:  # raised on every process at the same step (training/nonfinite.py)
        if int(os.environ.get("RANK", "0")) == 0:
            report("dhpo-train", error, debug=debug)
        status = 1
    except BaseException:  # a bug or an interrupt: the groups go before the error leaves (a group left to the
        release_process_groups(barrier=False)  # interpreter's exit can hang it), with no barrier: a peer may be gone
        raise
    # The trainer is out of reach now: every process group and what holds it go before the interpreter finalises
    # (see dhpo_trl.training.teardown); a group left to finalisation can hang or abort a finished run. No barrier
    # after an input error: it may be this process's alone, and its peers would never arrive.
    left = release_process_groups(barrier=status == 0)
    if left:
        print(f"dhpo-train: warning: a process group is still referenced after its release ({len(left)} gloo threads, "
              "idle past the exit barrier); the interpreter destroys it at exit.", file=sys.stderr, flush=True)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
