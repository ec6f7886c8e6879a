"""One line and exit status 2 for input errors, tracebacks for bugs: the shared rule and every command that uses it
(dhpo-train's cases are in test_cli.py)."""

import argparse
import json
import traceback

import numpy as np
import pytest
from benchmark_fixtures import FIXTURES

from dhpo_trl.demo import embedded
from dhpo_trl.evaluation import cli as evaluate_cli
from dhpo_trl.evaluation import plotting
from dhpo_trl.user_errors import (
    DEBUG_FLAG,
    check_model_path,
    debug_given,
    make_folder,
    one_line,
    pop_debug_flag,
    positive_int,
    repeated_values,
    report,
    seed_int,
    run_command,
)


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
    assert run_command("tool", _fail(ValueError("bad")), debug=True) == 2  # --debug: the same status
    debugged = capsys.readouterr().err
    assert debugged.startswith("Traceback (most recent call last):\n") and "tool: error:" not in debugged
    report("tool", ValueError("bad\n  value"))  # called directly, without `debug`: the one line
    assert capsys.readouterr().err == "tool: error: bad value\n"
    assert run_command("tool", lambda: 3, lambda value: print(value * 2)) == 0
    assert capsys.readouterr().out == "6\n"
    assert one_line(ValueError()) == "ValueError"


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize(
    ("setup_error", "work_error"),
    [(KeyError("prompt"), None), (None, ValueError("late")), (KeyboardInterrupt(), None), (None, KeyboardInterrupt()),
     (SystemExit(5), None), (None, SystemExit(5))],
)  # fmt: skip
def test_run_command_reports_no_bug_and_no_interrupt_with_or_without_debug(setup_error, work_error, debug, capsys):
    """What is no input error leaves `run_command` as it was raised, the very object, and nothing is printed: a bug
    (another type, or raised by the work), Ctrl-C, an exit."""
    raised = setup_error or work_error
    setup = _fail(setup_error) if setup_error else lambda: 1
    work = _fail(work_error) if work_error else print
    with pytest.raises(BaseException) as caught:
        run_command("tool", setup, work, debug=debug)
    assert caught.value is raised and capsys.readouterr().err == ""


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


def test_run_command_passes_the_setup_result_to_the_work_and_reports_success(capsys):
    seen = []
    assert run_command("tool", lambda: {"rows": 3}, seen.append) == 0
    assert seen == [{"rows": 3}]
    assert run_command("tool", lambda: seen.append("setup only")) == 0  # no work: setup still runs
    assert seen == [{"rows": 3}, "setup only"]
    assert capsys.readouterr().err == ""
    error = OSError("plain message, no file name")
    assert run_command("tool", _fail(error), debug=True) == 2
    assert capsys.readouterr().err == "".join(traceback.format_exception(error))  # --debug: the very exception's
    assert run_command("dhpo-x", _fail(error)) == 2
    assert capsys.readouterr().err == "dhpo-x: error: plain message, no file name\n"


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (ValueError("a\n  b\tc "), "a b c"),
        (FileNotFoundError(2, "No such file or directory", "data/x.jsonl"), "data/x.jsonl: No such file or directory"),
        (PermissionError(13, "Permission denied", "/root/out"), "/root/out: Permission denied"),
        (OSError(2, "No such file or directory"), "[Errno 2] No such file or directory"),  # no file name
        (FileNotFoundError(2, "", "f.txt"), "[Errno 2] : 'f.txt'"),  # a file name but no reason: the full text
        (OSError("connection refused"), "connection refused"),
        (ImportError(), "ImportError"),
        (ValueError("   \n "), "ValueError"),
    ],
)
def test_one_line(error, line):
    assert one_line(error) == line


@pytest.mark.parametrize(
    ("argv", "rest", "debug"),
    [
        ([], [], False),
        (["--debug"], [], True),
        (["run.yaml", "--debug"], ["run.yaml"], True),  # last: bare
        (["--debug", "--lr", "1"], ["--lr", "1"], True),  # followed by a flag: bare
        (["--debug", "-v"], ["-v"], True),  # a short flag too
        (["--debug", "underflow_overflow"], ["--debug", "underflow_overflow"], False),  # transformers' --debug VALUE
        (["--debug", "--debug"], [], True),  # every bare one goes
        (["--debug=1", "--debugging"], ["--debug=1", "--debugging"], False),  # other spellings are not ours
        (["a", "--debug", "b", "--debug"], ["a", "--debug", "b"], True),
    ],
)
def test_pop_debug_flag(argv, rest, debug):
    original = list(argv)
    assert pop_debug_flag(argv) == (rest, debug)
    assert argv == original  # the caller's list is not edited
    assert DEBUG_FLAG == "--debug"


