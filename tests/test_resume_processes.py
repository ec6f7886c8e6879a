"""Exact resume and the graceful stop in separate processes: 2 forked ranks with torchrun's environment (gloo), and
`dhpo-train` stopped by SIGTERM (exit status 0, one line naming the checkpoint) then resumed with
`--resume_from_checkpoint latest`.

Every process is started in its own session and its whole group is killed if the test fails or times out. The
stopped command runs in a process served by the fork server of the two ranks' launch (`tests/served_python.py`:
`python SCRIPT ARGS` without the package's import), its own exit status and output.
"""

import json
import os
from pathlib import Path

import processes
import pytest
import tiny_cli
import torch
from safetensors.torch import load_file

from dhpo_trl.scale_out.cli import main
from dhpo_trl.training import batching, resume

TESTS = Path(__file__).parent
REPO = TESTS.parent
# No PYTHONPATH: the forked ranks and the served command inherit the fork server's imports and path (the package is
# installed from this checkout), and a variable the imports read would start a server of its own
# (`fork_server.IMPORT_PREFIXES`).
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "ACCELERATE_USE_CPU": "1"}  # fmt: skip


def run_own_group(command, timeout=240, env=ENV):
    """Run `command` in a new session; its whole process group is stopped on the way out (tests/processes.py)."""
    result = processes.run(command, timeout=timeout, env=env, cwd=REPO)
    return result.returncode, result.stdout, result.stderr


