"""Math data: SimpleRL prompts for plain and chat tokenizers, every source kind, and errors that name the fix."""

import json

import pandas as pd
import pytest
from datasets import Dataset, DatasetDict

from dhpo_trl.data import SIMPLERL_INSTRUCTION, SIMPLERL_SYSTEM_PROMPT, format_prompt, load_math_dataset
from dhpo_trl.tiny import build_char_tokenizer

ROWS = {"question": ["What is 1+1?", "Compute $3^2$.", "Solve x+1=3."], "gt_answer": ["2", "9", "2"]}


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


def test_plain_prompt_for_tokenizers_without_chat_template(tokenizer):
    prompt = format_prompt("  What is 1+1? ", tokenizer)
    assert prompt == f"{SIMPLERL_SYSTEM_PROMPT}\n\nWhat is 1+1?\n{SIMPLERL_INSTRUCTION}\n\nAnswer:"
    assert format_prompt("What is 1+1?") == prompt
    assert SIMPLERL_INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."


def test_chat_prompt_for_tokenizers_with_chat_template(chat_tokenizer):
    messages = format_prompt("What is 1+1?", chat_tokenizer)
    assert messages == [
        {"role": "system", "content": SIMPLERL_SYSTEM_PROMPT},
        {"role": "user", "content": f"What is 1+1?\n{SIMPLERL_INSTRUCTION}"},
    ]
    rendered = chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("\\boxed{}.\n<assistant>")


def _write(tmp_path, kind):
    frame = pd.DataFrame(ROWS)
    path = tmp_path / f"train.{kind}"
    if kind == "parquet":
        frame.to_parquet(path)
    elif kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in frame.to_dict("records")))
    else:
        path.write_text(json.dumps(frame.to_dict("records")))
    return path


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "json"])
def test_local_files(tmp_path, tokenizer, kind):
    dataset = load_math_dataset(_write(tmp_path, kind), answer_column="gt_answer", tokenizer=tokenizer)
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset["answer"] == ["2", "9", "2"]
    assert dataset[1]["prompt"] == format_prompt("Compute $3^2$.", tokenizer)


def test_in_memory_datasets_and_nested_columns(chat_tokenizer):
    rows = {"extra_info": [{"question": "What is 2+2?", "answer": 4}, {"question": "What is 0+0?", "answer": 0}]}
    dataset = load_math_dataset(
        Dataset.from_dict(rows),
        question_column="extra_info.question",
        answer_column="extra_info.answer",
        tokenizer=chat_tokenizer,
    )
    assert dataset["answer"] == ["4", "0"]  # numbers become text for math-verify; 0 is an answer, not a blank
    assert dataset[0]["prompt"][1]["content"].startswith("What is 2+2?\n")
    splits = DatasetDict({"train": Dataset.from_dict(ROWS), "test": Dataset.from_dict(ROWS).select([0])})
    assert len(load_math_dataset(splits, split="test", answer_column="gt_answer")) == 1


def test_hub_style_folder_with_subset_folders(tmp_path):
    """SimpleRL-Zoo-Data keeps subsets in folders (no configs): `subset` falls back to a data_dir."""
    (tmp_path / "simplelr_qwen_level3to5").mkdir()
    pd.DataFrame(ROWS).to_parquet(tmp_path / "simplelr_qwen_level3to5" / "train.parquet")
    (tmp_path / "simplelr_qwen_level1to4").mkdir()
    pd.DataFrame({"question": ["q"], "gt_answer": ["1"]}).to_parquet(
        tmp_path / "simplelr_qwen_level1to4" / "train.parquet"
    )
    dataset = load_math_dataset(tmp_path, subset="simplelr_qwen_level3to5", answer_column="gt_answer")
    assert dataset["answer"] == ["2", "9", "2"]


def test_rows_without_answer_are_dropped(tmp_path):
    rows = {"question": ["a", "b", "c", ""], "gt_answer": ["1", "", None, "4"]}
    dataset = load_math_dataset(Dataset.from_dict(rows), answer_column="gt_answer")
    assert dataset["answer"] == ["1"]


