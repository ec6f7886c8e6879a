"""`dhpo-evaluate` as its user meets it, in-process and without a model: the options (help text, defaults, types,
choices, the error a bad value gets), what `prepare` hands each backend, what `evaluate` writes and prints, and the
exit status and one-line error of `main`. Backends and `from_pretrained` are fakes that record their arguments."""

import json
import sys
import types

import pytest
import torch
from benchmark_fixtures import FIXTURES

from dhpo_trl.evaluation import SamplingSettings, TransformersBackend, cli

KNOWN = "['aime24', 'aime25', 'amc23', 'olympiadbench', 'math500', 'minerva_math', 'gsm8k']"
MODEL = "org/tiny-model"  # a Hub id: `check_model_source` accepts it without a download


# ---------------------------------------------------------------------------------------------------- the options


def test_help_text_of_every_option():
    parser = cli.build_parser()
    assert parser.prog == "dhpo-evaluate"
    assert parser.description == (
        "Score a model on AIME24/25, AMC23, OlympiadBench, MATH-500, Minerva Math and GSM8K with the DHPO paper's "
        "protocol (SimpleRL prompt, temperature 1.0, 16K new tokens, Avg@32/Avg@4/Pass@1)."
    )
    assert {action.dest: action.help for action in parser._actions if action.dest != "help"} == {
        "model": "checkpoint directory or Hub model id",
        "tokenizer": "tokenizer path or id (default: the model's)",
        "benchmarks": f"comma-separated from {KNOWN} or 'all'",
        "data_dir": "directory holding <benchmark>/test.jsonl",
        "data": "data for one benchmark: a JSONL file, a directory with test.jsonl, or a Hub dataset id",
        "split": "split to read from Hub datasets",
        "samples": "samples per problem for one benchmark (default: 32 AIME, 4 AMC23, 1 others)",
        "limit": "evaluate only the first N problems of each benchmark",
        "max_new_tokens": None,
        "temperature": None,
        "top_p": None,
        "seed": None,
        "answer_fallback": "a completion without \\boxed{}: scored 0 (none, as the training reward), or by its last "
        "number (last_number, as SimpleRL-Zoo's evaluation)",
        "backend": "auto: vLLM when installed with a CUDA GPU, else transformers",
        "output": "JSON file for scores and per-problem results",
        "label": "row label in the table (default: the model path)",
        "dtype": "model weights",
        "tensor_parallel_size": None,
        "gpu_memory_utilization": None,
        "max_model_len": "default: the model's own limit",
        "batch_size": "sequences per generate() call",
        "device": "default: cuda when available, else cpu",
        "debug": "show the Python traceback of an error instead of its one-line message (a usage error, such as an "
        "unknown option or a value of the wrong type, stays one line: its traceback would show the parser only)",
    }
    assert {action.dest: action.metavar for action in parser._actions if action.metavar} == {
        "data": "NAME=PATH_OR_HUB_ID",
        "samples": "NAME=K",
    }
    # the first two groups are argparse's own (positional arguments, options), titled by the Python version
    assert [(group.title, [a.dest for a in group._group_actions]) for group in parser._action_groups[2:]] == [
        ("vLLM backend", ["tensor_parallel_size", "gpu_memory_utilization", "max_model_len"]),
        ("transformers backend", ["batch_size", "device"]),
    ]


def test_defaults():
    assert vars(cli.build_parser().parse_args(["ckpt"])) == {
        "model": "ckpt", "tokenizer": None, "benchmarks": "all", "data_dir": None, "data": [], "split": "test",
        "samples": [], "limit": None, "max_new_tokens": 16384, "temperature": 1.0, "top_p": 1.0, "seed": 0,
        "answer_fallback": "none", "backend": "auto", "output": "eval_results.json", "label": None, "dtype": "auto",
        "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "max_model_len": None, "batch_size": 8,
        "device": None, "debug": False,
    }  # fmt: skip


