"""The training script end to end on a tiny local model and a local JSONL file, and what a Hub push would upload."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset
from safetensors.torch import load_file

from dhpo_trl.cli import main
from dhpo_trl.tiny import build_char_tokenizer, build_tiny_qwen3

REPO = Path(__file__).resolve().parents[1]
CITATION_KEY = "min-etal-2026-orchestrating"


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = build_char_tokenizer()
    build_tiny_qwen3(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def local_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"problem": f"What is {a} + {a}?", "solution": str(2 * a)} for a in range(8)]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


def cli_args(model, data, output_dir, *extra):
    # 2 optimizer steps; steps_per_generation 2 > gradient_accumulation_steps 1: off-policy, as in the paper.
    return [
        "--model_name_or_path", str(model), "--dataset_name", str(data),
        "--question_column", "problem", "--answer_column", "solution",
        "--output_dir", str(output_dir), "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--gradient_accumulation_steps", "1", "--steps_per_generation", "2", "--max_completion_length", "8",
        "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2",
        "--learning_rate", "1e-3", "--weight_decay", "0.1", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
        "--dataloader_num_workers", "0", *extra,
    ]  # fmt: skip


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


def test_missing_column_fails_before_the_model_loads(local_model, local_jsonl, tmp_path, monkeypatch):
    def no_model_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was checked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_model_loading)
    args = cli_args(local_model, local_jsonl, tmp_path / "x")
    args[args.index("--answer_column") + 1] = "gt_answer"
    with pytest.raises(ValueError, match=r"'gt_answer'.*\['problem', 'solution'\].*--answer_column"):
        main(args)


def _run(command, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]


def test_accelerate_launch_with_a_yaml_config(local_model, local_jsonl, tmp_path):
    config = tmp_path / "run.yaml"
    flags = cli_args(local_model, local_jsonl, tmp_path / "script_out", "--save_strategy", "no")
    config.write_text("\n".join(f"{k.lstrip('-')}: {v}" for k, v in zip(flags[::2], flags[1::2])))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    _run([*launcher, "examples/train_dhpo.py", "--config", str(config), "--max_steps", "1"])
    assert (tmp_path / "script_out" / "model.safetensors").exists()
    assert CITATION_KEY in (tmp_path / "script_out" / "README.md").read_text()


def test_batch_plan_follows_the_launched_process_count(local_model, local_jsonl, tmp_path):
    """2 prompts x 4 generations per generation batch, 1 prompt per optimizer step, on 2 real processes."""
    flags = cli_args(
        local_model, local_jsonl, tmp_path / "two", "--save_strategy", "no", "--per_device_train_batch_size", "2"
    )
    flags += ["--prompts_per_generation", "2", "--prompts_per_optimizer_step", "1"]
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "examples/train_dhpo.py", *flags])
    card = (tmp_path / "two" / "README.md").read_text()
    # 8 completions / (2 per device x 2 processes) = 2 micro-steps per generation; 4 / 4 = 1 per optimizer step
    assert "| `steps_per_generation` | `2` |" in card and "| `gradient_accumulation_steps` | `1` |" in card


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
def test_max_prompt_length_drops_longer_prompts(chat):
    from dhpo_trl.cli import drop_long_prompts
    from dhpo_trl.data import load_math_dataset

    tokenizer = build_char_tokenizer()  # one token per character
    if chat:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = {"question": ["short?", "x" * 500], "answer": ["1", "2"]}
    dataset = load_math_dataset(Dataset.from_dict(rows), tokenizer=tokenizer)
    kept = drop_long_prompts(dataset, tokenizer, max_tokens=200)
    assert kept["answer"] == ["1"] and kept.column_names == ["prompt", "answer"]
    with pytest.raises(ValueError, match="max_prompt_length=10"):
        drop_long_prompts(dataset, tokenizer, max_tokens=10)