def test_missing_column_names_it_lists_the_columns_and_the_flag(tmp_path):
    with pytest.raises(ValueError) as error:
        load_math_dataset(_write(tmp_path, "parquet"))  # default answer column "answer" is absent
    message = str(error.value)
    assert "'answer'" in message and "['question', 'gt_answer']" in message and "--answer_column" in message
    with pytest.raises(ValueError, match=r"'problem'.*--question_column"):
        load_math_dataset(_write(tmp_path, "jsonl"), question_column="problem", answer_column="gt_answer")


def test_empty_dataset_and_all_blank_answers(tmp_path):
    empty = tmp_path / "empty.jsonl"
    pd.DataFrame({"question": [], "answer": []}).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="is empty"):
        load_math_dataset(tmp_path / "empty.parquet")
    (tmp_path / "blank.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_math_dataset(tmp_path / "blank.jsonl")
    with pytest.raises(ValueError, match="is empty"):
        load_math_dataset(Dataset.from_dict({"question": [], "answer": []}))
    empty.write_text(json.dumps({"question": "q", "answer": ""}))
    with pytest.raises(ValueError, match="empty 'question' or 'answer'"):
        load_math_dataset(empty)


def test_offline_hub_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError) as error:
        load_math_dataset("hkust-nlp/SimpleRL-Zoo-Data", subset="simplelr_qwen_level3to5")
    message = str(error.value)
    assert "hkust-nlp/SimpleRL-Zoo-Data" in message
    assert "HF_HUB_OFFLINE" in message and "--dataset_name /path/to/train.parquet" in message


def test_bad_paths_and_types(tmp_path):
    with pytest.raises(ValueError, match="no such file or folder"):
        load_math_dataset(str(tmp_path / "missing.parquet"))
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        load_math_dataset(tmp_path / "data.txt")
    with pytest.raises(ValueError, match="--dataset_name must be"):
        load_math_dataset(42)


def test_gsm8k_format_keeps_the_text_after_the_last_hash_marks(tmp_path):
    """load_math_dataset(gsm8k, answer_column="answer") used to keep the whole solution: every reward was 0."""
    rows = [
        {"question": "Tom has 5 apples and buys 7 more. How many?", "answer": "5 + 7 = <<5+7=12>>12\n#### 12"},
        {"question": "How many pens in 3 days at 400 a day?", "answer": "400 * 3 = 1200\n#### 1,200"},
        {"question": "A tricky one?", "answer": "a first #### inside the working\n#### 7"},  # more than one ####
        {"question": "Nothing after the marks?", "answer": "work\n####   "},
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    dataset = load_math_dataset(path, answer_column="answer")
    assert dataset["answer"] == ["12", "1200", "7"]  # the row without an answer is dropped, not scored 0


def test_answers_are_normalised_with_their_question():
    rows = {
        "question": [
            "Find all functions $g$ with $g(x+1)=g(x)+3$ and $g(0)=-2$.",
            "Write the equation of the line through $(0,-1)$ and $(1,2)$.",
            "What is the luminosity, in erg/s?",
            "Compute $25_7 + 33_7$ in base 7.",
        ],
        "answer": ["$g(x)=3x-2$", "$y = 3x - 1$", "3.9e33", "61_7"],
    }
    dataset = load_math_dataset(Dataset.from_dict(rows))
    assert dataset["answer"] == ["3x-2", "y = 3x - 1", r"3.9 \times 10^{33}", "61_{7}"]


def test_list_answers_are_one_answer_with_components_and_blanks_are_dropped():
    rows = {"question": ["Find all n.", "Find all m.", "Find k."], "answer": [["$3$", "", "$5$"], ["", " "], ["4"]]}
    dataset = load_math_dataset(Dataset.from_dict(rows))
    assert dataset["answer"] == ["3, 5", "4"]  # the all-blank row is dropped
