"""The training script's input handling, in process and fast: what `parse_args` reads from flags and YAML files, the
messages a mistake gets, what `build_trainer` hands to the tokenizer and the trainer (the trainer itself stubbed),
the rows that reach it, and what `run_training` saves and pushes. tests/test_cli.py runs the script end to end."""

import dataclasses
import json
import logging
import os
import re
import sys
from functools import partial
from types import SimpleNamespace

import pytest
from datasets import Dataset, DatasetDict

from dhpo_trl.core.config import NONFINITE_SETTING, DHPOConfig
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.scale_out import cli
from dhpo_trl.scale_out.cli import (
    DHPOScriptArguments,
    _pop_all,
    batch_plan,
    build_trainer,
    check_device,
    drop_long_prompts,
    load_training_data,
    main,
    parse_args,
    run_training,
)
from dhpo_trl.scoring.data import load_math_dataset
from dhpo_trl.training.trainer import DHPOTrainer

CPU = ["--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
OFF_POLICY = ["--steps_per_generation", "2"]  # no on-policy warning
# One token per message end and two for the generation prompt "A:", so a chat prompt has more tokens than the
# characters of its messages, and fewer than the characters of its rendering.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_char_tokenizer()
    build_tiny_qwen3(tokenizer, hidden_size=16, num_layers=1, num_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps({"question": q, "gt_answer": a}) for q, a in rows))
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Five problems; the third one's prompt is far over 200 tokens, the others far under."""
    rows = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("x" * 300 + "?", "0"), ("What is 3 + 3?", "6"),
            ("What is 4 + 4?", "8")]  # fmt: skip
    return _jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", rows)


def run_flags(model, data, output_dir, *extra):
    """4 completions per device, 4 per prompt, 2 micro-steps per generation: generation batches of 2 prompts."""
    return [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(output_dir),
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "2",
        "--gradient_accumulation_steps", "1", *CPU, *extra,
    ]  # fmt: skip


@pytest.fixture
def trainer_kwargs(monkeypatch):
    """What build_trainer passes to DHPOTrainer; the trainer itself (model loading included) is not built."""
    seen = {}
    monkeypatch.setattr(DHPOTrainer, "__init__", lambda self, **kwargs: seen.update(kwargs))
    return seen


def _yaml(path, text):
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ --config / --overlay
def test_config_paths_leave_the_other_flags_in_place():
    args = ["--use_cpu", "--config", "a.yaml", "--max_steps", "1", "--config=b=c.yaml", "--configs", "d"]
    assert _pop_all(args, "--config") == ["a.yaml", "b=c.yaml"]  # in order; only the first '=' separates
    assert args == ["--use_cpu", "--max_steps", "1", "--configs", "d"]
    assert _pop_all(args, "--config") == []


def test_config_and_overlay_in_the_flag_equals_path_form(tmp_path):
    config = _yaml(tmp_path / "run=1.yaml", "max_steps: 3\nlearning_rate: 0.25\n")
    overlay = _yaml(tmp_path / "overlay.yaml", "learning_rate: 0.5\n")
    _, training_args, _ = parse_args(
        [f"--config={config}", f"--overlay={overlay}", "--output_dir", str(tmp_path), *OFF_POLICY, *CPU]
    )
    assert (training_args.max_steps, training_args.learning_rate) == (3, 0.5)  # the overlay wins over the config


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "1", "--config"], "--config needs a file path."),
        (["--config", "--max_steps", "1"], "--config needs a file path."),
        (["--bf16", "--overlay", "--max_steps", "1"], "--overlay needs a file path."),
    ],
    ids=["last", "followed-by-a-flag", "overlay"],
)
def test_a_config_flag_without_a_path(argv, message):
    with pytest.raises(ValueError) as raised:
        parse_args(argv)
    assert str(raised.value) == message


def test_unknown_yaml_keys_name_every_file_and_close_matches_only(tmp_path):
    config = _yaml(tmp_path / "run.yaml", "outdir: out\nmax_steps: 2\n")
    overlay = _yaml(tmp_path / "algo.yaml", "num_gens: 2\n")
    with pytest.raises(ValueError) as raised:
        parse_args(["--config", config, "--overlay", overlay])
    # outdir is exactly at the 0.75 similarity cutoff for output_dir; num_gens below it for num_generations
    assert str(raised.value) == (
        f"Unknown key(s) in {config}, {overlay}: outdir (did you mean output_dir?), num_gens."
    )


