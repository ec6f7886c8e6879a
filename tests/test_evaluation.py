"""dhpo_trl.evaluation: loaders for the seven real formats (on fixtures), Avg@k / Pass@1 / AVG, the Table-1 layout,
the JSON report, both backends' interfaces, the CLI end to end on a tiny local model, and early input errors."""

import json
import runpy
import sys
import types
from pathlib import Path

import pytest
import torch
from benchmark_fixtures import FIXTURES

from dhpo_trl.evaluation import BENCHMARKS, SamplingSettings, TransformersBackend, cli, evaluate_problems
from dhpo_trl.evaluation import backends as backends_module
from dhpo_trl.evaluation.benchmarks import Problem, load_benchmark, resolve_benchmark_names, resolve_sources
from dhpo_trl.evaluation.metrics import average_score, benchmark_score, format_table
from dhpo_trl.evaluation.runner import encode_prompts

EXPECTED_ANSWERS = {
    "aime24": ["1", "24", "230"],
    "aime25": ["42", "315", "8"],
    "amc23": ["2", "3.25", "21"],  # floats: 2.0 -> "2"
    "olympiadbench": ["0,4", "23", "2 k+3"],  # final_answer lists, $ dropped
    "math500": ["5\\sqrt{2}", "12", "\\left( \\sqrt{2}, \\frac{\\pi}{4} \\right)"],
    "minerva_math": ["3", "\\frac{1}{6}", "0.12"],  # the LAST \boxed{} of the solution
    "gsm8k": ["12", "1200", "63"],  # after ####, commas removed
}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_loaders_read_each_real_format(name):
    from_directory = load_benchmark(name, FIXTURES / name)
    from_file = load_benchmark(name, FIXTURES / name / "test.jsonl")
    assert [p.answer for p in from_directory] == EXPECTED_ANSWERS[name]
    assert from_file == from_directory
    assert [p.index for p in from_directory] == [0, 1, 2]
    assert all(p.benchmark == name and p.question for p in from_directory)
    assert len(load_benchmark(name, FIXTURES / name, limit=2)) == 2


def test_question_fields_and_context():
    olympiad = load_benchmark("olympiadbench", FIXTURES / "olympiadbench")
    assert (
        olympiad[2].question == "Let $f(n) = 2n + 1$ for integers $n$.\n\nGive $f(n)$ for $n = k + 1$ in terms of $k$."
    )
    assert load_benchmark("gsm8k", FIXTURES / "gsm8k")[0].question.startswith("Tom has 5 apples")
    rows = [{"question": "Only a question field?", "answer": "7"}]  # in-memory rows, `question` as fallback
    assert load_benchmark("aime25", rows) == [Problem("aime25", 0, "Only a question field?", "7")]


def test_registry_protocol_and_names():
    assert list(BENCHMARKS) == ["aime24", "aime25", "amc23", "olympiadbench", "math500", "minerva_math", "gsm8k"]
    assert {name: spec.num_samples for name, spec in BENCHMARKS.items()} == {
        "aime24": 32, "aime25": 32, "amc23": 4, "olympiadbench": 1, "math500": 1, "minerva_math": 1, "gsm8k": 1,
    }  # fmt: skip
    assert resolve_benchmark_names("all") == list(BENCHMARKS)
    assert resolve_benchmark_names("GSM8K, aime24") == ["aime24", "gsm8k"]  # Table-1 order
    assert SamplingSettings() == SamplingSettings(max_new_tokens=16384, temperature=1.0, top_p=1.0, seed=0)
    with pytest.raises(ValueError, match=r"Unknown benchmark name\(s\) \['aime26'\]"):
        resolve_benchmark_names(["aime26", "gsm8k"])


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("name", "bad_row", "message"),
    [
        ("aime24", {"problem": "x"}, "needs field 'answer'"),
        ("gsm8k", {"question": "x", "answer": "no hashes here"}, "needs field 'answer' holding text ending in '####"),
        ("minerva_math", {"problem": "x", "solution": "no box"}, "needs field 'solution' holding a solution contain"),
        ("olympiadbench", {"question": "x", "final_answer": []}, "needs field 'final_answer' holding a list"),
        ("math500", {"answer": "3"}, "needs a question in field 'problem' or 'question'"),
    ],
)
def test_missing_fields_name_the_line_and_field(tmp_path, name, bad_row, message):
    good_row = json.loads((FIXTURES / name / "test.jsonl").read_text().splitlines()[0])
    path = _write_jsonl(tmp_path / "test.jsonl", [good_row, bad_row])
    with pytest.raises(ValueError, match=message) as error:
        load_benchmark(name, path, limit=1)  # rows past the limit are validated too
    assert f"{path} line 2" in str(error.value)