def test_values_are_read_as_numbers_and_repeated_options_collect():
    args = cli.build_parser().parse_args(
        [
            "ckpt", "--limit", "3", "--max-new-tokens", "64", "--temperature", "0.5", "--top-p", "0.25",
            "--seed", "7", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
            "--max-model-len", "4096", "--batch-size", "3", "--data", "gsm8k=a.jsonl", "--data", "aime24=b",
            "--samples", "aime24=2", "--answer-fallback", "last_number", "--backend", "vllm", "--dtype", "float16",
            "--debug",
        ]
    )  # fmt: skip
    assert (args.limit, args.max_new_tokens, args.seed) == (3, 64, 7)
    assert (args.temperature, args.top_p, args.gpu_memory_utilization) == (0.5, 0.25, 0.5)
    assert (args.tensor_parallel_size, args.max_model_len, args.batch_size) == (2, 4096, 3)
    assert (args.data, args.samples) == (["gsm8k=a.jsonl", "aime24=b"], ["aime24=2"])
    assert (args.answer_fallback, args.backend, args.dtype, args.debug) == ("last_number", "vllm", "float16", True)


@pytest.mark.parametrize(
    ("option", "choices"),
    [
        ("--answer-fallback", ["none", "last_number"]),
        ("--backend", ["auto", "vllm", "transformers"]),
        ("--dtype", ["auto", "bfloat16", "float16", "float32"]),
    ],
)
def test_choices(option, choices, capsys):
    parser = cli.build_parser()
    for choice in choices:
        assert getattr(parser.parse_args(["ckpt", option, choice]), option[2:].replace("-", "_")) == choice
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["ckpt", option, "gpu"])
    assert exit_info.value.code == 2
    # the list of choices after it is worded differently by Python versions
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"dhpo-evaluate: error: argument {option}: "
                                                               "invalid choice: 'gpu'")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: model"),
        (["ckpt", "--limit", "0"], "argument --limit: expected a positive whole number, got '0'"),
        (["ckpt", "--max-new-tokens", "-5"], "argument --max-new-tokens: expected a positive whole number, got '-5'"),
        (["ckpt", "--tensor-parallel-size", "x"], "argument --tensor-parallel-size: expected a positive whole number, got 'x'"),
        (["ckpt", "--max-model-len", "1.5"], "argument --max-model-len: expected a positive whole number, got '1.5'"),
        (["ckpt", "--batch-size", "0"], "argument --batch-size: expected a positive whole number, got '0'"),
        (["ckpt", "--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
        (["ckpt", "--top-p", "all"], "argument --top-p: invalid float value: 'all'"),
        (["ckpt", "--gpu-memory-utilization", "90%"], "argument --gpu-memory-utilization: invalid float value: '90%'"),
        (["ckpt", "--seed", "1.5"], "argument --seed: expected a whole number from 0 to 2**32 - 1, got '1.5'"),
    ],
)  # fmt: skip
def test_bad_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"dhpo-evaluate: error: {message}"


# ------------------------------------------------------------------------------------- prepare: input and backends


class Recorder:
    """Fakes for `from_pretrained` and the vLLM backend that write down how they were called."""

    def __init__(self, tokenizer=None):
        self.calls = []
        self.tokenizer = tokenizer if tokenizer is not None else object()
        recorder = self

        class FakeModel:
            def to(self, device):
                recorder.calls.append(("to", device))
                return self

        class AutoModelForCausalLM:
            @staticmethod
            def from_pretrained(name, **kwargs):
                recorder.calls.append(("model", name, kwargs))
                return FakeModel()

        class AutoTokenizer:
            @staticmethod
            def from_pretrained(name, **kwargs):
                recorder.calls.append(("tokenizer", name, kwargs))
                return recorder.tokenizer

        class FakeVLLMBackend:
            def __init__(self, model, **kwargs):
                recorder.calls.append(("vllm", model, kwargs))

        self.AutoModelForCausalLM, self.AutoTokenizer = AutoModelForCausalLM, AutoTokenizer
        self.VLLMBackend = FakeVLLMBackend

    def install(self, monkeypatch):
        # By name: the module in sys.modules now (importing transformers' Trainer, as dhpo_trl.evaluation does,
        # replaces the one a top-level `import transformers` bound)
        monkeypatch.setattr("transformers.AutoModelForCausalLM", self.AutoModelForCausalLM)
        monkeypatch.setattr("transformers.AutoTokenizer", self.AutoTokenizer)
        monkeypatch.setattr(cli, "VLLMBackend", self.VLLMBackend)
        return self