def test_unrecognized_flags_are_listed_without_their_values():
    with pytest.raises(ValueError) as raised:
        parse_args(["--max_stepz", "3", "--num_gens", "2", *CPU])  # --num_generations: below the cutoff
    assert str(raised.value) == "Unrecognized argument(s): --max_stepz (did you mean --max_steps?), --num_gens."


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_a_yaml_file_without_config_gets_the_hint(tmp_path, suffix):
    path = _yaml(tmp_path / f"run{suffix}", "max_steps: 1\n")
    with pytest.raises(ValueError) as raised:
        parse_args([path, *CPU])
    assert str(raised.value) == f"Unrecognized argument(s): {path} (a YAML file goes after --config)."


def test_yaml_env_and_bare_no_strategies(tmp_path, monkeypatch):
    monkeypatch.setenv("DHPO_CLI_UNIT_VAR", "before")  # restored after the test
    config = _yaml(
        tmp_path / "run.yaml",
        "env:\n  DHPO_CLI_UNIT_VAR: 3\nsave_strategy: no\neval_strategy: no\nlogging_strategy: no\n",
    )
    _, training_args, _ = parse_args(["--config", config, "--output_dir", str(tmp_path), *OFF_POLICY, *CPU])
    assert os.environ["DHPO_CLI_UNIT_VAR"] == "3"
    assert (training_args.save_strategy, training_args.eval_strategy, training_args.logging_strategy) == (
        "no",
        "no",
        "no",
    )


def test_one_completion_per_device_is_a_valid_batch(tmp_path):
    flags = ["--per_device_train_batch_size", "1", "--num_generations", "2", "--steps_per_generation", "2"]
    _, training_args, _ = parse_args([*flags, "--output_dir", str(tmp_path), *CPU])
    assert (training_args.per_device_train_batch_size, training_args.generation_batch_size) == (1, 2)


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("logging_steps:\nsave_steps:\n",
         ("A config value has the wrong type ('>' not supported between instances of 'NoneType' and 'int'). "
          "Keys left empty in the YAML: logging_steps, save_steps.")),
        ("logging_steps: [1]\n",
         ("A config value has the wrong type ('>' not supported between instances of 'list' and 'int'). "
          "Check the YAML values.")),
        ("per_device_train_batch_size: 0\n", "--per_device_train_batch_size must be a positive whole number, got 0."),
        ("num_generations:\n", "--num_generations must be a positive whole number, got None."),
    ],
    ids=["empty", "list", "zero-batch", "empty-num-generations"],
)  # fmt: skip
def test_wrong_yaml_values(tmp_path, yaml_text, message):
    config = _yaml(tmp_path / "run.yaml", yaml_text)
    with pytest.raises(ValueError) as raised:
        parse_args(["--config", config, "--output_dir", str(tmp_path), *CPU])
    assert str(raised.value) == message


def test_without_argv_the_command_line_is_read(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dhpo-train", "--max_stepz", "1"])
    with pytest.raises(ValueError) as raised:
        parse_args()
    assert str(raised.value) == "Unrecognized argument(s): --max_stepz (did you mean --max_steps?)."
    assert main() == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "dhpo-train: error: Unrecognized argument(s): --max_stepz (did you mean --max_steps?)."
    )


def test_help_shows_the_usage_and_the_error_conventions(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dhpo-train"])
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "usage: dhpo-train [--config FILE.yaml] [--overlay FILE.yaml ...] [--debug] [--FIELD VALUE ...]\n"
    )
    assert " ".join(out.split()).endswith(
        "Input errors (flags, config values, files, data columns, the model path, missing packages, the vLLM "
        "server) are reported on one line with exit status 2, a non-finite gradient norm with 1; --debug (no value) "
        "shows their traceback instead, with the same status, except for a usage error (an unknown flag, a value of "
        "the wrong type), which stays one line. `--debug VALUE` stays transformers' debug option."
    )


