"""The training script end to end on a tiny local model and a local JSONL file, and what a Hub push would upload."""

import json
import os
import re
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import processes
import pytest
import tiny_cli
from datasets import Dataset
from safetensors.torch import load_file

from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.scale_out.cli import load_recipe, main, parse_args
from dhpo_trl.user_errors import pop_debug_flag

REPO = Path(__file__).resolve().parents[1]
CITATION_KEY = "min-etal-2026-orchestrating"


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    return tiny_cli.write_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def local_jsonl(tmp_path_factory):
    return tiny_cli.write_problems(tmp_path_factory.mktemp("data") / "train.jsonl")


cli_args = tiny_cli.train_flags


class FakeHubApi:
    """Records what `Trainer.push_to_hub` would upload, without network."""

    def __init__(self):
        self.uploads = []

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=(), commit_message=None, **kwargs):
        import fnmatch

        files = sorted(
            os.path.relpath(os.path.join(root, name), folder_path)
            for root, _, names in os.walk(folder_path)
            for name in names
        )
        kept = [f for f in files if not any(fnmatch.fnmatch(f.split(os.sep)[0], p) for p in ignore_patterns or ())]
        readme = Path(folder_path, "README.md")
        self.uploads.append(
            {"repo_id": repo_id, "message": commit_message, "files": kept,
             "readme": readme.read_text() if readme.exists() else ""}
        )  # fmt: skip
        return SimpleNamespace(commit_url="fake", done=lambda: True)  # also stands in for a background push


@pytest.fixture
def fake_hub(monkeypatch):
    api = FakeHubApi()
    monkeypatch.setattr("transformers.trainer.hf_api", lambda: api)
    return api