def _prepare(tmp_path, *options):
    return cli.prepare(
        [MODEL, "--benchmarks", "gsm8k", "--data-dir", str(FIXTURES), "--output", str(tmp_path / "r.json"), *options]
    )


@pytest.mark.parametrize(
    ("options", "cuda", "dtype", "device", "tokenizer", "batch_size"),
    [
        ([], False, "auto", "cpu", MODEL, 8),
        ([], True, "auto", "cuda", MODEL, 8),
        (["--device", "cpu"], True, "auto", "cpu", MODEL, 8),
        (["--device", "meta"], False, "auto", "meta", MODEL, 8),
        (["--dtype", "bfloat16", "--tokenizer", "org/tok", "--batch-size", "3"], False, torch.bfloat16, "cpu",
         "org/tok", 3),
        (["--dtype", "float16"], False, torch.float16, "cpu", MODEL, 8),
        (["--dtype", "float32"], False, torch.float32, "cpu", MODEL, 8),
    ],
)  # fmt: skip
def test_transformers_backend_gets_dtype_device_tokenizer_and_batch_size(
    tmp_path, monkeypatch, options, cuda, dtype, device, tokenizer, batch_size
):
    recorder = Recorder().install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    prepared = _prepare(tmp_path, "--backend", "transformers", *options)
    assert recorder.calls == [("model", MODEL, {"dtype": dtype}), ("to", device), ("tokenizer", tokenizer, {})]
    backend = prepared["backend"]
    assert isinstance(backend, TransformersBackend)
    assert (backend.batch_size, prepared["tokenizer"], prepared["backend_name"]) == (
        batch_size,
        recorder.tokenizer,
        "transformers",
    )


@pytest.mark.parametrize(
    ("options", "vllm_kwargs", "tokenizer"),
    [
        ([], {"tokenizer": None, "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "max_model_len": None,
              "dtype": "auto", "seed": 0}, MODEL),
        (["--tokenizer", "org/tok", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
          "--max-model-len", "4096", "--dtype", "bfloat16", "--seed", "7"],
         {"tokenizer": "org/tok", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_model_len": 4096,
          "dtype": "bfloat16", "seed": 7}, "org/tok"),
    ],
)  # fmt: skip
def test_vllm_backend_gets_every_option(tmp_path, monkeypatch, options, vllm_kwargs, tokenizer):
    recorder = Recorder().install(monkeypatch)
    prepared = _prepare(tmp_path, "--backend", "vllm", *options)
    assert recorder.calls == [("vllm", MODEL, vllm_kwargs), ("tokenizer", tokenizer, {})]
    assert isinstance(prepared["backend"], recorder.VLLMBackend)
    assert (prepared["backend_name"], prepared["tokenizer"]) == ("vllm", recorder.tokenizer)


@pytest.mark.parametrize(("installed", "chosen"), [(True, "vllm"), (False, "transformers")])
def test_auto_backend_is_vllm_only_when_available(tmp_path, monkeypatch, installed, chosen):
    recorder = Recorder().install(monkeypatch)
    monkeypatch.setattr(cli, "vllm_available", lambda: installed)
    prepared = _prepare(tmp_path)
    assert prepared["backend_name"] == chosen
    assert [call[0] for call in recorder.calls] == (
        ["vllm", "tokenizer"] if installed else ["model", "to", "tokenizer"]
    )