def test_help_shows_every_dhpo_field_with_its_own_help(monkeypatch, capsys):
    """Each field DHPOConfig defines (its own, and TRL's it redefines: `epsilon`, `loss_type`...) is a `--FIELD`
    flag of `dhpo-train --help`, followed by its own help text and its default."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    defined = set(vars(DHPOConfig)["__annotations__"])  # the class body's fields, not the inherited ones
    ours = [field for field in dataclasses.fields(DHPOConfig) if field.name in defined]
    assert {"algorithm", "epsilon", "loss_type", "routing_replay", NONFINITE_SETTING} <= defined and len(ours) >= 20
    for field in ours:
        text = " ".join(field.metadata.get("help", "").split())
        flags = rf"--{field.name} \S+(, --{field.name.replace('_', '-')} \S+)?"
        default = rf"\(default: {re.escape(str(field.default))}\)"
        assert len(text) > 20 and re.search(rf"{flags} {re.escape(text)} {default}", shown), field.name


# ------------------------------------------------------------------ batch plan
@pytest.mark.parametrize("per_generation, per_step", [(512, None), (None, 256), (512, 200)])
def test_batch_plan_needs_both_prompt_batches_one_a_multiple_of_the_other(per_generation, per_step):
    with pytest.raises(ValueError) as raised:
        batch_plan(per_generation, per_step, per_device_train_batch_size=16, num_generations=16, num_processes=8)
    assert str(raised.value) == (
        f"prompts_per_generation={per_generation} and prompts_per_optimizer_step={per_step}: set both, with the first "
        "a multiple of the second (the paper: 512 and 256, or 512 and 32 for Qwen3-30B-A3B)."
    )


def test_batch_plan_names_a_batch_that_does_not_split():
    assert batch_plan(None, None, per_device_train_batch_size=4, num_generations=2, num_processes=1) == {}
    with pytest.raises(ValueError) as raised:
        batch_plan(6, 3, per_device_train_batch_size=4, num_generations=2, num_processes=1)
    assert str(raised.value) == (
        "3 prompts x num_generations=2 = 6 completions do not split into micro-batches of "
        "per_device_train_batch_size=4 x 1 processes: choose a per_device_train_batch_size (and a process count) "
        "that divides it."
    )


# ------------------------------------------------------------------ device
def _device(monkeypatch, *, cuda=False, bf16_gpu=False, xla=False):
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    monkeypatch.setattr("transformers.utils.is_torch_bf16_gpu_available", lambda: bf16_gpu)
    monkeypatch.setattr("transformers.utils.is_torch_xla_available", lambda: xla)


def _raw(bf16=None, fp16=False, bf16_full_eval=False, use_cpu=False):
    return SimpleNamespace(bf16=bf16, fp16=fp16, bf16_full_eval=bf16_full_eval, use_cpu=use_cpu)


NO_GPU = (
    "No GPU is visible (torch.cuda.is_available() is False) and bf16 is on{}: to train on CPU pass --use_cpu true "
    "--bf16 false; on a GPU machine, check CUDA_VISIBLE_DEVICES and that torch was built with CUDA."
)
OLD_GPU = (
    "bf16 is on{} but this GPU has no bfloat16 support (Ampere or newer): pass --bf16 false (and --fp16 true for "
    "float16 mixed precision)."
)


@pytest.mark.parametrize(
    "cuda, raw, message",
    [
        (False, _raw(), NO_GPU.format(" (TRL's default)")),
        (False, _raw(bf16=True), NO_GPU.format("")),
        (False, _raw(bf16=False, bf16_full_eval=True), NO_GPU.format("")),
        (True, _raw(), OLD_GPU.format(" (TRL's default)")),
        (True, _raw(bf16=True, fp16=True), OLD_GPU.format("")),
    ],
    ids=["no-gpu-default", "no-gpu-explicit", "no-gpu-full-eval", "old-gpu-default", "old-gpu-explicit"],
)
def test_bf16_without_support_names_the_flags(monkeypatch, cuda, raw, message):
    _device(monkeypatch, cuda=cuda)
    with pytest.raises(ValueError) as raised:
        check_device(raw)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    "device, raw",
    [
        ({}, _raw(bf16=False)),  # bf16 off
        ({}, _raw(fp16=True)),  # TRL's default is off under fp16
        ({}, _raw(bf16=True, use_cpu=True)),  # CPU runs may ask for bf16
        ({"cuda": True, "bf16_gpu": True}, _raw(bf16=True)),
        ({"xla": True}, _raw(bf16=True)),
    ],
    ids=["bf16-off", "fp16", "use-cpu", "bf16-gpu", "xla"],
)
def test_supported_settings_pass(monkeypatch, device, raw):
    _device(monkeypatch, **device)
    assert check_device(raw) is None


# ------------------------------------------------------------------ build_trainer
def test_the_trainer_gets_the_model_settings_and_the_tokenizer(model_dir, data_file, tmp_path, monkeypatch,
                                                               trainer_kwargs):  # fmt: skip
    from transformers import AutoTokenizer

    real, calls, loaded = AutoTokenizer.from_pretrained, [], []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    extra = ["--model_revision", "v1", "--trust_remote_code", "true", "--attn_implementation", "eager",
             "--dtype", "float32", "--use_peft", "true", "--lora_r", "4", "--load_in_8bit", "true"]  # fmt: skip
    build_trainer(*parse_args(run_flags(model_dir, data_file, tmp_path / "out", *extra)))

    assert calls == [((str(model_dir),), {"revision": "v1", "trust_remote_code": True})]
    assert trainer_kwargs["model"] == str(model_dir)
    assert trainer_kwargs["processing_class"] is loaded[0]
    assert trainer_kwargs["args"].model_init_kwargs == {
        "revision": "v1", "trust_remote_code": True, "attn_implementation": "eager", "dtype": "float32"
    }  # fmt: skip
    assert trainer_kwargs["peft_config"].r == 4
    assert trainer_kwargs["quantization_config"].load_in_8bit is True
    assert trainer_kwargs["train_dataset"]["answer"] == ["2", "4", "0", "6", "8"]


@pytest.mark.parametrize(
    ("extra", "flag", "needs"),
    [
        (["--lora_r", "8"], "--lora_r", "--use_peft"),
        (["--lora_target_modules", "q_proj", "v_proj"], "--lora_target_modules", "--use_peft"),
        (["--use_dora", "true"], "--use_dora", "--use_peft"),
        (["--use_peft", "false", "--lora_alpha", "64"], "--lora_alpha", "--use_peft"),
        (["--bnb_4bit_quant_type", "fp4"], "--bnb_4bit_quant_type", "--load_in_4bit"),
        (["--load_in_8bit", "true", "--use_bnb_nested_quant", "true"], "--use_bnb_nested_quant", "--load_in_4bit"),
    ],
)  # fmt: skip
def test_model_flags_that_would_not_act_are_refused_before_anything_loads(model_dir, data_file, tmp_path, monkeypatch,
                                                                          capsys, extra, flag, needs):  # fmt: skip
    """TRL's get_peft_config reads no LoRA flag without --use_peft, get_quantization_config no 4-bit flag without
    --load_in_4bit: such a run would train unlike what the command line says."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", _fail_loading)
    assert main(run_flags(model_dir, data_file, tmp_path / "out", *extra)) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("dhpo-train: error: ") and flag in line and needs in line


