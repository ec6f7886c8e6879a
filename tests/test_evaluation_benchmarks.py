"""dhpo_trl.evaluation.benchmarks on tiny files written here, one per real format: where each benchmark keeps its
question and answer (plain fields, AMC23's floats, OlympiadBench's lists, context and unit, Minerva's last
`\\boxed{}`, GSM8K's `####`), the registry's protocol, limits and order, the ways a source is named (file,
directory, rows in memory, Hub id), and every error message, word for word."""

import json

import datasets
import pytest

from dhpo_trl.evaluation.benchmarks import (
    BENCHMARKS,
    Problem,
    load_benchmark,
    resolve_benchmark_names,
    resolve_sources,
)

KNOWN = "['aime24', 'aime25', 'amc23', 'olympiadbench', 'math500', 'minerva_math', 'gsm8k']"


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def answers(problems):
    return [problem.answer for problem in problems]


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        call(*args, **kwargs)
    return str(error.value)


@pytest.fixture
def no_hub(monkeypatch):
    """Fail a test that reaches the Hub loader; record the calls of those that are meant to."""
    calls = []

    def fake_load_dataset(dataset_id, split):
        calls.append((dataset_id, split))
        return datasets.Dataset.from_list([{"question": "Hub question?", "answer": "work\n#### 2,024"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    return calls


# ------------------------------------------------------------------ the registry


def test_registry_is_table_one_with_the_papers_protocol():
    table = {
        name: (spec.name, spec.column, spec.num_samples, spec.question_fields, spec.answer_field, spec.expected_size)
        for name, spec in BENCHMARKS.items()
    }
    assert table == {
        "aime24": ("aime24", "AIME24", 32, ("problem", "question"), "answer", 30),
        "aime25": ("aime25", "AIME25", 32, ("problem", "question"), "answer", 30),
        "amc23": ("amc23", "AMC23", 4, ("problem", "question"), "answer", 40),
        "olympiadbench": ("olympiadbench", "Olympiad Bench", 1, ("question", "problem"), "final_answer", 675),
        "math500": ("math500", "MATH 500", 1, ("problem", "question"), "answer", 500),
        "minerva_math": ("minerva_math", "Minerva Math", 1, ("problem", "question"), "solution", 272),
        "gsm8k": ("gsm8k", "GSM8K", 1, ("question", "problem"), "answer", 1319),
    }
    assert list(BENCHMARKS) == ["aime24", "aime25", "amc23", "olympiadbench", "math500", "minerva_math", "gsm8k"]


def test_metric_labels_and_headers():
    aime, gsm8k = BENCHMARKS["aime24"], BENCHMARKS["gsm8k"]
    assert aime.metric_label() == "Avg@32"
    assert aime.metric_label(1) == "Pass@1"  # one sample is plain Pass@1, whatever the paper's k
    assert aime.metric_label(2) == "Avg@2"
    assert gsm8k.metric_label() == "Pass@1"
    assert gsm8k.metric_label(4) == "Avg@4"
    assert aime.header() == "AIME24 (Avg@32)"
    assert aime.header(1) == "AIME24"
    assert aime.header(2) == "AIME24 (Avg@2)"
    assert BENCHMARKS["amc23"].header() == "AMC23 (Avg@4)"
    assert BENCHMARKS["olympiadbench"].header() == "Olympiad Bench"
    assert gsm8k.header(3) == "GSM8K (Avg@3)"


# ------------------------------------------------------------------ names


def test_benchmark_names_from_text_and_lists():
    assert resolve_benchmark_names("gsm8k,aime24") == ["aime24", "gsm8k"]  # a comma alone separates; Table-1 order
    assert resolve_benchmark_names("  Minerva_Math  AMC23 ") == ["amc23", "minerva_math"]
    assert resolve_benchmark_names([" GSM8K ", "math500"]) == ["math500", "gsm8k"]
    assert resolve_benchmark_names(["gsm8k", "gsm8k", "GSM8K"]) == ["gsm8k"]  # once each
    assert resolve_benchmark_names("ALL") == [
        "aime24", "aime25", "amc23", "olympiadbench", "math500", "minerva_math", "gsm8k"
    ]  # fmt: skip
    assert resolve_benchmark_names(["gsm8k", "all"]) == list(BENCHMARKS)
    assert resolve_benchmark_names(("olympiadbench",)) == ["olympiadbench"]


@pytest.mark.parametrize("names", ["", " , ", []])
def test_no_benchmark_is_an_error(names):
    assert error_of(resolve_benchmark_names, names) == f"No benchmark given: pass names from {KNOWN} or 'all'."


def test_unknown_names_are_listed():
    message = error_of(resolve_benchmark_names, "gsm8k, AIME2024 math")
    assert message == f"Unknown benchmark name(s) ['aime2024', 'math']: choose from {KNOWN} or 'all'."


# ------------------------------------------------------------------ each real format


def test_aime_plain_answers_and_question_field_order(tmp_path):
    path = write_jsonl(
        tmp_path / "aime24.jsonl",
        [
            {"id": 1, "problem": "  Find $2+3$.  ", "question": "ignored copy", "answer": "005", "solution": "x"},
            {"question": "Only a question: find $6 \\cdot 7$.", "answer": "$42$"},
            {"problem": "", "question": "An empty problem falls back to this.", "answer": 12},  # an int
        ],
    )
    assert load_benchmark("aime24", path) == [
        Problem("aime24", 0, "Find $2+3$.", "005"),  # `problem` first, stripped
        Problem("aime24", 1, "Only a question: find $6 \\cdot 7$.", "42"),
        Problem("aime24", 2, "An empty problem falls back to this.", "12"),
    ]


def test_amc23_float_answers(tmp_path):
    rows = [
        {"problem": "p1", "answer": 27.0},
        {"problem": "p2", "answer": 3.25},
        {"problem": "p3", "answer": -4.0},
    ]
    assert answers(load_benchmark("amc23", write_jsonl(tmp_path / "amc.jsonl", rows))) == ["27", "3.25", "-4"]


def test_math500_answer_field_not_the_solution(tmp_path):
    rows = [{"problem": "Simplify.", "solution": "so \\boxed{99}", "answer": "\\frac{1}{2}", "level": 1}]
    assert load_benchmark("math500", write_jsonl(tmp_path / "m.jsonl", rows)) == [
        Problem("math500", 0, "Simplify.", "\\frac{1}{2}")
    ]


def test_minerva_takes_the_last_box_of_the_solution(tmp_path):
    rows = [
        {"problem": "Speed?", "solution": "first $\\boxed{120}$ Wh, then \\boxed{0.12} kWh", "idx": 0},
        {"problem": "Nested?", "solution": "$\\boxed{\\frac{1}{6}}$.", "answer": "ignored", "idx": 1},
    ]
    assert answers(load_benchmark("minerva_math", write_jsonl(tmp_path / "mm.jsonl", rows))) == [
        "0.12",
        "\\frac{1}{6}",
    ]


def test_gsm8k_text_after_the_hashes(tmp_path):
    rows = [
        {"question": "  How many?  ", "answer": "4 * 3 = <<4*3=12>>12\n#### 12", "idx": 0},
        {"question": "How much?", "answer": "so 1000 + 234\n####   1,234", "idx": 1},
        {"problem": "A problem field also works.", "answer": "#### -7"},
    ]
    assert load_benchmark("gsm8k", write_jsonl(tmp_path / "g.jsonl", rows)) == [
        Problem("gsm8k", 0, "How many?", "12"),
        Problem("gsm8k", 1, "How much?", "1234"),
        Problem("gsm8k", 2, "A problem field also works.", "-7"),
    ]


def test_olympiadbench_lists_context_and_unit(tmp_path):
    rows = [
        {"question": "Roots?", "final_answer": ["$0$", "$4$"], "context": None, "unit": None},
        {"question": "  Value of $f(3)$?  ", "final_answer": ["$7$"], "context": "  Let $f(n)=2n+1$.  ", "unit": None},
        {"question": "Share?", "final_answer": ["50"], "context": "   ", "unit": "%"},
        {"question": "Distance?", "final_answer": ["$\\frac{41}{12}$"], "context": 3, "unit": "km"},
        {"question": "Plain string?", "final_answer": "$5$", "unit": 7},  # a bare string, a non-text unit
        {"problem": "A problem field, second choice.", "question": "", "final_answer": ("8",)},
    ]
    assert load_benchmark("olympiadbench", write_jsonl(tmp_path / "o.jsonl", rows)) == [
        Problem("olympiadbench", 0, "Roots?", "0, 4"),
        Problem("olympiadbench", 1, "Let $f(n)=2n+1$.\n\nValue of $f(3)$?", "7"),
        Problem("olympiadbench", 2, "Share?", "50\\%"),  # the `%` unit is kept as LaTeX
        Problem("olympiadbench", 3, "Distance?", "\\frac{41}{12}"),
        Problem("olympiadbench", 4, "Plain string?", "5"),
        Problem("olympiadbench", 5, "A problem field, second choice.", "8"),
    ]


def test_olympiadbench_answers_built_in_memory():
    rows = [  # rows a training script builds: a tuple of components, a list, a bare string
        {"question": "Pair?", "final_answer": ("8", "9")},
        {"question": "List?", "final_answer": ["$\\frac{1}{2}$"]},
        {"question": "Text?", "final_answer": "10"},
    ]
    assert answers(load_benchmark("olympiadbench", rows)) == ["8, 9", "\\frac{1}{2}", "10"]


def test_olympiadbench_question_field_comes_before_problem(tmp_path):
    rows = [{"question": "the question", "problem": "the problem", "final_answer": ["1"]}]
    assert load_benchmark("olympiadbench", rows)[0].question == "the question"
    assert load_benchmark("gsm8k", [{"question": "q", "problem": "p", "answer": "#### 1"}])[0].question == "q"
    assert load_benchmark("aime25", [{"question": "q", "problem": "p", "answer": "1"}])[0].question == "p"


def test_golds_are_normalised_with_the_question(tmp_path):
    rows = [
        {"problem": "Which is prime? (A) 4 (B) 6 (C) 7", "answer": "C"},  # a letter among listed options
        {"problem": "Which letter comes third?", "answer": "C"},  # no options: the letter itself
        {"problem": "Solve $x + 1 = 6$.", "answer": "x = 5"},  # the value of a named unknown
        {"problem": "A rope is 12 m long. How long?", "answer": "12 m"},  # a unit the question uses as one
    ]
    assert answers(load_benchmark("math500", rows)) == ["\\text{(C)}", "C", "5", "12"]


# ------------------------------------------------------------------ order, limits, duplicates


def test_file_order_blank_lines_duplicates_and_limits(tmp_path):
    path = tmp_path / "aime25.jsonl"
    path.write_text(
        '{"problem": "third", "answer": "3"}\n'
        "\n"
        "   \n"
        '{"problem": "first", "answer": "1"}\n'
        '{"problem": "first", "answer": "1"}\n'  # duplicates are kept: the file is the test set
        '{"problem": "second", "answer": "2"}',  # no final newline
        encoding="utf-8",
    )
    full = load_benchmark("aime25", path)
    assert [(p.index, p.question, p.answer) for p in full] == [
        (0, "third", "3"), (1, "first", "1"), (2, "first", "1"), (3, "second", "2"),
    ]  # fmt: skip
    assert load_benchmark("aime25", path, limit=1) == [Problem("aime25", 0, "third", "3")]
    assert [p.question for p in load_benchmark("aime25", path, limit=3)] == ["third", "first", "first"]
    assert len(load_benchmark("aime25", path, limit=4)) == 4
    assert len(load_benchmark("aime25", path, limit=50)) == 4
    assert load_benchmark("aime25", path, limit=None) == full


@pytest.mark.parametrize("limit", [0, -2])
def test_limit_must_be_positive(limit):
    message = error_of(load_benchmark, "gsm8k", [{"question": "q", "answer": "#### 1"}], limit=limit)
    assert message == f"limit must be a positive number of problems, got {limit}."


def test_rows_past_the_limit_are_checked(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q2"}])
    message = error_of(load_benchmark, "gsm8k", path, limit=1)
    assert message.startswith(f"{path} line 2: benchmark 'gsm8k' needs field 'answer'")


# ------------------------------------------------------------------ sources


def test_rows_in_memory_list_or_tuple(no_hub):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": 2.0}]
    assert load_benchmark("aime24", rows) == [Problem("aime24", 0, "a", "1"), Problem("aime24", 1, "b", "2")]
    assert load_benchmark("aime24", tuple(rows)) == load_benchmark("aime24", list(rows))
    message = error_of(load_benchmark, "aime24", [rows[0], {"problem": "c"}])
    assert message.startswith("aime24 row 1: benchmark 'aime24' needs field 'answer'")
    assert no_hub == []


def test_directory_sources(tmp_path, no_hub):
    write_jsonl(tmp_path / "flat" / "test.jsonl", [{"question": "flat", "answer": "#### 1"}])
    write_jsonl(tmp_path / "root" / "gsm8k" / "test.jsonl", [{"question": "nested", "answer": "#### 2"}])
    write_jsonl(tmp_path / "both" / "test.jsonl", [{"question": "top", "answer": "#### 3"}])
    write_jsonl(tmp_path / "both" / "gsm8k" / "test.jsonl", [{"question": "below", "answer": "#### 4"}])
    assert load_benchmark("gsm8k", tmp_path / "flat") == [Problem("gsm8k", 0, "flat", "1")]
    assert load_benchmark("gsm8k", str(tmp_path / "root")) == [Problem("gsm8k", 0, "nested", "2")]
    assert load_benchmark("gsm8k", tmp_path / "both") == [Problem("gsm8k", 0, "top", "3")]  # <dir>/test.jsonl first
    (tmp_path / "empty").mkdir()
    assert error_of(load_benchmark, "gsm8k", tmp_path / "empty") == (
        f"Benchmark 'gsm8k': directory {tmp_path}/empty has no test.jsonl (looked for {tmp_path}/empty/test.jsonl, "
        f"{tmp_path}/empty/gsm8k/test.jsonl). Pass the JSONL file itself or a directory holding it."
    )
    assert no_hub == []


def test_missing_local_files_are_named(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "data").mkdir()
    cases = {
        "missing.jsonl": "missing.jsonl",  # relative, by its extension
        "set.json": "set.json",
        "./gsm": "gsm",  # relative, by its leading dot (Path drops the "./")
        str(tmp_path / "abs"): f"{tmp_path}/abs",
        "~/bench": f"{tmp_path}/home/bench",  # "~" expanded
        "data/gsm8k": "data/gsm8k",  # the first folder exists: meant as a path, not a Hub id
    }
    for source, shown in cases.items():
        assert error_of(load_benchmark, "gsm8k", source) == (
            f"Benchmark 'gsm8k': data file {shown} does not exist. Check the path (--data gsm8k=PATH)."
        )
    assert no_hub == []


def test_hub_ids_go_to_load_dataset_with_the_split(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)  # no folder named like the org here
    assert load_benchmark("gsm8k", "someorg/gsm8k-test") == [Problem("gsm8k", 0, "Hub question?", "2024")]
    assert load_benchmark("gsm8k", "gsm8k", split="train", limit=1) == [Problem("gsm8k", 0, "Hub question?", "2024")]
    assert no_hub == [("someorg/gsm8k-test", "test"), ("gsm8k", "train")]


def test_hub_rows_are_named_in_errors(monkeypatch):
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda dataset_id, split: datasets.Dataset.from_list(
            [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "no hashes"}]
        ),
    )
    message = error_of(load_benchmark, "gsm8k", "org/set", split="validation")
    assert message.startswith("org/set (validation) row 1: benchmark 'gsm8k' needs field 'answer'")


# ------------------------------------------------------------------ errors, word for word


def test_unknown_benchmark_name():
    message = error_of(load_benchmark, "gsm9k", [{"question": "q", "answer": "#### 1"}])
    assert message == f"Unknown benchmark name 'gsm9k': choose from {KNOWN}."


def test_bad_json_lines_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n\nnot json\n', encoding="utf-8")
    assert error_of(load_benchmark, "aime24", bad) == f"{bad} line 3: not valid JSON (Expecting value)."
    listed = tmp_path / "list.jsonl"
    listed.write_text('{"problem": "a", "answer": "1"}\n["problem", "answer"]\n', encoding="utf-8")
    assert error_of(load_benchmark, "aime24", listed) == f"{listed} line 2: expected a JSON object, got list."
    number = write_jsonl(tmp_path / "number.jsonl", [5])
    assert error_of(load_benchmark, "aime24", number) == f"{number} line 1: expected a JSON object, got int."


@pytest.mark.parametrize(
    ("name", "row", "fields", "shown"),
    [
        ("aime24", {"problem": "p", "answer": None}, "['answer', 'problem']", "'None'"),
        ("aime24", {"problem": "p", "answer": True}, "['answer', 'problem']", "'True'"),  # a bool is no answer
        ("aime25", {"problem": "p", "answer": ["1"]}, "['answer', 'problem']", "\"['1']\""),
        ("aime25", {"problem": "p", "answer": "   "}, "['answer', 'problem']", "'   '"),  # blank
        ("amc23", {"problem": "p"}, "['problem']", "'None'"),
        ("math500", {"problem": "p", "answer": {"v": 1}}, "['answer', 'problem']", "\"{'v': 1}\""),
        ("olympiadbench", {"question": "q", "final_answer": 5}, "['final_answer', 'question']", "'5'"),
        ("olympiadbench", {"question": "q", "final_answer": []}, "['final_answer', 'question']", "'[]'"),
        ("minerva_math", {"problem": "p", "solution": "no box"}, "['problem', 'solution']", "'no box'"),
        (
            "minerva_math",
            {"problem": "p", "solution": ["\\boxed{1}"]},
            "['problem', 'solution']",
            "\"['\\\\\\\\boxed{1}']\"",
        ),
        ("gsm8k", {"question": "q", "answer": "12"}, "['answer', 'question']", "'12'"),
        ("gsm8k", {"question": "q", "answer": 12}, "['answer', 'question']", "'12'"),
        ("gsm8k", {"question": "q", "answer": "so ### 12"}, "['answer', 'question']", "'so ### 12'"),  # three marks
    ],
)
def test_missing_answer_names_field_format_and_value(name, row, fields, shown):
    spec = BENCHMARKS[name]
    formats = {
        "aime24": "a string", "aime25": "a string", "amc23": "a number or string", "math500": "a string",
        "olympiadbench": "a list of strings", "minerva_math": "a solution containing \\boxed{...}",
        "gsm8k": "text ending in '#### <answer>'",
    }  # fmt: skip
    assert error_of(load_benchmark, name, [row]) == (
        f"{name} row 0: benchmark '{name}' needs field '{spec.answer_field}' holding {formats[name]}; "
        f"the row has fields {fields} and '{spec.answer_field}' = {shown}."
    )


def test_missing_answer_shows_at_most_80_characters():
    long_answer = "step " * 30  # 150 characters, no ####
    message = error_of(load_benchmark, "gsm8k", [{"question": "q", "answer": long_answer}])
    assert message.endswith("'answer' = " + repr("step " * 16) + ".")  # the first 80


@pytest.mark.parametrize(
    ("name", "row", "fields", "wanted"),
    [
        ("math500", {"answer": "3"}, "['answer']", "'problem' or 'question'"),
        ("gsm8k", {"question": "", "problem": None, "answer": "#### 1"}, "['answer', 'problem', 'question']",
         "'question' or 'problem'"),
        ("olympiadbench", {"final_answer": ["1"], "context": "c"}, "['context', 'final_answer']",
         "'question' or 'problem'"),
    ],
)  # fmt: skip
def test_missing_question_names_the_fields(name, row, fields, wanted):
    assert error_of(load_benchmark, name, [row]) == (
        f"{name} row 0: benchmark '{name}' needs a question in field {wanted}; the row has fields {fields}."
    )


def test_a_source_without_rows(tmp_path):
    assert error_of(load_benchmark, "gsm8k", []) == "Benchmark 'gsm8k': source [] holds no problems."
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    assert error_of(load_benchmark, "aime24", empty) == (
        f"Benchmark 'aime24': source PosixPath('{empty}') holds no problems."
    )


# ------------------------------------------------------------------ resolve_sources


def test_sources_from_data_dir_and_explicit_data(tmp_path):
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    write_jsonl(tmp_path / "aime24.jsonl", [{"problem": "p", "answer": "1"}])
    write_jsonl(tmp_path / "math500" / "test.jsonl", [{"problem": "p", "answer": "1"}])
    write_jsonl(tmp_path / "math500.jsonl", [{"problem": "p", "answer": "2"}])
    assert resolve_sources(["gsm8k", "aime24", "math500"], data_dir=tmp_path) == {
        "gsm8k": tmp_path / "gsm8k" / "test.jsonl",
        "aime24": tmp_path / "aime24.jsonl",  # <name>.jsonl when there is no <name>/test.jsonl
        "math500": tmp_path / "math500" / "test.jsonl",  # <name>/test.jsonl first
    }
    rows = [{"problem": "p", "answer": "1"}]
    assert resolve_sources(["gsm8k", "aime24"], data_dir=str(tmp_path), data={"aime24": rows}) == {
        "gsm8k": tmp_path / "gsm8k" / "test.jsonl",
        "aime24": rows,  # explicit data wins over the folder
    }
    assert resolve_sources(["gsm8k"], data={"gsm8k": "org/gsm8k", "aime24": "org/aime"}) == {"gsm8k": "org/gsm8k"}
    assert resolve_sources([], data_dir=tmp_path / "nowhere") == {}


def test_sources_expand_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "bench" / "gsm8k" / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    assert resolve_sources(["gsm8k"], data_dir="~/bench") == {"gsm8k": tmp_path / "bench" / "gsm8k" / "test.jsonl"}


def test_source_errors(tmp_path):
    assert error_of(resolve_sources, ["gsm8k"], data={"gsm8k": "x", "gsm9k": "y", "AIME24": "z"}) == (
        f"--data names unknown benchmark(s) ['gsm9k', 'AIME24']: choose from {KNOWN}."
    )
    assert error_of(resolve_sources, ["aime24"], data_dir=tmp_path) == (
        f"Benchmark 'aime24': no data under {tmp_path} (looked for {tmp_path}/aime24/test.jsonl, "
        f"{tmp_path}/aime24.jsonl). Add it there or pass --data aime24=PATH_OR_HUB_ID."
    )
    assert error_of(resolve_sources, ["gsm8k", "math500"], data={"gsm8k": "org/x"}) == (
        "Benchmark 'math500': no data source. Pass --data-dir DIR (with math500/test.jsonl) "
        "or --data math500=PATH_OR_HUB_ID."
    )
    (tmp_path / "aime24").mkdir()  # a folder without test.jsonl is not data
    assert "no data under" in error_of(resolve_sources, ["aime24"], data_dir=tmp_path)