def test_sources_and_paths_errors(tmp_path):
    assert resolve_sources(["gsm8k"], data_dir=FIXTURES) == {"gsm8k": FIXTURES / "gsm8k" / "test.jsonl"}
    assert resolve_sources(["gsm8k"], data_dir=FIXTURES, data={"gsm8k": "org/gsm8k"}) == {"gsm8k": "org/gsm8k"}
    with pytest.raises(ValueError, match="no data source. Pass --data-dir"):
        resolve_sources(["gsm8k"])
    with pytest.raises(ValueError, match="no data under"):
        resolve_sources(["aime24"], data_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_benchmark("gsm8k", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="has no test.jsonl"):
        load_benchmark("gsm8k", tmp_path)


def test_metrics_from_known_correctness():
    # Avg@4 over three problems: 2/4, 4/4, 0/4 -> 50%
    assert benchmark_score([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]) == pytest.approx(50.0)
    assert benchmark_score([[1], [0], [1], [1]]) == pytest.approx(75.0)  # Pass@1
    # AVG is unweighted across benchmarks, whatever their sizes
    assert average_score({"aime24": 10.0, "gsm8k": 90.0, "math500": 50.0}) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        benchmark_score([])


def test_table_one_layout():
    scores = {name: 10.0 + index for index, name in enumerate(BENCHMARKS)}
    table = format_table({"DHPO-E": scores}, {name: spec.num_samples for name, spec in BENCHMARKS.items()})
    header, separator, row = table.splitlines()
    assert [cell.strip() for cell in header.strip("|").split("|")] == [
        "Model", "AIME24 (Avg@32)", "AIME25 (Avg@32)", "AMC23 (Avg@4)", "Olympiad Bench", "MATH 500",
        "Minerva Math", "GSM8K", "AVG",
    ]  # fmt: skip
    assert [cell.strip() for cell in row.strip("|").split("|")] == [
        "DHPO-E", "10.0", "11.0", "12.0", "13.0", "14.0", "15.0", "16.0", "13.0",
    ]  # fmt: skip
    assert set(separator) == {"|", "-"} and len(separator) == len(header) == len(row)
    subset = format_table({"m": {"gsm8k": 50.0, "aime25": 25.0}}, {"aime25": 2, "gsm8k": 1})
    assert subset.splitlines()[0].split("|")[2:4] == [" AIME25 (Avg@2) ", " GSM8K "]


class ScriptedBackend:
    """Returns fixed completions; records what it was asked."""

    name = "scripted"

    def __init__(self, completions_by_answer):
        self.completions_by_answer = completions_by_answer
        self.calls = []

    def generate(self, prompt_ids, num_samples, settings):
        self.calls.append((len(prompt_ids), num_samples, settings))
        return [list(self.completions_by_answer.pop(0))[:num_samples] for _ in prompt_ids]


def test_evaluate_problems_scores_and_records(tokenizer):
    problems = {
        "aime24": load_benchmark("aime24", FIXTURES / "aime24", limit=2),  # answers 1, 24
        "gsm8k": load_benchmark("gsm8k", FIXTURES / "gsm8k", limit=2),  # answers 12, 1200
    }
    scripted = [
        ["so \\boxed{1}", "\\boxed{2}", "\\boxed{1.0}", "no box"],  # 2/4 (1.0 is equivalent to 1)
        ["\\boxed{24}", "\\boxed{24}", "\\boxed{24}", "\\boxed{42}"],  # 3/4
        ["\\boxed{12}"],  # 1/1
        ["\\boxed{120}"],  # 0/1
    ]
    backend = ScriptedBackend(scripted)
    settings = SamplingSettings(max_new_tokens=7)
    results = evaluate_problems(backend, tokenizer, problems, settings, {"aime24": 4})
    aime, gsm = results["benchmarks"]["aime24"], results["benchmarks"]["gsm8k"]
    assert aime["score"] == pytest.approx(100 * (0.5 + 0.75) / 2)
    assert gsm["score"] == pytest.approx(50.0)
    assert results["average"] == pytest.approx((62.5 + 50.0) / 2)
    assert (aime["metric"], aime["num_problems"], aime["samples_per_problem"], aime["num_samples"]) == (
        "Avg@4",
        2,
        4,
        8,
    )
    assert (gsm["metric"], gsm["num_samples"]) == ("Pass@1", 2)
    assert aime["problems"][0]["correct"] == [1.0, 0.0, 1.0, 0.0]
    assert aime["problems"][0]["predictions"] == ["1", "2", "1.0", None]
    assert backend.calls == [(2, 4, settings), (2, 1, settings)]


def test_prompts_are_simplerl(tokenizer):
    from dhpo_trl.scoring.data import SIMPLERL_INSTRUCTION

    (ids,) = encode_prompts(tokenizer, ["What is 1+1?"])
    text = tokenizer.decode(ids)
    assert "What is 1+1?" in text and SIMPLERL_INSTRUCTION in text


def test_transformers_backend_counts_lengths_seeds(tokenizer, tiny_model):
    backend = TransformersBackend(tiny_model, tokenizer, batch_size=3)
    prompts = encode_prompts(tokenizer, ["1+1?", "What is 22 * 3?"])
    settings = SamplingSettings(max_new_tokens=5, seed=3)
    rng_before = torch.get_rng_state()
    first = backend.generate(prompts, 4, settings)
    assert torch.equal(torch.get_rng_state(), rng_before)  # evaluation leaves the global RNG alone
    assert [len(samples) for samples in first] == [4, 4]
    assert all(0 < len(tokenizer(text)["input_ids"]) <= 5 for samples in first for text in samples)
    assert backend.generate(prompts, 4, settings) == first  # same seed, same samples
    assert backend.generate(prompts, 4, SamplingSettings(max_new_tokens=5, seed=4)) != first
    tiny_model.train()
    backend.generate(prompts, 1, settings)
    assert tiny_model.training


def test_vllm_backend_passes_options_and_maps_outputs(monkeypatch):
    created = {}

    class FakeSamplingParams:
        def __init__(self, **kwargs):
            created["sampling"] = kwargs

    class FakeLLM:
        def __init__(self, **kwargs):
            created["llm"] = kwargs

        def generate(self, requests, params):
            created["requests"] = requests
            choice = types.SimpleNamespace
            return [
                choice(outputs=[choice(text=f"p{i}s{k}") for k in range(params_n)]) for i, _ in enumerate(requests)
            ]

    params_n = 3
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams))
    backend = backends_module.VLLMBackend(
        "ckpt", tensor_parallel_size=4, gpu_memory_utilization=0.7, max_model_len=20000, seed=5
    )
    assert created["llm"] == {
        "model": "ckpt", "tokenizer": "ckpt", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.7,
        "max_model_len": 20000, "dtype": "auto", "seed": 5,
    }  # fmt: skip
    out = backend.generate([[1, 2], [3]], params_n, SamplingSettings(max_new_tokens=99, seed=5))
    assert out == [["p0s0", "p0s1", "p0s2"], ["p1s0", "p1s1", "p1s2"]]
    assert created["sampling"] == {"n": 3, "temperature": 1.0, "top_p": 1.0, "max_tokens": 99, "seed": 5}
    assert created["requests"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'dhpo-trl\[vllm\]'.*--backend transformers"):
        backends_module.VLLMBackend("ckpt")
    assert backends_module.vllm_available() is False


@pytest.fixture
def saved_tiny_model(tmp_path, tokenizer, tiny_model):
    path = tmp_path / "tiny-model"
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_cli_end_to_end_transformers(saved_tiny_model, tmp_path, capsys):
    output = tmp_path / "out" / "results.json"
    argv = [
        str(saved_tiny_model), "--benchmarks", "aime24,gsm8k,minerva_math", "--data-dir", str(FIXTURES),
        "--backend", "transformers", "--limit", "2", "--max-new-tokens", "4", "--samples", "aime24=3",
        "--output", str(output), "--label", "tiny", "--batch-size", "4",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert [cell.strip() for cell in table[0].strip("|").split("|")] == [
        "Model", "AIME24 (Avg@3)", "Minerva Math", "GSM8K", "AVG"
    ]  # fmt: skip
    report = json.loads(output.read_text())
    assert list(report["benchmarks"]) == ["aime24", "minerva_math", "gsm8k"]
    assert report["settings"]["samples_per_problem"] == {"aime24": 3, "minerva_math": 1, "gsm8k": 1}
    assert {k: report["settings"][k] for k in ("backend", "max_new_tokens", "temperature", "top_p", "limit")} == {
        "backend": "transformers", "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "limit": 2
    }  # fmt: skip
    for name, samples in (("aime24", 3), ("minerva_math", 1), ("gsm8k", 1)):
        result = report["benchmarks"][name]
        assert (result["num_problems"], result["num_samples"]) == (2, 2 * samples)
        assert [len(p["completions"]) for p in result["problems"]] == [samples, samples]
        assert result["score"] == pytest.approx(benchmark_score([p["correct"] for p in result["problems"]]))
        assert report["scores"][name] == result["score"]
    assert report["benchmarks"]["gsm8k"]["problems"][1]["answer"] == "1200"
    assert report["average"] == pytest.approx(sum(report["scores"].values()) / 3)
    assert table[2].split("|")[1].strip() == "tiny"
    assert table[2].split("|")[-2].strip() == f"{report['average']:.1f}"


def _fail_if_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(cli, "_load_transformers_backend", refuse)
    monkeypatch.setattr(cli, "VLLMBackend", refuse)


def test_cli_errors_before_any_model_loads(saved_tiny_model, tmp_path, monkeypatch, capsys):
    _fail_if_model_loads(monkeypatch)
    base = ["--data-dir", str(FIXTURES), "--backend", "transformers", "--output", str(tmp_path / "r.json")]
    with pytest.raises(ValueError, match="Unknown benchmark name"):
        cli.run([str(saved_tiny_model), "--benchmarks", "aime24,aime2025", *base])
    broken = _write_jsonl(tmp_path / "broken.jsonl", [{"question": "q", "answer": "12"}])
    with pytest.raises(ValueError, match="line 1: benchmark 'gsm8k' needs field 'answer' holding text ending in"):
        cli.run([str(saved_tiny_model), "--benchmarks", "gsm8k", "--data", f"gsm8k={broken}", *base])
    with pytest.raises(ValueError, match="Checkpoint path .*checkpoint-9 does not exist"):
        cli.run([str(tmp_path / "run" / "checkpoint-9"), "--benchmarks", "gsm8k", *base])
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        cli.run([str(tmp_path / "not-a-model"), "--benchmarks", "gsm8k", *base])
    with pytest.raises(ValueError, match="--samples expects NAME=VALUE"):
        cli.run([str(saved_tiny_model), "--benchmarks", "gsm8k", "--samples", "gsm8k", *base])
    with pytest.raises(ValueError, match="--samples aime24 must be a positive whole number"):
        cli.run([str(saved_tiny_model), "--benchmarks", "aime24", "--samples", "aime24=0", *base])
    assert cli.main([str(saved_tiny_model), "--benchmarks", "nope", *base]) == 2
    assert "dhpo-evaluate: error: Unknown benchmark name(s) ['nope']" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_module_entry_point_reports_errors(tmp_path, monkeypatch, capsys):
    """`python -m dhpo_trl.evaluation ...`: its __main__ run in this process (a new interpreter adds only imports)."""
    argv = [str(tmp_path / "missing-ckpt"), "--benchmarks", "gsm8k", "--data-dir", str(FIXTURES)]
    monkeypatch.setattr(sys, "argv", ["python -m dhpo_trl.evaluation", *argv])
    with pytest.raises(SystemExit) as exit_status:
        runpy.run_module("dhpo_trl.evaluation", run_name="__main__")
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dhpo-evaluate: error: Checkpoint path {tmp_path / 'missing-ckpt'} does not exist. "
        "Pass an existing directory or a Hub model id."
    ]


def test_hub_dataset_ids_go_through_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(dataset_id, split):
        calls.append((dataset_id, split))
        return datasets.Dataset.from_list([{"question": "q?", "answer": "work\n#### 3,000"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_benchmark("gsm8k", "someorg/gsm8k-test", split="test") == [Problem("gsm8k", 0, "q?", "3000")]
    assert calls == [("someorg/gsm8k-test", "test")]


class AnswerBook:
    """A fake backend: for each prompt, the completions written down for the question it contains."""

    name = "answer-book"

    def __init__(self, tokenizer, completions_by_question):
        self.tokenizer = tokenizer
        self.completions_by_question = completions_by_question

    def generate(self, prompt_ids, num_samples, settings):
        batches = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            (question,) = [q for q in self.completions_by_question if q in text]
            batches.append(list(self.completions_by_question[question])[:num_samples])
        return batches


# Fixture questions (first words) -> completions with known correctness, gold in the comment.
ANSWER_BOOK = {
    "Find the remainder when": [r"\boxed{1}", r"so \boxed{1.00}", r"\boxed{2}", "it is 1"],  # 1: 2/4 (no box)
    "How many positive divisors": [r"\boxed{24}", r"\boxed{24}", r"\boxed{24.0}", r"\boxed{\frac{48}{2}}"],  # 24: 4/4
    "Compute $13 \\cdot 17 + 9$": [r"\boxed{230}", r"\boxed{221}", r"\boxed{239}", r"\boxed{-230}"],  # 230: 1/4
    "A cart moves": [r"$v = \boxed{3}$ m/s"],  # 3: 1/1
    "Compute $\\frac{1}{2}": [r"\boxed{1/6}"],  # \frac{1}{6}: 1/1
    "A lamp uses": [r"\boxed{12 \times 10^{-2}}"],  # 0.12: 1/1
    "Tom has 5 apples": [r"\boxed{12}"],  # 12: 1/1
    "A shop sells 400 pens": [r"\boxed{1,200}"],  # 1200: 1/1 (thousands comma)
    "Mia reads 9 pages": ["She reads 9 * 7 = 63 pages."],  # 63: 0/1, or 1/1 with the last-number fallback
}


@pytest.mark.parametrize(
    ("fallback", "aime", "gsm8k", "average"),
    [
        # AIME24 Avg@4 = (2/4 + 4/4 + 1/4) / 3; Minerva Pass@1 = 3/3; GSM8K Pass@1 = 2/3; AVG = mean of the three
        ("none", "58.3", "66.7", "75.0"),
        # the last-number fallback adds "it is 1" (AIME 3/4 on the first problem) and "63 pages" (GSM8K 3/3)
        ("last_number", "66.7", "100.0", "88.9"),
    ],
)
def test_cli_end_to_end_table_from_known_answers(
    tmp_path, tokenizer, monkeypatch, capsys, fallback, aime, gsm8k, average
):
    book = AnswerBook(tokenizer, ANSWER_BOOK)
    monkeypatch.setattr(cli, "_load_transformers_backend", lambda args: book)
    monkeypatch.setattr(cli, "check_model_source", lambda model: "local")
    output = tmp_path / "results.json"
    argv = [
        "fake-model", "--benchmarks", "aime24,minerva_math,gsm8k", "--data-dir", str(FIXTURES), "--backend",
        "transformers", "--samples", "aime24=4", "--output", str(output), "--label", "book",
        "--answer-fallback", fallback,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    header, _, row = capsys.readouterr().out.strip().splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "Model",
        "AIME24 (Avg@4)",
        "Minerva Math",
        "GSM8K",
        "AVG",
    ]
    assert [c.strip() for c in row.strip("|").split("|")] == ["book", aime, "100.0", gsm8k, average]
    report = json.loads(output.read_text())
    assert report["scores"]["aime24"] == pytest.approx(float(aime), abs=0.05)
    assert report["average"] == pytest.approx(float(average), abs=0.05)
    assert report["settings"]["answer_fallback"] == fallback
    first = report["benchmarks"]["aime24"]["problems"][0]
    assert first["correct"] == ([1.0, 1.0, 0.0, 0.0] if fallback == "none" else [1.0, 1.0, 0.0, 1.0])
    assert first["predictions"] == ["1", "1.00", "2", None if fallback == "none" else "1"]


def test_ragged_sample_counts(tokenizer):
    # metrics: each problem counts once, whatever its number of samples: (1/2 + 1/1 + 1/3) / 3
    assert benchmark_score([[1, 0], [1], [0, 0, 1]]) == pytest.approx(100 * (0.5 + 1 + 1 / 3) / 3)
    # runner: a backend that returns fewer samples than asked is an error, not a silently smaller Avg@k
    problems = {"aime24": load_benchmark("aime24", FIXTURES / "aime24", limit=2)}
    short = ScriptedBackend([[r"\boxed{1}"] * 4, [r"\boxed{24}"] * 3])
    with pytest.raises(ValueError, match=r"\[aime24\] the backend returned 3 samples for problem 1, expected 4"):
        evaluate_problems(short, tokenizer, problems, SamplingSettings(max_new_tokens=4), {"aime24": 4})
    missing = ScriptedBackend([[r"\boxed{1}"]])
    missing.generate = lambda prompt_ids, num_samples, settings: [[r"\boxed{1}"]]
    with pytest.raises(ValueError, match="returned samples for 1 problems, expected 2"):
        evaluate_problems(missing, tokenizer, problems, SamplingSettings(max_new_tokens=4), {"aime24": 1})
    with pytest.raises(ValueError, match="fallback must be one of"):
        evaluate_problems(short, tokenizer, problems, SamplingSettings(), fallback="last")


def test_table_row_missing_a_benchmark():
    table = format_table(
        {"A": {"aime24": 10.0, "gsm8k": 21.0}, "B": {"aime24": 30.0}}, {"aime24": 32, "gsm8k": 1}
    ).splitlines()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]] for line in table[2:]}
    assert rows == {"A": ["10.0", "21.0", "15.5"], "B": ["30.0", "-", "-"]}  # no AVG over fewer benchmarks


def test_gsm8k_with_more_than_one_hash_mark_keeps_the_last():
    rows = [{"question": "q?", "answer": "step #### not this\n#### 4,500"}]
    assert load_benchmark("gsm8k", rows)[0].answer == "4500"