def test_reward_weights_for_other_than_the_one_reward_are_refused_before_the_data_loads(model_dir, data_file, tmp_path,
                                                                                      monkeypatch, capsys):
    """dhpo-train trains on one reward (math_verify_reward): two weights are refused before the data or the model
    loads, not by TRL once the policy is in memory."""
    monkeypatch.setattr(cli, "load_training_data", _fail_loading)
    assert main(run_flags(model_dir, data_file, tmp_path / "out", "--reward_weights", "1.0", "2.0")) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("dhpo-train: error: ") and "reward_weights" in line


def _fail_loading(*args, **kwargs):
    raise AssertionError("the tokenizer loaded despite bad input")


@pytest.mark.parametrize(
    "extra, answers, printed",
    [
        (["--max_prompt_length", "200"], ["2", "4", "6", "8"], "Dropped 1 of 5 prompts longer than 200 tokens.\n"),
        (["--max_train_samples", "3"], ["2", "4", "0"], ""),
        (["--max_train_samples", "9"], ["2", "4", "0", "6", "8"], ""),
        (["--max_prompt_length", "200", "--max_train_samples", "3"], ["2", "4", "6"],
         "Dropped 1 of 5 prompts longer than 200 tokens.\n"),
    ],
    ids=["long-prompts", "first-samples", "samples-above-the-size", "both"],
)  # fmt: skip
def test_the_rows_that_reach_the_trainer(model_dir, data_file, tmp_path, trainer_kwargs, capsys, extra, answers,
                                         printed):  # fmt: skip
    build_trainer(*parse_args(run_flags(model_dir, data_file, tmp_path / "out", *extra)))
    assert trainer_kwargs["train_dataset"]["answer"] == answers
    assert capsys.readouterr().out == printed


def test_the_data_must_fill_one_generation_batch(model_dir, data_file, tmp_path, trainer_kwargs):
    flags = run_flags(model_dir, data_file, tmp_path / "out", "--max_train_samples")
    build_trainer(*parse_args([*flags, "2"]))  # exactly one generation batch of 2 prompts
    assert trainer_kwargs["train_dataset"]["answer"] == ["2", "4"]
    with pytest.raises(ValueError) as raised:
        build_trainer(*parse_args([*flags, "1"]))
    assert str(raised.value) == (
        "The dataset has 1 usable problems, fewer than one generation batch of 2 prompts (generation_batch_size 8 / "
        "num_generations 4): use more data or a smaller batch."
    )