def test_prepare_reads_every_setting(tmp_path, monkeypatch):
    Recorder().install(monkeypatch)
    odd_path = tmp_path / "run=1" / "gsm8k.jsonl"  # an '=' in the path: only the first one splits NAME=PATH
    odd_path.parent.mkdir()
    odd_path.write_text((FIXTURES / "gsm8k" / "test.jsonl").read_text())
    prepared = cli.prepare(
        [
            MODEL, "--benchmarks", "aime24, GSM8K", "--data-dir", str(FIXTURES), "--data", f"gsm8k={odd_path}",
            "--samples", " AIME24 = 1", "--limit", "2", "--max-new-tokens", "5", "--temperature", "0.5",
            "--top-p", "0.25", "--seed", "7", "--backend", "vllm", "--output", str(tmp_path / "out" / "r.json"),
        ]
    )  # fmt: skip
    assert prepared["settings"] == SamplingSettings(max_new_tokens=5, temperature=0.5, top_p=0.25, seed=7)
    assert prepared["samples"] == {"aime24": 1}  # 1, the smallest count, is accepted
    assert prepared["sources"] == {"aime24": FIXTURES / "aime24" / "test.jsonl", "gsm8k": str(odd_path)}
    assert {name: [p.answer for p in problems] for name, problems in prepared["problems"].items()} == {
        "aime24": ["1", "24"],
        "gsm8k": ["12", "1200"],
    }
    assert prepared["output_path"] == tmp_path / "out" / "r.json"
    assert (tmp_path / "out").is_dir()  # made before the model loads