def test_full_model_trains_two_steps_and_pushes_a_complete_folder(local_model, local_jsonl, tmp_path, fake_hub):
    output_dir = tmp_path / "out"
    main(cli_args(local_model, local_jsonl, output_dir, "--push_to_hub", "true", "--hub_model_id", "me/tiny-dhpo"))

    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert any("dhpo/mixing_weight/mean" in entry for entry in state["log_history"])

    final_push = [u for u in fake_hub.uploads if u["message"] == "End of training"]
    assert len(final_push) == 1 and final_push[0]["repo_id"] == "me/tiny-dhpo"
    uploaded = set(final_push[0]["files"])
    for required in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert required in uploaded, f"{required} missing from the upload: {sorted(uploaded)}"
    assert not any(f.startswith("checkpoint-") for f in uploaded)
    card = final_push[0]["readme"]
    assert CITATION_KEY in card and "## DHPO settings" in card
    assert "| `algorithm` | `dhpo` |" in card and "| `steps_per_generation` | `2` |" in card
    # the push made at the step-2 save (hub_strategy="every_save") carried the weights and the card too
    checkpoint_push = next(u for u in fake_hub.uploads if u["message"] == "Training in progress, step 2")
    assert {"model.safetensors", "config.json", "README.md"} <= set(checkpoint_push["files"])
    assert CITATION_KEY in checkpoint_push["readme"]
    # the uploaded weights are the trained ones, not the initial ones (a random tiny model earns no reward, so
    # it is the paper's weight decay of 0.1 that moves them)
    trained = load_file(output_dir / "model.safetensors")
    initial = load_file(Path(local_model) / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert any(not (trained[k] == initial[k]).all() for k in trained)


def test_lora_saves_adapter_tokenizer_and_card(local_model, local_jsonl, tmp_path, fake_hub):
    output_dir = tmp_path / "lora"
    main(
        cli_args(
            local_model,
            local_jsonl,
            output_dir,
            "--use_peft",
            "true",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--overlay",
            str(REPO / "examples/recipes/algorithms/gspo.yaml"),
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "me/tiny-dhpo-lora",
        )
    )
    uploaded = set(next(u for u in fake_hub.uploads if u["message"] == "End of training")["files"])
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= uploaded
    assert "model.safetensors" not in uploaded  # an adapter upload, not the full weights
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["base_model_name_or_path"] == str(local_model)
    card = (output_dir / "README.md").read_text()
    assert CITATION_KEY in card and "| `algorithm` | `gspo` |" in card
    assert "| `importance_sampling_level` | `sequence` |" in card


@pytest.fixture
def exits_as_the_command():
    with tiny_cli.exits_as_the_command():
        yield


def _fake_deepspeed(folder: Path) -> None:
    """A package laid out as DeepSpeed's: its `__init__` imports `runtime.engine`, as `import deepspeed` does."""
    (folder / "fakeds" / "runtime").mkdir(parents=True)
    (folder / "fakeds" / "__init__.py").write_text("from .runtime.engine import Engine\n")
    (folder / "fakeds" / "runtime" / "__init__.py").write_text("")
    (folder / "fakeds" / "runtime" / "engine.py").write_text("class Engine:\n    pass\n")


@pytest.mark.parametrize("form", ["import fakeds", "from fakeds.runtime import engine", "import fakeds.runtime.engine"])
def test_exits_as_the_command_fails_for_any_import_of_the_engine_and_restores_the_modules(tmp_path, monkeypatch,
                                                                                         form):  # fmt: skip
    """Each form imports the engine in a new process: each fails the block, which leaves the package's modules and
    their attributes as they were (a second engine module would give later tests a second `Engine` class)."""
    _fake_deepspeed(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fakeds", "fakeds.runtime", "fakeds.runtime.engine"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import fakeds

    before = {name: module for name, module in sys.modules.items() if name.startswith("fakeds")}
    with pytest.raises(AssertionError, match="imported DeepSpeed's engine"):
        with tiny_cli.exits_as_the_command("fakeds", "fakeds.runtime.engine"):
            exec(form, {})
    assert {name: module for name, module in sys.modules.items() if name.startswith("fakeds")} == before
    assert fakeds.runtime.engine is before["fakeds.runtime.engine"] and fakeds.Engine is fakeds.runtime.engine.Engine
    with pytest.raises(KeyError):  # an error in the block: the modules are restored all the same
        with tiny_cli.exits_as_the_command("fakeds", "fakeds.runtime.engine"):
            assert "fakeds" not in sys.modules
            raise KeyError("the block's own error")
    assert {name: module for name, module in sys.modules.items() if name.startswith("fakeds")} == before
    with tiny_cli.exits_as_the_command("fakeds", "fakeds.runtime.engine"):
        exec("import json", {})  # no import of the package: the block passes


def _no_loading(monkeypatch):
    """Fail the test if the tokenizer or the model is loaded (the input checks come first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tokenizer or model was loaded before the input was checked")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", refuse)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)


def _one_error_line(capsys) -> str:
    """The last stderr line is the one error line (progress bars may come before it), and there is no traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err[-2000:]
    assert lines[-1].startswith("dhpo-train: error: "), lines[-1]
    return lines[-1]


@pytest.mark.usefixtures("exits_as_the_command")
def test_missing_column_fails_before_the_tokenizer_and_model_load(local_model, local_jsonl, tmp_path, monkeypatch,
                                                                  capsys):  # fmt: skip
    _no_loading(monkeypatch)
    args = cli_args(local_model, local_jsonl, tmp_path / "x")
    args[args.index("--answer_column") + 1] = "gt_answer"
    assert main(args) == 2
    assert re.search(r"'gt_answer'.*\['problem', 'solution'\].*--answer_column", _one_error_line(capsys))
    assert main([*args, "--debug"]) == 2  # --debug: the traceback instead of the line, the same status
    assert capsys.readouterr().err.startswith("Traceback (most recent call last):\n")


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


# (extra argv (with {tmp} and {yaml} filled in), YAML text, what the one error line must say)
USER_ERRORS = {
    "typo-flag": (["--modle_name_or_path", "x"], None,
                  "Unrecognized argument(s): --modle_name_or_path (did you mean --model_name_or_path?)"),
    "missing-local-model": (["--model_name_or_path", "{tmp}/no-such-model"], None,
                            "--model_name_or_path {tmp}/no-such-model does not exist"),
    "model-folder-without-config": (["--model_name_or_path", "{tmp}"], None, "has no config.json"),
    "yaml-unknown-key": (["--config", "{yaml}"], "learning_rat: 1.0e-3\n",
                         "Unknown key(s) in {yaml}: learning_rat (did you mean learning_rate?)"),
    "yaml-syntax": (["--config", "{yaml}"], "learning_rate: [1\n", "is not valid YAML"),
    "yaml-not-a-mapping": (["--config", "{yaml}"], "- 1\n", "must contain a YAML mapping"),
    "yaml-empty-value": (["--config", "{yaml}"], "epsilon_low_token:\n", "epsilon_low_token"),
    "yaml-env-not-a-mapping": (["--config", "{yaml}"], "env: 3\n", "`env` must be a mapping"),
    "missing-config": (["--config", "{tmp}/nope.yaml"], None, "Config file {tmp}/nope.yaml does not exist"),
    "yaml-without-config-flag": (["{yaml}"], "max_steps: 1\n", "(a YAML file goes after --config)"),
    "bad-algorithm": (["--algorithm", "dhpp"], None, "algorithm='dhpp'"),
    "missing-dataset-file": (["--dataset_name", "{tmp}/train.jsonl"], None, "no such file or folder"),
    "missing-checkpoint": (["--resume_from_checkpoint", "{tmp}/checkpoint-7"], None, "checkpoint-7 is not a folder"),
    "output-dir-is-a-file": (["--output_dir", "{yaml}"], "max_steps: 1\n", "--output_dir: cannot create the folder"),
    "zero-batch": (["--per_device_train_batch_size", "0"], None, "--per_device_train_batch_size must be a positive"),
    "batch-plan": (["--prompts_per_generation", "3", "--prompts_per_optimizer_step", "2"], None,
                   "prompts_per_generation=3 and prompts_per_optimizer_step=2"),
}  # fmt: skip


@pytest.mark.usefixtures("exits_as_the_command")
@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_user_errors_are_one_line_with_exit_status_2(case, local_model, local_jsonl, tmp_path, monkeypatch, capsys):
    extra, yaml_text, expected = USER_ERRORS[case]
    yaml_path = _yaml(tmp_path, yaml_text) if yaml_text is not None else ""
    fill = {"tmp": str(tmp_path), "yaml": yaml_path}
    extra = [item.format(**fill) for item in extra]
    args = cli_args(local_model, local_jsonl, tmp_path / "out")
    if "--model_name_or_path" in extra:  # the input checks come before any loading
        _no_loading(monkeypatch)
    assert main([*args, *extra]) == 2
    assert expected.format(**fill) in _one_error_line(capsys)


@pytest.mark.usefixtures("exits_as_the_command")
def test_deepspeed_with_accelerate_use_cpu_is_one_line_before_loading(local_model, local_jsonl, tmp_path, monkeypatch,
                                                                       capsys):  # fmt: skip
    """accelerate would drop the DeepSpeed config (and TRL then fail mid-step, see DHPOConfig): refused at parse."""
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    _no_loading(monkeypatch)
    assert main([*cli_args(local_model, local_jsonl, tmp_path / "out"), "--deepspeed", str(config)]) == 2
    line = _one_error_line(capsys)
    assert "DHPOConfig.deepspeed" in line and "ACCELERATE_USE_CPU='true'" in line


def _without_gpu(monkeypatch, *, cuda: bool):
    monkeypatch.setattr("transformers.utils.is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)


@pytest.mark.usefixtures("exits_as_the_command")
def test_no_gpu_names_the_cpu_flags(local_model, local_jsonl, tmp_path, monkeypatch, capsys):
    """Where transformers would stop with "Your setup doesn't support bf16/gpu", the line says what to pass."""
    _without_gpu(monkeypatch, cuda=False)
    args = cli_args(local_model, local_jsonl, tmp_path / "out")
    for flag in ("--use_cpu", "--bf16"):  # a recipe run on a CPU machine: neither flag given
        index = args.index(flag)
        del args[index : index + 2]
    _no_loading(monkeypatch)
    assert main(args) == 2
    line = _one_error_line(capsys)
    assert "No GPU is visible" in line and "bf16 is on (TRL's default)" in line
    assert "pass --use_cpu true --bf16 false" in line
    assert main([*args, "--bf16", "true"]) == 2  # set explicitly, as the recipes do
    assert "and bf16 is on: to train on CPU pass --use_cpu true --bf16 false" in _one_error_line(capsys)
    _without_gpu(monkeypatch, cuda=True)  # a GPU older than Ampere
    assert main(args) == 2
    assert "this GPU has no bfloat16 support" in _one_error_line(capsys)
    # the flags it names are enough: parsing goes through (no GPU, bf16 off, on CPU)
    _, config, _ = parse_args([*args, "--use_cpu", "true", "--bf16", "false"])
    assert config.use_cpu and not config.bf16


def test_bugs_and_failures_during_training_keep_their_traceback(local_model, local_jsonl, tmp_path, monkeypatch,
                                                                capsys):  # fmt: skip
    from dhpo_trl import DHPOTrainer

    def broken_train(self, *args, **kwargs):
        raise ValueError("raised while training")

    monkeypatch.setattr(DHPOTrainer, "train", broken_train)
    with pytest.raises(ValueError, match="raised while training"):  # the work phase is never an input error
        main(cli_args(local_model, local_jsonl, tmp_path / "out"))

    def bug_in_setup(*args, **kwargs):
        raise KeyError("prompt")

    monkeypatch.setattr("dhpo_trl.scale_out.cli.drop_long_prompts", bug_in_setup)
    with pytest.raises(KeyError):  # another exception type while reading the input: a bug, with its traceback
        main([*cli_args(local_model, local_jsonl, tmp_path / "out"), "--max_prompt_length", "50"])
    assert "error:" not in capsys.readouterr().err


@pytest.mark.usefixtures("exits_as_the_command")
def test_unreachable_vllm_server_is_an_input_error(local_model, local_jsonl, tmp_path, monkeypatch, capsys):
    from dhpo_trl import DHPOTrainer

    message = "The vLLM server can't be reached at http://0.0.0.0:8000 after 240 seconds. Make sure the server..."

    def no_server(self, *args, **kwargs):  # what TRL's VLLMClient raises while the trainer is built
        raise ConnectionError(message)

    monkeypatch.setattr(DHPOTrainer, "__init__", no_server)
    assert main(cli_args(local_model, local_jsonl, tmp_path / "out")) == 2
    assert _one_error_line(capsys) == f"dhpo-train: error: {message}"


@pytest.mark.usefixtures("exits_as_the_command")
def test_missing_tracker_package_is_named_before_the_model_loads(local_model, local_jsonl, tmp_path, monkeypatch,
                                                                 capsys):  # fmt: skip
    monkeypatch.setattr("transformers.integrations.integration_utils.is_wandb_available", lambda: False)
    _no_loading(monkeypatch)
    assert main([*cli_args(local_model, local_jsonl, tmp_path / "out"), "--report_to", "wandb"]) == 2
    assert "--report_to: WandbCallback requires wandb to be installed. Run `pip install wandb`." in _one_error_line(
        capsys
    )


def test_debug_flag_is_ours_only_without_a_value():
    assert pop_debug_flag(["--debug", "--max_steps", "1"]) == (["--max_steps", "1"], True)
    assert pop_debug_flag(["--max_steps", "1", "--debug"]) == (["--max_steps", "1"], True)
    # transformers' own `--debug underflow_overflow` passes through untouched
    assert pop_debug_flag(["--debug", "underflow_overflow"]) == (["--debug", "underflow_overflow"], False)


def test_batch_plan_uses_the_world_size_of_all_nodes(monkeypatch):
    """2 nodes x 8 processes: WORLD_SIZE=16 while each node's LOCAL_WORLD_SIZE is 8; the plan is for 16."""
    from trl import TrlParser

    # Stop at the flags the plan adds: building DHPOConfig with WORLD_SIZE=16 would start a real process group.
    monkeypatch.setattr(TrlParser, "parse_args_into_dataclasses", lambda self, args: args)
    recipe = REPO / "examples/recipes/dhpo_e_qwen3_1.7b_base.yaml"

    def planned(world_size: str, local_world_size: str) -> tuple[str, str]:
        monkeypatch.setenv("WORLD_SIZE", world_size)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
        flags = load_recipe(recipe, overrides={"use_cpu": True, "bf16": False})
        last = {
            name: flags[len(flags) - 1 - flags[::-1].index(name) + 1]
            for name in ("--steps_per_generation", "--gradient_accumulation_steps")
        }
        return last["--steps_per_generation"], last["--gradient_accumulation_steps"]

    # 512 prompts x 16 completions / (16 per device x 16 processes) = 32; 256 x 16 / 256 = 16
    assert planned("16", "8") == ("32", "16")
    assert planned("8", "8") == ("64", "32")  # one node of the same machines
    assert planned("32", "8") == ("16", "8")  # the paper's 4 x 8


@pytest.mark.usefixtures("exits_as_the_command")
def test_script_exits_2_with_one_line_for_a_missing_model(local_jsonl, tmp_path, monkeypatch, capsys):
    """The real entry point, examples/train_dhpo.py, run as __main__ in this process: exit status 2 and one line on
    stderr, no traceback. (Its runs in a new interpreter are the launcher tests below.)"""
    missing = tmp_path / "no-model"
    monkeypatch.setattr(sys, "argv", ["examples/train_dhpo.py", *cli_args(missing, local_jsonl, tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_status:
        runpy.run_path(str(REPO / "examples/train_dhpo.py"), run_name="__main__")
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dhpo-train: error: --model_name_or_path {missing} does not exist. Pass an existing directory or a Hub model id."
    ]


def test_a_one_process_accelerate_launch_on_the_cpu_trains_with_the_plan_for_one_process(local_model, local_jsonl,
                                                                                           tmp_path, monkeypatch):
    """`accelerate launch --cpu --num_processes 1 examples/train_dhpo.py ...` without `--use_cpu`: accelerate's simple
    launcher (no torchrun) runs `python SCRIPT ARGS` in the environment its own code computes, which this test applies
    and runs as `__main__` in this process (a launched interpreter would pay 5-8 s of CPU for the imports). The batch
    plan follows the one process: 8 completions / 2 per device = 4 micro-steps per generation, 2 per optimizer step."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.state import PartialState
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    flags = cli_args(local_model, local_jsonl, tmp_path / "one", "--save_strategy", "no", "--max_steps", "1",
                     "--per_device_train_batch_size", "2", "--prompts_per_generation", "2",
                     "--prompts_per_optimizer_step", "1")  # fmt: skip
    index = flags.index("--use_cpu")
    del flags[index : index + 2]  # the launcher's --cpu alone puts the run on the CPU
    launch = launch_command_parser().parse_args(["--cpu", "--num_processes", "1", "--num_machines", "1",
                                                 "--mixed_precision", "no", "--dynamo_backend", "no",
                                                 "examples/train_dhpo.py", *flags])  # fmt: skip
    launch = _validate_launch_command(launch)[0]
    assert not (launch.multi_gpu or launch.use_deepspeed or launch.use_fsdp)  # the simple launcher: one process
    command, env = prepare_simple_launcher_cmd_env(launch)
    assert command == [sys.executable, "examples/train_dhpo.py", *flags] and env["ACCELERATE_USE_CPU"] == "True"
    for key in {key for key, value in env.items() if os.environ.get(key) != value}:
        monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", command[1:])
    with pytest.raises(SystemExit) as exit_status:
        runpy.run_path(str(REPO / "examples/train_dhpo.py"), run_name="__main__")
    assert exit_status.value.code == 0
    # accelerate's record of the CPU run the launcher's variable asked for: a machine without CUDA trains on the CPU
    # either way, so the device alone would not show that the variable reached the run.
    assert PartialState._shared_state["_cpu"] is True
    assert (tmp_path / "one" / "model.safetensors").exists()
    card = (tmp_path / "one" / "README.md").read_text()
    assert "| `steps_per_generation` | `4` |" in card and "| `gradient_accumulation_steps` | `2` |" in card


def _run(command, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = processes.run(command, env=env, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]


def test_accelerate_launch_with_a_yaml_config_follows_the_launched_process_count(local_model, local_jsonl, tmp_path):
    """`accelerate launch` of the example script with a YAML config, on 2 real processes (DDP over gloo: the config
    says `use_cpu`): the model and its card are saved, and the batch plan follows the launched process count. 2
    prompts x 4 generations per generation batch, 1 prompt per optimizer step."""
    config = tmp_path / "run.yaml"
    flags = cli_args(
        local_model, local_jsonl, tmp_path / "two", "--save_strategy", "no", "--per_device_train_batch_size", "2"
    )
    flags += ["--prompts_per_generation", "2", "--prompts_per_optimizer_step", "1"]
    config.write_text("\n".join(f"{k.lstrip('-')}: {v}" for k, v in zip(flags[::2], flags[1::2])))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launcher += ["--main_process_port", str(processes.free_port())]
    _run([*launcher, "examples/train_dhpo.py", "--config", str(config), "--max_steps", "1"])
    assert (tmp_path / "two" / "model.safetensors").exists()
    card = (tmp_path / "two" / "README.md").read_text()
    assert CITATION_KEY in card
    # 8 completions / (2 per device x 2 processes) = 2 micro-steps per generation; 4 / 4 = 1 per optimizer step
    assert "| `steps_per_generation` | `2` |" in card and "| `gradient_accumulation_steps` | `1` |" in card


def test_prompts_follow_the_tokenizer_read_after_the_data(local_jsonl, tmp_path, monkeypatch):
    """The data is checked before the tokenizer loads, yet a tokenizer with a chat template still gets chat prompts."""
    from dhpo_trl import DHPOTrainer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model_dir = tmp_path / "chat-model"
    build_tiny_qwen3(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    seen = {}

    def capture(self, *args, train_dataset=None, **kwargs):
        seen["prompt"] = train_dataset[0]["prompt"]
        raise ConnectionError("stop here")

    monkeypatch.setattr(DHPOTrainer, "__init__", capture)
    assert main(cli_args(model_dir, local_jsonl, tmp_path / "out")) == 2
    assert [m["role"] for m in seen["prompt"]] == ["system", "user"]
    assert seen["prompt"][1]["content"].startswith("What is 0 + 0?")


def test_max_prompt_length_keeps_a_prompt_exactly_at_the_limit():
    from dhpo_trl.scale_out.cli import drop_long_prompts
    from dhpo_trl.scoring.data import load_math_dataset

    tokenizer = build_char_tokenizer()  # no special tokens added: the prompt's own tokens are all there is
    dataset = load_math_dataset(Dataset.from_dict({"question": ["1+1?", "22+22?"], "answer": ["2", "44"]}),
                                tokenizer=tokenizer)  # fmt: skip
    short, long = (len(tokenizer.tokenize(prompt)) for prompt in dataset["prompt"])
    assert long == short + 2
    assert drop_long_prompts(dataset, tokenizer, max_tokens=long)["answer"] == ["2", "44"]  # at the limit: kept
    assert drop_long_prompts(dataset, tokenizer, max_tokens=long - 1)["answer"] == ["2"]  # one over: dropped
    assert drop_long_prompts(dataset, tokenizer, max_tokens=short)["answer"] == ["2"]
    with pytest.raises(ValueError, match=f"max_prompt_length={short - 1}"):
        drop_long_prompts(dataset, tokenizer, max_tokens=short - 1)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
def test_max_prompt_length_drops_longer_prompts(chat):
    from dhpo_trl.scale_out.cli import drop_long_prompts
    from dhpo_trl.scoring.data import load_math_dataset

    tokenizer = build_char_tokenizer()  # one token per character
    if chat:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = {"question": ["short?", "x" * 500], "answer": ["1", "2"]}
    dataset = load_math_dataset(Dataset.from_dict(rows), tokenizer=tokenizer)
    kept = drop_long_prompts(dataset, tokenizer, max_tokens=200)
    assert kept["answer"] == ["1"] and kept.column_names == ["prompt", "answer"]
    with pytest.raises(ValueError, match="max_prompt_length=10"):
        drop_long_prompts(dataset, tokenizer, max_tokens=10)


@pytest.mark.parametrize(
    "settings, subset",
    [
        (dict(), "simplelr_qwen_level3to5"),  # the paper's data: its subset by default
        (dict(dataset_config="simplelr_qwen_level1to4"), "simplelr_qwen_level1to4"),
        (dict(dataset_name="data/train.parquet"), None),  # other data: no subset unless asked for
        (dict(dataset_name="org/other", dataset_config="main"), "main"),
    ],
)
def test_the_paper_subset_is_the_default_only_for_the_paper_dataset(monkeypatch, settings, subset):
    seen = {}
    monkeypatch.setattr("dhpo_trl.scale_out.cli.load_math_dataset", lambda name, **kwargs: seen.update(name=name, **kwargs))
    from dhpo_trl.scale_out.cli import DHPOScriptArguments, load_training_data

    load_training_data(DHPOScriptArguments(**settings))
    assert seen["subset"] == subset
    assert seen["name"] == settings.get("dataset_name", "hkust-nlp/SimpleRL-Zoo-Data")


def test_the_command_destroys_the_process_group_it_trained_in(local_model, local_jsonl, tmp_path):
    """Left to interpreter finalisation, gloo's threads can hang or abort a finished run (see training.teardown)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        flags = ("--save_strategy", "no", "--max_steps", "1")
        assert main(cli_args(local_model, local_jsonl, tmp_path / "out", *flags)) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