@pytest.mark.parametrize(
    "argv",
    [[], ["--debug"], ["--deb"], ["--debu"], ["--deb", "--workers", "2"], ["--workers", "2"], ["--docs-dir", "d"],
     ["--do", "d"], ["--", "--deb"], ["--debug", "--", "x"], ["-d"]],  # fmt: skip
)
def test_debug_given_reads_debug_as_argparse_does(argv):
    """`debug_given` against argparse itself, on a parser with a flag sharing `--d` (`--docs-dir`, as study.py's):
    the flag and the prefixes argparse takes for it, not the arguments after `--` (a positional there)."""
    parser = argparse.ArgumentParser(prog="study.py")
    parser.add_argument("--workers")
    parser.add_argument("--docs-dir")
    parser.add_argument("-d", dest="short", action="store_true")
    parser.add_argument(DEBUG_FLAG, action="store_true")
    parser.add_argument("rest", nargs="*")
    assert debug_given(argv) is parser.parse_args(argv).debug


@pytest.mark.parametrize(("text", "value"), [("1", 1), ("2", 2), ("007", 7), (" 12 ", 12), ("16384", 16384)])
def test_positive_int_accepts_whole_numbers_from_one(text, value):
    assert positive_int(text) == value


REFUSED_COUNTS = ["0", "00", "-1", "+3", "", " ", "1.0", "1e3", "abc", "2x", "\u00b2", "\u2460"]  # ² and ① are digits


@pytest.mark.parametrize("text", REFUSED_COUNTS, ids=[f"refused{i}" for i in range(len(REFUSED_COUNTS))])
def test_positive_int_refuses_the_rest_in_argparse_terms(text):
    with pytest.raises(argparse.ArgumentTypeError) as error:  # not a ValueError: argparse names the flag itself
        positive_int(text)
    assert str(error.value) == f"expected a positive whole number, got {text!r}"


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("42", 42), (" 7 ", 7), ("4294967295", 2**32 - 1)])
def test_seed_int_accepts_what_numpy_seeds_with(text, value):
    assert seed_int(text) == value
    np.random.seed(value)  # accelerate's set_seed seeds numpy's legacy generator with it


@pytest.mark.parametrize("text", ["-1", "4294967296", "1.5", "", "abc", "\u00b2"])
def test_seed_int_refuses_the_rest_in_argparse_terms(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"2\*\*32 - 1"):
        seed_int(text)


def test_repeated_values_names_the_first_option_with_a_repeat_and_its_repeated_values():
    args = argparse.Namespace(seeds=[3, 1, 3, 2, 1, 1], objectives=["GRPO", "GRPO"], ks=None, empty=[])
    assert repeated_values(args, "ks", "empty") is None  # None (an option not given) and [] hold nothing
    assert repeated_values(argparse.Namespace(seeds=[0, 1, 2]), "seeds") is None
    message = repeated_values(args, "ks", "seeds", "objectives")
    assert message.startswith("--seeds:") and message.split(":")[1].split()[:2] == ["3", "1"]  # in order, each once
    assert "\n" not in message and "2" not in message.split(":")[1].split()
    assert repeated_values(args, "objectives").startswith("--objectives: GRPO ")
    # Named as the flag is typed: argparse's dest reference_seeds is --reference-seeds.
    named = repeated_values(argparse.Namespace(reference_seeds=[5, 5]), "reference_seeds")
    assert named.startswith("--reference-seeds:"), named


def test_make_folder_creates_parents_or_names_the_flag_and_the_folder(tmp_path, monkeypatch):
    make_folder(tmp_path / "a" / "b" / "c", "--output")
    assert (tmp_path / "a" / "b" / "c").is_dir()
    make_folder(tmp_path / "a", "--output")  # an existing folder is fine
    monkeypatch.setenv("HOME", str(tmp_path))
    make_folder("~/from-home", "--cache-dir")  # "~" is the user's home, not a folder named "~"
    assert (tmp_path / "from-home").is_dir()
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "run"
    with pytest.raises(ValueError) as error:
        make_folder(target, "--output-dir")
    assert str(error.value) == f"--output-dir: cannot create the folder {target} ({target}: Not a directory)."
    assert isinstance(error.value.__cause__, NotADirectoryError)