def test_hub_datasets_are_read_with_the_split(tmp_path, monkeypatch):
    import datasets

    Recorder().install(monkeypatch)
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_load_dataset(dataset_id, split):
        calls.append((dataset_id, split))
        return datasets.Dataset.from_list([{"question": "q?", "answer": "work\n#### 3"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    prepared = cli.prepare([MODEL, "--benchmarks", "gsm8k", "--data", "gsm8k=org/gsm8k", "--split", "train",
                            "--backend", "vllm"])  # fmt: skip
    assert calls == [("org/gsm8k", "train")]
    assert [p.answer for p in prepared["problems"]["gsm8k"]] == ["3"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--samples", "aime26=4"], f"--samples names unknown benchmark(s) ['aime26']: choose from {KNOWN}."),
        (["--samples", "gsm8k="], "--samples expects NAME=VALUE, got 'gsm8k='."),
        (["--samples", "=4"], "--samples expects NAME=VALUE, got '=4'."),
        (["--samples", "gsm8k=x"], "--samples gsm8k must be a positive whole number of samples, got 'x'."),
        (["--samples", "gsm8k=0"], "--samples gsm8k must be a positive whole number of samples, got '0'."),
        (["--data", "gsm8k"], "--data expects NAME=VALUE, got 'gsm8k'."),
        (["--data", "=x.jsonl"], "--data expects NAME=VALUE, got '=x.jsonl'."),
        (["--data", "gsm8k="], "--data expects NAME=VALUE, got 'gsm8k='."),
        (["--data", "gsm9k=x.jsonl"], f"--data names unknown benchmark(s) ['gsm9k']: choose from {KNOWN}."),
    ],
)
def test_bad_samples_and_data_are_input_errors(tmp_path, monkeypatch, options, message):
    recorder = Recorder().install(monkeypatch)
    with pytest.raises(cli.InputError) as error:
        _prepare(tmp_path, *options)
    assert str(error.value) == message
    assert recorder.calls == []


# ------------------------------------------------------------------------------------ evaluate: report and output


class QueueBackend:
    """Hands out the completions it was given, one `generate` call at a time; records the calls."""

    def __init__(self, tokenizer, batches):
        self.tokenizer, self.batches, self.calls = tokenizer, list(batches), []

    def generate(self, prompt_ids, num_samples, settings):
        self.calls.append((len(prompt_ids), num_samples, settings))
        return self.batches.pop(0)


def test_report_file_table_and_log(tmp_path, tokenizer, monkeypatch, capsys):
    aime = tmp_path / "aime.jsonl"
    aime.write_text('{"problem": "P1?", "answer": "7"}\n')
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f"#### {i}"}) + "\n" for i in (3, 4, 5)))
    backend = QueueBackend(tokenizer, [[[r"\boxed{7}", r"\boxed{8}"]], [[r"\boxed{3}"], [r"so \boxed{4}"]]])
    monkeypatch.setattr(cli, "_load_transformers_backend", lambda args: backend)
    clock = iter([1000.0, 1001.23456])  # prepare's start, evaluate's end
    monkeypatch.setattr(cli, "time", types.SimpleNamespace(time=lambda: next(clock)))
    output = tmp_path / "out" / "results.json"
    argv = [
        MODEL, "--benchmarks", "gsm8k,aime24", "--data", f"aime24={aime}", "--data", f"gsm8k={gsm}",
        "--samples", "aime24=2", "--limit", "2", "--max-new-tokens", "6", "--temperature", "0.5", "--top-p", "0.75",
        "--seed", "9", "--backend", "transformers", "--answer-fallback", "last_number", "--label", "modèle β",
        "--output", str(output),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    settings = SamplingSettings(max_new_tokens=6, temperature=0.5, top_p=0.75, seed=9)
    assert backend.calls == [(1, 2, settings), (2, 1, settings)]

    out, err = capsys.readouterr()
    assert out == (
        "| Model    | AIME24 (Avg@2) | GSM8K | AVG  |\n"
        "|----------|----------------|-------|------|\n"
        "| modèle β | 50.0           | 100.0 | 75.0 |\n"
    )
    assert err == (
        "[aime24] sampling 1 problems x 2 ...\n[aime24] Avg@2 = 50.0\n"
        "[gsm8k] sampling 2 problems x 1 ...\n[gsm8k] Pass@1 = 100.0\n"
        f"\nWrote {output}\n"
    )

    text = output.read_text(encoding="utf-8")
    assert text.startswith('{\n  "model": "org/tiny-model",\n  "label": "modèle β",\n  "scores": {\n    "aime24"')
    problem = {"index": 0, "question": "P1?", "answer": "7", "completions": [r"\boxed{7}", r"\boxed{8}"],
               "predictions": ["7", "8"], "correct": [1.0, 0.0], "score": 0.5}  # fmt: skip
    gsm_problems = [
        {"index": 0, "question": "Q3?", "answer": "3", "completions": [r"\boxed{3}"], "predictions": ["3"],
         "correct": [1.0], "score": 1.0},
        {"index": 1, "question": "Q4?", "answer": "4", "completions": [r"so \boxed{4}"], "predictions": ["4"],
         "correct": [1.0], "score": 1.0},
    ]  # fmt: skip
    assert json.loads(text) == {
        "model": "org/tiny-model",
        "label": "modèle β",
        "scores": {"aime24": 50.0, "gsm8k": 100.0},
        "average": 75.0,
        "average_over": ["aime24", "gsm8k"],
        "table": out.rstrip("\n"),
        "settings": {
            "backend": "transformers", "prompt": "simplerl", "max_new_tokens": 6, "temperature": 0.5,
            "top_p": 0.75, "seed": 9, "answer_fallback": "last_number", "limit": 2,
            "samples_per_problem": {"aime24": 2, "gsm8k": 1}, "data": {"aime24": str(aime), "gsm8k": str(gsm)},
            "wall_seconds": 1.23,
        },
        "benchmarks": {
            "aime24": {"score": 50.0, "metric": "Avg@2", "header": "AIME24 (Avg@2)", "num_problems": 1,
                       "samples_per_problem": 2, "num_samples": 2, "problems": [problem]},
            "gsm8k": {"score": 100.0, "metric": "Pass@1", "header": "GSM8K", "num_problems": 2,
                      "samples_per_problem": 1, "num_samples": 2, "problems": gsm_problems},
        },
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------------------ main


def test_main_reads_sys_argv_and_reports_input_errors_on_one_line(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "run" / "checkpoint-9"
    argv = ["dhpo-evaluate", str(missing), "--benchmarks", "gsm8k", "--data-dir", str(FIXTURES)]
    monkeypatch.setattr(sys, "argv", argv)
    assert cli.main() == 2
    assert capsys.readouterr().err == (
        f"dhpo-evaluate: error: Checkpoint path {missing} does not exist. Pass an existing directory or a Hub model "
        "id.\n"
    )
    for flag in ("--debug", "--deb"):  # argparse takes the prefix for the flag: it acts as the flag
        assert cli.main([*argv[1:], flag]) == 2
        assert capsys.readouterr().err.startswith("Traceback (most recent call last):\n"), flag