def test_a_data_warning_is_given_once(model_dir, tmp_path, trainer_kwargs, caplog):
    data = _jsonl(tmp_path / "train.jsonl", [("What is 1 + 1?", "2"), ("What is 2 + 2?", ""), ("What is 3 + 3?", "6")])
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.scoring.data"):
        build_trainer(*parse_args(run_flags(model_dir, data, tmp_path / "out")))
    assert [record.getMessage() for record in caplog.records] == [
        "Dropped 1 of 3 rows with an empty question or answer."
    ]
    assert trainer_kwargs["train_dataset"]["answer"] == ["2", "6"]


def test_a_missing_model_path_is_named(data_file, tmp_path, capsys):
    flags = run_flags("", data_file, tmp_path / "out")
    del flags[:2]
    assert main(flags) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "dhpo-train: error: --model_name_or_path is required: a Hub model id (e.g. Qwen/Qwen3-1.7B-Base) or a local "
        "folder."
    )


# ------------------------------------------------------------------ load_training_data
def test_the_train_split_flag_picks_the_split(tmp_path):
    folder = tmp_path / "saved"
    DatasetDict(
        train=Dataset.from_dict({"question": ["What is 1 + 1?"], "gt_answer": ["2"]}),
        test=Dataset.from_dict({"question": ["What is 5 + 5?"], "gt_answer": ["10"]}),
    ).save_to_disk(str(folder))
    dataset = load_training_data(DHPOScriptArguments(dataset_name=str(folder), dataset_train_split="test"))
    assert dataset["answer"] == ["10"]


def test_a_silenced_data_logger_stays_silenced(tmp_path, monkeypatch, caplog):
    data = _jsonl(tmp_path / "train.jsonl", [("What is 1 + 1?", "2"), ("What is 2 + 2?", "")])
    monkeypatch.setattr(logging.getLogger("dhpo_trl.scoring.data"), "disabled", True)
    script_args = DHPOScriptArguments(dataset_name=str(data))
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.scoring.data"):
        load_training_data(script_args)
        assert load_training_data(script_args)["answer"] == ["2"]
    assert caplog.records == []


# ------------------------------------------------------------------ drop_long_prompts
@pytest.mark.parametrize("plain_ids", [False, True], ids=["batch-encoding", "plain-ids"])
def test_chat_prompts_are_measured_in_tokens_with_the_generation_prompt(plain_ids):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    if plain_ids:  # tokenizers whose apply_chat_template returns the ids themselves (transformers < 5)
        tokenizer.apply_chat_template = partial(tokenizer.apply_chat_template, return_dict=False)
    rows = {"question": ["What is 1 + 1?", "What is 22 + 22?"], "answer": ["2", "44"]}
    dataset = load_math_dataset(Dataset.from_dict(rows), tokenizer=tokenizer)
    # one token per character of the two messages, one <|endoftext|> after each, and "A:"
    short, long = (sum(len(message["content"]) for message in prompt) + 2 + 2 for prompt in dataset["prompt"])
    assert long == short + 2
    assert drop_long_prompts(dataset, tokenizer, long)["answer"] == ["2", "44"]
    assert drop_long_prompts(dataset, tokenizer, long - 1)["answer"] == ["2"]
    assert drop_long_prompts(dataset, tokenizer, short)["answer"] == ["2"]
    with pytest.raises(ValueError) as raised:
        drop_long_prompts(dataset, tokenizer, short - 1)
    assert str(raised.value) == f"Every prompt is longer than max_prompt_length={short - 1} tokens: raise it."


def test_dropping_prompts_is_reported_only_when_some_are_dropped(capsys):
    tokenizer = build_char_tokenizer()
    rows = {"question": ["1?", "x" * 100, "y" * 100], "answer": ["1", "2", "3"]}
    dataset = load_math_dataset(Dataset.from_dict(rows), tokenizer=tokenizer)
    assert drop_long_prompts(dataset, tokenizer, 500)["answer"] == ["1", "2", "3"]
    assert capsys.readouterr().out == ""
    assert drop_long_prompts(dataset, tokenizer, 150)["answer"] == ["1"]
    assert capsys.readouterr().out == "Dropped 2 of 3 prompts longer than 150 tokens.\n"


