"""One line and exit status 2 for input errors, tracebacks for bugs: the shared rule and every command that uses it
(dhpo-train's cases are in test_cli.py)."""

import json

import pytest
from benchmark_fixtures import FIXTURES

from dhpo_trl import embedded, plotting
from dhpo_trl.evaluation import cli as evaluate_cli
from dhpo_trl.user_errors import check_model_path, one_line, run_command


def _fail(error):
    def raise_it(*args, **kwargs):
        raise error

    return raise_it


def test_run_command_classifies_by_phase_and_type(capsys):
    assert run_command("tool", _fail(ValueError("bad\n  value")), print) == 2
    assert capsys.readouterr().err == "tool: error: bad value\n"  # one line, even for a multi-line message
    assert run_command("tool", _fail(FileNotFoundError(2, "No such file or directory", "x.yaml"))) == 2
    assert capsys.readouterr().err == "tool: error: x.yaml: No such file or directory\n"
    assert run_command("tool", _fail(ImportError("pip install 'dhpo-trl[vllm]'"))) == 2
    assert run_command("tool", _fail(ConnectionError("server down"))) == 2
    assert capsys.readouterr().err.splitlines() == [
        "tool: error: pip install 'dhpo-trl[vllm]'",
        "tool: error: server down",
    ]
    with pytest.raises(KeyError):  # another type while reading the input: a bug
        run_command("tool", _fail(KeyError("prompt")))
    with pytest.raises(ValueError, match="late"):  # the work itself: never an input error
        run_command("tool", lambda: 1, _fail(ValueError("late")))
    with pytest.raises(ValueError, match="bad"):  # --debug
        run_command("tool", _fail(ValueError("bad")), debug=True)
    assert run_command("tool", lambda: 3, lambda value: print(value * 2)) == 0
    assert capsys.readouterr().out == "6\n"
    assert one_line(ValueError()) == "ValueError"


def test_model_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "outputs").mkdir()
    assert check_model_path(str(tmp_path / "full")) == "local"
    assert check_model_path("adapter") == "local"
    for hub_id in ("Qwen/Qwen3-1.7B-Base", "gpt2", "org/model.v2"):
        assert check_model_path(hub_id) == "hub"
    for missing in ("./nope", "~/surely-not-here-dhpo", "/abs/nope", "outputs/checkpoint-5", "a/b/c", "bad name"):
        with pytest.raises(ValueError, match=f"--model_name_or_path {missing} does not exist"):
            check_model_path(missing, label="--model_name_or_path")
    with pytest.raises(ValueError, match="outputs has no config.json"):
        check_model_path("outputs")


# ------------------------------------------------------------------ dhpo-evaluate
@pytest.fixture
def eval_base(tmp_path):
    return ["--data", f"gsm8k={FIXTURES / 'gsm8k' / 'test.jsonl'}", "--benchmarks", "gsm8k", "--backend",
            "transformers", "--max-new-tokens", "2", "--limit", "1", "--output", str(tmp_path / "out" / "r.json")]  # fmt: skip


def _last_line(capsys, prog):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: ")
    return line


def test_evaluate_input_errors(saved_tiny_model, eval_base, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert evaluate_cli.main([str(saved_tiny_model), *eval_base, "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA GPU is visible" in _last_line(capsys, "dhpo-evaluate")
    (tmp_path / "file").write_text("")
    assert evaluate_cli.main([str(saved_tiny_model), *eval_base, "--output", str(tmp_path / "file" / "r.json")]) == 2
    assert f"--output: cannot create the folder {tmp_path / 'file'}" in _last_line(capsys, "dhpo-evaluate")
    with pytest.raises(evaluate_cli.InputError, match="no CUDA GPU"):
        evaluate_cli.main([str(saved_tiny_model), *eval_base, "--device", "cuda", "--debug"])
    for bad in (["--batch-size", "0"], ["--dtype", "bfloat32"], ["--limit", "-1"]):
        with pytest.raises(SystemExit) as exit_info:  # argparse's own error, naming the flag
            evaluate_cli.main([str(saved_tiny_model), *eval_base, *bad])
        assert exit_info.value.code == 2 and f"argument {bad[0]}" in capsys.readouterr().err


def test_evaluate_failure_while_sampling_keeps_its_traceback(saved_tiny_model, eval_base, monkeypatch):
    monkeypatch.setattr(evaluate_cli, "evaluate_problems", _fail(ValueError("inside generate")))
    with pytest.raises(ValueError, match="inside generate"):
        evaluate_cli.main([str(saved_tiny_model), *eval_base])


def test_evaluate_runs_through_main(saved_tiny_model, eval_base, tmp_path):
    assert evaluate_cli.main([str(saved_tiny_model), *eval_base]) == 0
    assert json.loads((tmp_path / "out" / "r.json").read_text())["benchmarks"]["gsm8k"]["num_problems"] == 1


@pytest.fixture
def saved_tiny_model(tmp_path_factory, tokenizer, tiny_model):
    path = tmp_path_factory.mktemp("model")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ------------------------------------------------------------------ dhpo-plot and python -m dhpo_trl
def test_plot_input_errors(tmp_path, capsys):
    assert plotting.main([str(tmp_path / "nope"), "--out", str(tmp_path / "plots")]) == 2
    assert f"Run {tmp_path / 'nope'} does not exist" in _last_line(capsys, "dhpo-plot")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "trainer_state.json").write_text("{not json")
    assert plotting.main([str(broken), "--out", str(tmp_path / "plots")]) == 2
    _last_line(capsys, "dhpo-plot")
    with pytest.raises(ValueError, match="does not exist"):
        plotting.main([str(tmp_path / "nope"), "--out", str(tmp_path / "plots"), "--debug"])


def test_embedded_input_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(embedded, "run_embedded", _fail(AssertionError("the run started despite bad input")))
    (tmp_path / "file").write_text("")
    assert embedded.main(["--output-dir", str(tmp_path / "file" / "run")]) == 2
    assert "--output-dir: cannot create the folder" in _last_line(capsys, "python -m dhpo_trl")
    assert embedded.main(["--output-dir", str(tmp_path / "ok"), "--cache-dir", str(tmp_path / "file")]) == 2
    assert "--cache-dir: cannot create the folder" in _last_line(capsys, "python -m dhpo_trl")
    for bad in (["--max-steps", "0"], ["--eval-every", "-3"], ["--num-heldout", "x"], ["--algorithm", "PPO"]):
        with pytest.raises(SystemExit) as exit_info:
            embedded.main(bad)
        assert exit_info.value.code == 2 and f"argument {bad[0]}" in capsys.readouterr().err
