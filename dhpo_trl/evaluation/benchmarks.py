"""The seven math benchmarks of the DHPO paper's Table 1: registry, protocol and loaders for their real formats.

Each benchmark is read from a local JSONL file (or a directory holding `test.jsonl`) or from a Hub dataset id, and
normalised to `Problem(question, answer)`: the answer is taken from wherever that benchmark keeps it (a plain field, a
float, the last `\\boxed{}` of a worked solution, a list, or the text after `####`) and rewritten by
`dhpo_trl.scoring.golds.normalise_gold` (with the question, and OlympiadBench's `unit`) into LaTeX the grader reads as meant,
exactly as the training loader does. A row without the field raises a ValueError naming the file, the line and the
field, so bad data fails before any model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..scoring.golds import normalise_gold
from ..scoring.rewards import extract_boxed_answer


@dataclass(frozen=True)
class Problem:
    benchmark: str
    index: int
    question: str
    answer: str


def _plain_answer(row: Mapping[str, Any], field: str):
    value = row.get(field)
    return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None


def _boxed_in_solution(row: Mapping[str, Any], field: str) -> str | None:
    solution = row.get(field)
    return extract_boxed_answer(solution) if isinstance(solution, str) else None


def _list_answer(row: Mapping[str, Any], field: str):
    value = row.get(field)
    return [value] if isinstance(value, str) else value if isinstance(value, (list, tuple)) else None


def _after_hashes(row: Mapping[str, Any], field: str) -> str | None:
    value = row.get(field)
    return value if isinstance(value, str) and "####" in value else None  # normalise_gold keeps what follows


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    column: str  # Table-1 header, without the "(Avg@k)" suffix
    num_samples: int  # samples per problem in the paper's protocol
    question_fields: tuple[str, ...]  # the first one present in a row is the question
    answer_field: str
    answer_format: str  # shown in error messages: what the loader expects to find in answer_field
    read_answer: Callable[[Mapping[str, Any], str], Any]  # the raw gold; `normalise_gold` makes it a string
    expected_size: int  # number of problems in the official test set

    def metric_label(self, num_samples: int | None = None) -> str:
        k = self.num_samples if num_samples is None else num_samples
        return f"Avg@{k}" if k > 1 else "Pass@1"

    def header(self, num_samples: int | None = None) -> str:
        k = self.num_samples if num_samples is None else num_samples
        return f"{self.column} (Avg@{k})" if k > 1 else self.column


_SPECS = [
    BenchmarkSpec("aime24", "AIME24", 32, ("problem", "question"), "answer", "a string", _plain_answer, 30),
    BenchmarkSpec("aime25", "AIME25", 32, ("problem", "question"), "answer", "a string", _plain_answer, 30),
    BenchmarkSpec("amc23", "AMC23", 4, ("problem", "question"), "answer", "a number or string", _plain_answer, 40),
    BenchmarkSpec(
        "olympiadbench",
        "Olympiad Bench",
        1,
        ("question", "problem"),
        "final_answer",
        "a list of strings",
        _list_answer,
        675,
    ),
    BenchmarkSpec("math500", "MATH 500", 1, ("problem", "question"), "answer", "a string", _plain_answer, 500),
    BenchmarkSpec(
        "minerva_math",
        "Minerva Math",
        1,
        ("problem", "question"),
        "solution",
        "a solution containing \\boxed{...}",
        _boxed_in_solution,
        272,
    ),
    BenchmarkSpec(
        "gsm8k", "GSM8K", 1, ("question", "problem"), "answer", "text ending in '#### <answer>'", _after_hashes, 1319
    ),
]
# Insertion order is Table 1's column order.
BENCHMARKS: dict[str, BenchmarkSpec] = {spec.name: spec for spec in _SPECS}


def resolve_benchmark_names(names: Iterable[str] | str) -> list[str]:
    """Names (or "all") -> registry names in Table-1 order. Unknown names raise a ValueError listing the known ones."""
    if isinstance(names, str):
        names = [part for part in names.replace(",", " ").split() if part]
    names = [name.strip().lower() for name in names]
    if not names:
        raise ValueError(f"No benchmark given: pass names from {list(BENCHMARKS)} or 'all'.")
    if "all" in names:
        return list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        raise ValueError(f"Unknown benchmark name(s) {unknown}: choose from {list(BENCHMARKS)} or 'all'.")
    return [name for name in BENCHMARKS if name in names]


def check_benchmark_keys(names: Iterable[str], setting: str) -> None:
    """A ValueError naming `setting` (e.g. "--samples") if any of `names`, its per-benchmark keys, is not a benchmark."""
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        raise ValueError(f"{setting} names unknown benchmark(s) {unknown}: choose from {list(BENCHMARKS)}.")


def _rows_from_jsonl(path: Path) -> Iterable[tuple[str, Mapping[str, Any]]]:
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {line_number}: not valid JSON ({error.msg}).") from None
            if not isinstance(row, dict):
                message = f"{path} line {line_number}: expected a JSON object, got {type(row).__name__}."
                raise ValueError(message)  # noqa: TRY004 - bad data is reported as ValueError like every data check
            yield f"{path} line {line_number}", row


def _rows_from_hub(dataset_id: str, split: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    from datasets import load_dataset

    dataset = load_dataset(dataset_id, split=split)
    for index, row in enumerate(dataset):
        yield f"{dataset_id} ({split}) row {index}", row


def _looks_like_local_path(source: str) -> bool:
    """True for things a user meant as a file ("./x", "/x", "x.jsonl", "data/x" with an existing "data/")."""
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json")):
        return True
    first_part = Path(source).parts[0] if Path(source).parts else ""
    return "/" in source and Path(first_part).is_dir()


def _source_rows(name: str, source: Any, split: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    if isinstance(source, (list, tuple)):  # rows already in memory (e.g. built by a training script)
        return ((f"{name} row {index}", row) for index, row in enumerate(source))
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        candidates = [path / "test.jsonl", path / name / "test.jsonl"]
        found = next((candidate for candidate in candidates if candidate.is_file()), None)
        if found is None:
            raise ValueError(
                f"Benchmark '{name}': directory {path} has no test.jsonl (looked for "
                f"{', '.join(str(c) for c in candidates)}). Pass the JSONL file itself or a directory holding it."
            )
        return _rows_from_jsonl(found)
    if path.is_file():
        return _rows_from_jsonl(path)
    if _looks_like_local_path(text):
        raise ValueError(f"Benchmark '{name}': data file {path} does not exist. Check the path (--data {name}=PATH).")
    return _rows_from_hub(text, split)


def load_benchmark(name: str, source: Any, *, split: str = "test", limit: int | None = None) -> list[Problem]:
    """Read benchmark `name` from a JSONL path, a directory with test.jsonl, a Hub dataset id or a list of dict rows.

    Every row is checked (not only the first `limit`), so a broken file fails here, before any model loads.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"Unknown benchmark name '{name}': choose from {list(BENCHMARKS)}.")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of problems, got {limit}.")
    spec = BENCHMARKS[name]
    problems = []
    for where, row in _source_rows(name, source, split):
        question_field = next((field for field in spec.question_fields if row.get(field)), None)
        if question_field is None:
            raise ValueError(
                f"{where}: benchmark '{name}' needs a question in field "
                f"{' or '.join(repr(f) for f in spec.question_fields)}; the row has fields {sorted(row)}."
            )
        question = str(row[question_field]).strip()
        context = row.get("context")  # OlympiadBench physics problems put shared setup text here
        if isinstance(context, str) and context.strip():
            question = f"{context.strip()}\n\n{question}"
        raw = spec.read_answer(row, spec.answer_field)
        unit = row.get("unit") if isinstance(row.get("unit"), str) else None  # OlympiadBench: "%", "km", ...
        answer = normalise_gold(raw, question=question, unit=unit) if raw is not None else None
        if answer is None:
            found = str(row.get(spec.answer_field))
            raise ValueError(
                f"{where}: benchmark '{name}' needs field '{spec.answer_field}' holding {spec.answer_format}; "
                f"the row has fields {sorted(row)} and '{spec.answer_field}' = {found[:80]!r}."
            )
        problems.append(Problem(benchmark=name, index=len(problems), question=question, answer=answer))
    if not problems:
        raise ValueError(f"Benchmark '{name}': source {source!r} holds no problems.")
    return problems[:limit] if limit is not None else problems


def resolve_sources(
    names: Iterable[str], *, data_dir: str | Path | None = None, data: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Where each benchmark's data comes from: an explicit `data[name]` first, else `data_dir/<name>/test.jsonl`."""
    data = dict(data or {})
    check_benchmark_keys(data, "--data")
    sources = {}
    for name in names:
        if name in data:
            sources[name] = data[name]
        elif data_dir is not None:
            directory = Path(data_dir).expanduser()
            candidates = [directory / name / "test.jsonl", directory / f"{name}.jsonl"]
            found = next((candidate for candidate in candidates if candidate.is_file()), None)
            if found is None:
                raise ValueError(
                    f"Benchmark '{name}': no data under {directory} (looked for "
                    f"{', '.join(str(c) for c in candidates)}). Add it there or pass --data {name}=PATH_OR_HUB_ID."
                )
            sources[name] = found
        else:
            raise ValueError(
                f"Benchmark '{name}': no data source. Pass --data-dir DIR (with {name}/test.jsonl) "
                f"or --data {name}=PATH_OR_HUB_ID."
            )
    return sources