# ------------------------------------------------------------------------------------------- two processes
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_two_ranks")
    script = TESTS / "dist_scripts" / "resume_distributed.py"
    result = processes.forked_ranks(script, out, timeout=240, env=ENV, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = ("full", "resumed", "stopped", "after", "budget_full", "budget_resumed", "epoch_full", "epoch_resumed")
    dumps = {(run, rank): json.loads((out / f"{run}_rank{rank}.json").read_text()) for run in runs for rank in (0, 1)}
    return {**dumps, "out": out}


def _max_gap(a, b):
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


@pytest.mark.parametrize("full_run, run", [("full", "resumed"), ("full", "after"), ("budget_full", "budget_resumed"),
                                           ("epoch_full", "epoch_resumed")])  # fmt: skip
def test_two_ranks_resume_to_the_uninterrupted_run(two_ranks, full_run, run):
    """From a mid-generation checkpoint (step 3 of k = 4; step 1 of k = 4 under a token budget; step 5, in epoch 2,
    logging every 3 steps), and from the one the graceful stop wrote: every rank ends with the uninterrupted
    parameters, logs (train_loss included) and data."""
    first, last = {"resumed": (4, 6), "after": (3, 6), "budget_resumed": (2, 4), "epoch_resumed": (6, 8)}[run]
    for rank in (0, 1):
        full, resumed = two_ranks[full_run, rank], two_ranks[run, rank]
        assert full["world_size"] == resumed["world_size"] == 2 and resumed["global_step"] == last
        assert _max_gap(full["params"], resumed["params"]) <= 1e-6
        assert sorted(resumed["seen"], key=int) == [str(step) for step in range(first, last + 1)]
        assert all(resumed["seen"][step] == full["seen"][step] for step in resumed["seen"])
        logged = [step for step in resumed["seen"] if step in full["logs"]]
        assert logged and all(resumed["logs"][step] == pytest.approx(full["logs"][step], rel=1e-6, abs=1e-9)
                              for step in logged)  # fmt: skip
        assert resumed["train_loss"] == pytest.approx(full["train_loss"], rel=1e-6)
    assert two_ranks["full", 0]["seen"]["4"] != two_ranks["full", 1]["seen"]["4"]  # each rank has its own rows


def test_two_ranks_save_their_own_planned_passes(two_ranks):
    """Under the token budget each rank's file holds its own rows, cut into the pass count the ranks agreed on."""
    buffers = []
    for rank in (0, 1):
        path = two_ranks["out"] / "budget_full" / "checkpoint-1" / f"dhpo_generation_state_rank{rank}.pt"
        buffers.append(resume.decode(torch.load(path, weights_only=True)["_buffered_inputs"]))
    counts = [[len(micro) if isinstance(micro, batching.Passes) else 1 for micro in buffer] for buffer in buffers]
    assert counts[0] == counts[1] and max(counts[0]) > 1  # agreed, and split for real
    assert not torch.equal(buffers[0][0][0]["prompt_ids"], buffers[1][0][0]["prompt_ids"])


def test_a_signal_to_one_rank_stops_both_after_the_same_step(two_ranks):
    stop0, stop1 = two_ranks["stopped", 0], two_ranks["stopped", 1]
    assert stop0["global_step"] == stop1["global_step"] == 2
    assert stop0["graceful_stop"]["signal"] == "SIGTERM" and stop1["graceful_stop"]["step"] == 2
    assert stop0["graceful_stop"]["checkpoint"].endswith("checkpoint-2")
    assert all(two_ranks[run, rank]["handlers_restored"] for run in ("full", "stopped") for rank in (0, 1))


# ----------------------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    return tiny_cli.write_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def local_jsonl(tmp_path_factory):
    return tiny_cli.write_problems(tmp_path_factory.mktemp("data") / "train.jsonl")


def cli_args(model, data, output_dir, *extra):
    # k = 4 optimizer steps per generation batch, a checkpoint every step. The tiny model never answers right, so
    # the entropy bonus is what moves the parameters (through the sampled completions).
    return [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--question_column", "problem",
        "--answer_column", "solution", "--output_dir", str(output_dir), "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--gradient_accumulation_steps", "1", "--steps_per_generation", "4",
        "--max_completion_length", "8", "--max_steps", "5", "--logging_steps", "1", "--save_strategy", "steps",
        "--save_steps", "1", "--learning_rate", "3e-2", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
        "--dataloader_num_workers", "0", "--seed", "0", "--entropy_coef", "0.5", *extra,  # moves: rewards are 0
    ]  # fmt: skip


def test_sigterm_stops_the_command_with_a_checkpoint_and_latest_resumes_it(local_model, local_jsonl, tmp_path):
    main(cli_args(local_model, local_jsonl, tmp_path / "full"))
    stopped = tmp_path / "stopped"
    python, env = processes.served_python(ENV, timeout=240)  # the server of the two ranks' launch above
    command = [*python, str(TESTS / "dist_scripts" / "signal_at_step.py"), "2",
               *cli_args(local_model, local_jsonl, stopped)]  # fmt: skip
    code, out, err = run_own_group(command, env=env)
    assert code == 0, err[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("dhpo-train: stopped")]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and str(stopped / "checkpoint-2") in lines[0], out[-2000:]
    assert sorted(p.name for p in stopped.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert resume.incomplete_reason(str(stopped / "checkpoint-2")) is None
    assert not (stopped / "model.safetensors").exists()  # a stopped run is not a finished one
    assert main(cli_args(local_model, local_jsonl, stopped, "--resume_from_checkpoint", "latest")) == 0
    full, after = load_file(tmp_path / "full" / "model.safetensors"), load_file(stopped / "model.safetensors")
    assert max((full[name] - after[name]).abs().max().item() for name in full) <= 1e-6
    trained = load_file(tmp_path / "full" / "checkpoint-1" / "model.safetensors")
    assert max((full[name] - trained[name]).abs().max().item() for name in full) > 1e-3  # later steps mattered


def test_settings_mismatch_is_refused_before_the_model_loads(local_model, local_jsonl, tmp_path, monkeypatch, capsys):
    main(cli_args(local_model, local_jsonl, tmp_path, "--max_steps", "1"))
    capsys.readouterr()

    def refuse(*args, **kwargs):
        raise AssertionError("a tokenizer or model was loaded before the resume was checked")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", refuse)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)
    checkpoint = str(tmp_path / "checkpoint-1")
    args = cli_args(local_model, local_jsonl, tmp_path, "--resume_from_checkpoint", checkpoint)
    with tiny_cli.exits_as_the_command():
        assert main([*args, "--steps_per_generation", "2"]) == 2
        assert "steps_per_generation=4" in capsys.readouterr().err
        assert main([*args, "--algorithm", "gspo"]) == 2
        assert "algorithm='dhpo'" in capsys.readouterr().err
        assert main([*args, "--beta", "0.1"]) == 2  # the buffer would lack the reference log-probs
        assert "beta=0.0 in the checkpoint" in capsys.readouterr().err
        marker = tmp_path / "checkpoint-1" / resume.COMPLETE_MARKER  # as if saved by 2 processes
        saved = json.loads(marker.read_text())
        marker.write_text(json.dumps({**saved, "settings": {**saved["settings"], "world_size": 2}}))
        assert main(args) == 2
        assert "world_size=2" in capsys.readouterr().err
        assert main([*cli_args(local_model, local_jsonl, tmp_path), "--resume_from_checkpoint", str(tmp_path)]) == 2
        assert "trainer_state.json" in capsys.readouterr().err  # output_dir itself is not a checkpoint