# ------------------------------------------------------------------ run_training
class FakeTrainer:
    def __init__(self, graceful_stop=None, **args):
        self.args = SimpleNamespace(**args)
        self.calls = []
        self.graceful_stop = graceful_stop  # DHPOTrainer.train() sets it: None, or how a signal stopped the run
        self.accelerator = SimpleNamespace(is_main_process=True)

    def __getattr__(self, name):  # train, save_model, create_model_card, push_to_hub
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


@pytest.mark.parametrize("push", [False, True], ids=["local", "push"])
def test_run_training_resumes_saves_and_cards_a_hub_dataset(tmp_path, push):
    trainer = FakeTrainer(resume_from_checkpoint="out/checkpoint-4", output_dir="out", push_to_hub=push)
    assert run_training(trainer, DHPOScriptArguments(dataset_name="org/math")) is trainer
    expected = [
        ("train", (), {"resume_from_checkpoint": "out/checkpoint-4"}),
        ("save_model", ("out",), {}),
        ("create_model_card", (), {"dataset_name": "org/math"}),
    ]
    assert trainer.calls == expected + ([("push_to_hub", (), {"dataset_name": "org/math"})] if push else [])


@pytest.mark.parametrize("save_only_model", [False, True])
def test_a_run_stopped_by_a_signal_names_its_checkpoint_and_saves_nothing_else(capsys, save_only_model):
    stop = {"signal": "SIGTERM", "step": 7, "checkpoint": "out/checkpoint-7"}
    trainer = FakeTrainer(graceful_stop=stop, resume_from_checkpoint=None, output_dir="out", push_to_hub=True,
                          save_only_model=save_only_model)  # fmt: skip
    assert run_training(trainer, DHPOScriptArguments(dataset_name="org/math")) is trainer
    assert [name for name, _, _ in trainer.calls] == ["train"]  # no final model, card or push
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "step 7" in lines[0] and "out/checkpoint-7" in lines[0]
    assert "--resume_from_checkpoint latest" in lines[0]  # the stop's checkpoint is full either way (resume.py)
    assert ("save_only_model" in lines[0]) == save_only_model


def test_a_local_dataset_is_not_named_on_the_card(tmp_path, monkeypatch):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "math.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    trainer = FakeTrainer(resume_from_checkpoint=None, output_dir="out", push_to_hub=True)
    run_training(trainer, DHPOScriptArguments(dataset_name="org/math.jsonl"))
    assert trainer.calls[2:] == [
        ("create_model_card", (), {"dataset_name": None}),
        ("push_to_hub", (), {"dataset_name": None}),
    ]


def test_train_builds_then_runs_with_the_script_arguments(monkeypatch):
    """`train` is build_trainer on all three argument groups, then run_training on its trainer and the script args."""
    calls = []
    monkeypatch.setattr(cli, "build_trainer", lambda *args: calls.append(("build", args)) or "the trainer")
    monkeypatch.setattr(cli, "run_training", lambda *args: calls.append(("run", args)) or "the result")
    assert cli.train("script", "training", "model") == "the result"
    assert calls == [("build", ("script", "training", "model")), ("run", ("the trainer", "script"))]


@pytest.mark.parametrize(("rank", "printed"), [("0", True), ("1", False)])
def test_a_nonfinite_gradient_is_one_line_and_status_1(monkeypatch, capsys, rank, printed):
    """`DHPOTrainer.train()` raises `NonFiniteGradientError` on every process at the same step: the main process
    prints it on one line, every process exits 1 (the process groups released without a barrier)."""
    from dhpo_trl import NonFiniteGradientError

    class Raising(FakeTrainer):
        def train(self, **kwargs):
            raise NonFiniteGradientError(5, float("nan"), "out/checkpoint-4")

    trainer = Raising(resume_from_checkpoint=None, output_dir="out", push_to_hub=False)
    released = []
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli, "parse_args", lambda argv: (DHPOScriptArguments(dataset_name="org/math"), None, None))
    monkeypatch.setattr(cli, "build_trainer", lambda *args: trainer)
    monkeypatch.setattr(cli, "release_process_groups", lambda barrier: released.append(barrier) or [])
    assert cli.main([]) == 1
    assert released == [False] and trainer.calls == []  # no final model, card or push
    lines = capsys.readouterr().err.splitlines()
    if not printed:
        assert lines == []
        return
    assert len(lines) == 1 and lines[0].startswith("dhpo-train: error: ")
    assert "step 5" in lines[0] and "out/checkpoint-4" in lines[0] and "stop_on_nonfinite_gradients" in lines[0]