def test_model_path_boundaries(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").mkdir()  # a folder named config.json is not a config file
    (tmp_path / "weights.bin").write_text("")
    for name, path in (("odd", tmp_path / "odd"), ("weights.bin", tmp_path / "weights.bin")):
        with pytest.raises(ValueError) as error:
            check_model_path(name)
        assert str(error.value) == (
            f"Model path {name} has no config.json: pass a saved model or checkpoint directory, or a Hub model id."
        )
    for hub_id in ("a", "9", "Qwen/Q", "a-b_c.d/e-f_g.h", "A1/_x"):
        assert check_model_path(hub_id) == "hub", hub_id
    for bad in ("-model", "_model", ".model", "org/", "/model", "org//m", "a/b/c", "org/m+1", "b\u00e4d/\u00fc"):
        with pytest.raises(ValueError) as error:
            check_model_path(bad, label="Checkpoint path")
        assert (
            str(error.value) == f"Checkpoint path {bad} does not exist. Pass an existing directory or a Hub model id."
        )


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("Qwen/Qwen3-8B\n", r"'Qwen/Qwen3-8B\n' has leading or trailing whitespace: pass 'Qwen/Qwen3-8B'."),
        ("gpt2 ", "'gpt2 ' has leading or trailing whitespace: pass 'gpt2'."),
        ("\tgpt2", r"'\tgpt2' has leading or trailing whitespace: pass 'gpt2'."),
        ("./out/ckpt\r\n", r"'./out/ckpt\r\n' has leading or trailing whitespace: pass './out/ckpt'."),
    ],
    ids=["newline", "space", "tab", "crlf"],
)
def test_model_path_with_stray_whitespace_is_refused_in_one_line(tmp_path, monkeypatch, model, message):
    """A trailing newline from a config file or `$(cat ...)` is not a Hub id ("$" of a regex would accept it)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        check_model_path(model, label="--model_name_or_path")
    assert str(error.value) == f"--model_name_or_path {message}"
    assert "\n" not in str(error.value)


def test_an_existing_folder_whose_name_ends_in_a_space_is_still_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run ").mkdir()
    (tmp_path / "run " / "config.json").write_text("{}")
    assert check_model_path("run ") == "local"


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
    assert evaluate_cli.main([str(saved_tiny_model), *eval_base, "--device", "cuda", "--debug"]) == 2
    assert capsys.readouterr().err.startswith("Traceback (most recent call last):\n")
    for bad in (["--batch-size", "0"], ["--dtype", "bfloat32"], ["--limit", "-1"], ["--seed", "-1"]):
        with pytest.raises(SystemExit) as exit_info:  # argparse's own error, naming the flag
            evaluate_cli.main([str(saved_tiny_model), *eval_base, *bad])
        assert exit_info.value.code == 2 and f"argument {bad[0]}" in capsys.readouterr().err


def test_evaluate_refuses_flags_that_would_not_act(saved_tiny_model, eval_base, monkeypatch, capsys):
    """Per-benchmark flags for a benchmark not selected, and one backend's flags with the other: one line naming the
    flag, before any model loads."""
    monkeypatch.setattr(evaluate_cli, "_load_transformers_backend", _fail(AssertionError("loaded despite bad input")))
    monkeypatch.setattr(evaluate_cli, "VLLMBackend", _fail(AssertionError("loaded despite bad input")))
    math500 = f"math500={FIXTURES / 'math500' / 'test.jsonl'}"
    for bad, flag in ((["--samples", "math500=4"], "--samples"), (["--data", math500], "--data"),
                      (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
                      (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization"),
                      (["--max-model-len", "512"], "--max-model-len"),
                      (["--backend", "vllm", "--batch-size", "4"], "--batch-size"),
                      (["--backend", "vllm", "--device", "cpu"], "--device")):  # fmt: skip
        assert evaluate_cli.main([str(saved_tiny_model), *eval_base, *bad]) == 2, bad
        assert flag in _last_line(capsys, "dhpo-evaluate")
    with pytest.raises(AssertionError, match="loaded despite bad input"):  # every flag acts: the model loads
        evaluate_cli.main([str(saved_tiny_model), *eval_base, "--samples", "math500=2", "--batch-size", "4",
                           "--data", math500, "--benchmarks", "gsm8k,math500"])  # fmt: skip


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
    assert plotting.main([str(tmp_path / "nope"), "--out", str(tmp_path / "plots"), "--debug"]) == 2
    assert capsys.readouterr().err.startswith("Traceback (most recent call last):\n")


def test_embedded_input_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(embedded, "run_embedded", _fail(AssertionError("the run started despite bad input")))
    (tmp_path / "file").write_text("")
    assert embedded.main(["--output-dir", str(tmp_path / "file" / "run")]) == 2
    assert "--output-dir: cannot create the folder" in _last_line(capsys, "python -m dhpo_trl")
    assert embedded.main(["--output-dir", str(tmp_path / "ok"), "--cache-dir", str(tmp_path / "file")]) == 2
    assert "--cache-dir: cannot create the folder" in _last_line(capsys, "python -m dhpo_trl")
    for bad in (["--max-steps", "0"], ["--eval-every", "-3"], ["--num-heldout", "x"], ["--algorithm", "PPO"],
                ["--seed", "-1"], ["--seed", str(2**32)]):
        with pytest.raises(SystemExit) as exit_info:
            embedded.main(bad)
        assert exit_info.value.code == 2 and f"argument {bad[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # the cache folder is never read or written without the cache
        embedded.main(["--output-dir", str(tmp_path / "ok"), "--no-cache", "--cache-dir", str(tmp_path / "cache")])
    assert exit_info.value.code == 2 and "--cache-dir" in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "cache").exists()
