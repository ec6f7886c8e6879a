"""Math data: SimpleRL prompts for plain and chat tokenizers, every source kind, and errors that name the fix.

Expected prompts, answers and messages are written out in full: a test that recomputed them with the loader
would pass on the loader's own bugs.
"""

import json
import logging
import re

import datasets
import huggingface_hub
import pandas as pd
import pytest
from datasets import Dataset, DatasetDict
from huggingface_hub.hf_api import RepoFile, RepoFolder

from dhpo_trl.demo.tiny import build_char_tokenizer
from dhpo_trl.scoring import data
from dhpo_trl.scoring.data import SIMPLERL_INSTRUCTION, SIMPLERL_SYSTEM_PROMPT, format_prompt, load_math_dataset

ROWS = {"question": ["What is 1+1?", "Compute $3^2$.", "Solve x+1=3."], "gt_answer": ["2", "9", "2"]}
PLAIN = (
    "You are a helpful assistant.\n\n{}\n"
    "Please reason step by step, and put your final answer within \\boxed{{}}.\n\nAnswer:"
)
HUB_ID = "hkust-nlp/SimpleRL-Zoo-Data"
SUBSET = "simplelr_qwen_level3to5"


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    return tokenizer


def _write(path, rows):
    """Write `rows` (a dict of columns) as the file type of `path`'s suffix, in any case."""
    frame = pd.DataFrame(rows)
    kind = path.suffix.lower()
    if kind == ".parquet":
        frame.to_parquet(path)
    elif kind == ".csv":
        frame.to_csv(path, index=False)
    elif kind == ".jsonl":
        path.write_text("\n".join(json.dumps(row) for row in frame.to_dict("records")))
    else:
        path.write_text(json.dumps(frame.to_dict("records")))
    return path


def _subset_folders(root, names=("simplelr_qwen_level1to4", SUBSET)):
    """A SimpleRL-Zoo-Data style folder: one data folder per subset, no configs."""
    for number, name in enumerate(names):
        (root / name).mkdir(parents=True)
        _write(root / name / "train.parquet", {"question": [f"Subset {name}?"], "answer": [f"{number + 10}"]})
    (root / ".cache").mkdir()  # hidden folders are no subsets
    return root


def _config_folder(root):
    """A folder whose README declares two named configs, as Hub datasets with configs do."""
    for name, answer in (("data_a", "1"), ("data_b", "2")):
        (root / name).mkdir(parents=True)
        _write(root / name / "train.parquet", {"question": [f"From {name}?"], "answer": [answer]})
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: first\n  data_files:\n  - split: train\n    path: data_a/train.parquet\n"
        "- config_name: second\n  data_files:\n  - split: train\n    path: data_b/train.parquet\n---\n"
    )
    return root


# ------------------------------------------------------------------ prompts
def test_plain_prompt_without_tokenizer_or_chat_template(tokenizer):
    expected = (
        "You are a helpful assistant.\n\nWhat is 1+1?\n"
        "Please reason step by step, and put your final answer within \\boxed{}.\n\nAnswer:"
    )
    assert format_prompt("  What is 1+1? \n", tokenizer) == expected  # the question is stripped
    assert format_prompt("What is 1+1?") == expected
    tokenizer.chat_template = ""  # an empty template is no template
    assert format_prompt("What is 1+1?", tokenizer) == expected
    assert format_prompt("What is 1+1?", object()) == expected  # a tokenizer without the attribute at all


def test_chat_prompt_for_tokenizers_with_a_chat_template(chat_tokenizer):
    assert format_prompt(" What is 1+1?", chat_tokenizer) == [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.",
        },
    ]
    assert SIMPLERL_SYSTEM_PROMPT == "You are a helpful assistant."
    assert SIMPLERL_INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."


def test_loaded_prompts_follow_the_tokenizer(chat_tokenizer):
    rows = Dataset.from_dict({"question": ["What is 2+2?"], "answer": ["4"]})
    assert load_math_dataset(rows)["prompt"] == [PLAIN.format("What is 2+2?")]
    chat = load_math_dataset(rows, tokenizer=chat_tokenizer)["prompt"][0]
    assert chat[1] == {
        "role": "user",
        "content": "What is 2+2?\nPlease reason step by step, and put your final answer within \\boxed{}.",
    }


# ------------------------------------------------------------------ sources
@pytest.mark.parametrize("name", ["train.parquet", "train.jsonl", "train.json", "train.csv", "TRAIN.JSONL"])
def test_every_file_type_loads_the_same_problems(tmp_path, name):
    path = _write(tmp_path / name, ROWS)
    dataset = load_math_dataset(str(path), answer_column="gt_answer")
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset["answer"] == ["2", "9", "2"]  # a CSV reads them back as numbers: they are text again
    assert dataset["prompt"] == [
        PLAIN.format("What is 1+1?"),
        PLAIN.format("Compute $3^2$."),
        PLAIN.format("Solve x+1=3."),
    ]


def test_home_relative_paths_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / "train.jsonl", {"question": ["q?"], "answer": [7]})
    assert load_math_dataset("~/train.jsonl")["answer"] == ["7"]


def test_in_memory_dataset_and_dataset_dict_split():
    dataset = load_math_dataset(Dataset.from_dict(ROWS), answer_column="gt_answer")
    assert dataset["answer"] == ["2", "9", "2"]
    splits = DatasetDict(
        {"train": Dataset.from_dict(ROWS), "test": Dataset.from_dict({"question": ["Test?"], "gt_answer": ["5"]})}
    )
    assert load_math_dataset(splits, answer_column="gt_answer")["answer"] == ["2", "9", "2"]  # "train" by default
    assert load_math_dataset(splits, split="test", answer_column="gt_answer")["prompt"] == [PLAIN.format("Test?")]
    with pytest.raises(ValueError) as error:
        load_math_dataset(splits, split="validation", answer_column="gt_answer")
    assert str(error.value) == (
        "Split 'validation' is not in the DatasetDict (splits: ['train', 'test']): set --dataset_train_split."
    )


def test_a_split_or_subset_that_cannot_act_is_refused(tmp_path):
    """A single file or a Dataset holds one split and no configs; a DatasetDict has splits but no configs."""
    _write(tmp_path / "train.jsonl", {"question": ["q?"], "answer": [7]})
    Dataset.from_dict({"question": ["Saved?"], "answer": [3]}).save_to_disk(tmp_path / "saved")
    DatasetDict({"train": Dataset.from_dict({"question": ["A?"], "answer": ["1"]})}).save_to_disk(tmp_path / "dict")
    file, saved = tmp_path / "train.jsonl", tmp_path / "saved"
    cases = [
        (file, dict(split="test"), f"--dataset_train_split='test' does not apply to the single file {file}, which "
         "holds one split: drop it, or point --dataset_name at a folder of split files or a DatasetDict."),
        (file, dict(subset="level3"), f"--dataset_config='level3' does not apply to the single file {file}, which "
         "has no configs: drop it."),
        (Dataset.from_dict(ROWS), dict(split="test"), "--dataset_train_split='test' does not apply to a Dataset, "
         "which holds one split: drop it, or point --dataset_name at a folder of split files or a DatasetDict."),
        (Dataset.from_dict(ROWS), dict(subset="x"), "--dataset_config='x' does not apply to a Dataset, which has "
         "no configs: drop it."),
        (saved, dict(split="test"), "--dataset_train_split='test' does not apply to a Dataset, which holds one "
         "split: drop it, or point --dataset_name at a folder of split files or a DatasetDict."),
        (tmp_path / "dict", dict(subset="x"), "--dataset_config='x' does not apply to a DatasetDict, which has no "
         "configs: drop it."),
    ]  # fmt: skip
    for source, settings, message in cases:
        with pytest.raises(ValueError) as error:
            load_math_dataset(source, answer_column="gt_answer" if isinstance(source, Dataset) else "answer", **settings)
        assert str(error.value) == message


def test_save_to_disk_folders(tmp_path):
    Dataset.from_dict({"question": ["Saved?"], "answer": [3]}).save_to_disk(tmp_path / "one")
    assert load_math_dataset(tmp_path / "one")["answer"] == ["3"]
    DatasetDict(
        {
            "train": Dataset.from_dict({"question": ["A?"], "answer": ["1"]}),
            "test": Dataset.from_dict({"question": ["B?"], "answer": ["2"]}),
        }
    ).save_to_disk(tmp_path / "splits")
    assert load_math_dataset(tmp_path / "splits", split="test")["answer"] == ["2"]
    with pytest.raises(ValueError) as error:
        load_math_dataset(tmp_path / "splits", split="dev")
    message = str(error.value)
    assert message == "Split 'dev' is not in the DatasetDict (splits: ['train', 'test']): set --dataset_train_split."


def test_an_empty_save_to_disk_folder_names_the_path(tmp_path):
    """datasets fails on it with `IndexError: list index out of range`, which names nothing."""
    Dataset.from_dict({"question": [], "answer": []}).save_to_disk(tmp_path / "empty")
    with pytest.raises(ValueError) as error:
        load_math_dataset(tmp_path / "empty")
    assert str(error.value) == (
        f"The saved dataset {tmp_path / 'empty'} is empty (or one of its splits is, which datasets cannot load): "
        "save it again with at least one problem in every split, or point --dataset_name at another dataset."
    )


def assert_split_error(message, prefix, available):
    """Our split error: our prefix, the splits that exist and the two flags to change. datasets' own sentence sits
    in the middle; its wording is not ours to assert."""
    assert message.startswith(prefix)
    for named in (*available, "--dataset_train_split", "--dataset_config"):
        assert named in message


def test_data_folder_with_split_files(tmp_path):
    _write(tmp_path / "train.jsonl", {"question": ["Train?"], "answer": ["1"]})
    _write(tmp_path / "test.jsonl", {"question": ["Test?"], "answer": ["2"]})
    assert load_math_dataset(tmp_path)["answer"] == ["1"]
    assert load_math_dataset(tmp_path, split="test")["answer"] == ["2"]
    with pytest.raises(ValueError) as error:
        load_math_dataset(tmp_path, split="validation")
    assert_split_error(str(error.value), f"Could not load split 'validation' of '{tmp_path}': ", ["'train'", "'test'"])
    with pytest.raises(
        ValueError, match=r"^Could not load split None of '.*': Expected one split None, got DatasetDict\. Check"
    ):
        load_math_dataset(tmp_path, split=None)


def test_subset_folders_as_in_simplerl_zoo_data(tmp_path):
    """SimpleRL-Zoo-Data keeps subsets in folders (no configs): `subset` falls back to a data_dir."""
    root = _subset_folders(tmp_path)
    dataset = load_math_dataset(root, subset=SUBSET)
    assert dataset["answer"] == ["11"] and dataset["prompt"] == [PLAIN.format(f"Subset {SUBSET}?")]
    assert load_math_dataset(root, subset="simplelr_qwen_level1to4")["answer"] == ["10"]
    with pytest.raises(ValueError) as error:
        load_math_dataset(root, subset=SUBSET, split="test")
    assert_split_error(str(error.value), f"Could not load split 'test' of '{root}' (subset '{SUBSET}'): ", ["'train'"])


def test_a_mistyped_subset_folder_lists_the_subsets(tmp_path):
    """It used to raise datasets' EmptyDatasetError ("The directory at ... doesn't contain any data files")."""
    root = _subset_folders(tmp_path)
    with pytest.raises(ValueError) as error:
        load_math_dataset(root, subset="simplelr_qwen_level3to6")
    assert str(error.value) == (
        f"--dataset_config='simplelr_qwen_level3to6' is not a config or a data folder of '{root}': "
        "set --dataset_config to one of ['simplelr_qwen_level1to4', 'simplelr_qwen_level3to5']."
    )


def test_a_mistyped_subset_when_the_configs_cannot_be_listed(tmp_path, monkeypatch):
    """Listing the configs is best effort: when it fails, the data folders are still offered."""
    root = _subset_folders(tmp_path)

    def unreadable(path):
        raise OSError("cannot read the dataset card")

    monkeypatch.setattr(data, "get_dataset_config_names", unreadable)
    with pytest.raises(ValueError) as error:
        load_math_dataset(root, subset="level3to5")
    assert str(error.value) == (
        f"--dataset_config='level3to5' is not a config or a data folder of '{root}': "
        "set --dataset_config to one of ['simplelr_qwen_level1to4', 'simplelr_qwen_level3to5']."
    )


def test_named_configs(tmp_path):
    root = _config_folder(tmp_path)
    assert load_math_dataset(root, subset="second")["prompt"] == [PLAIN.format("From data_b?")]
    assert load_math_dataset(root, subset="first")["answer"] == ["1"]
    with pytest.raises(ValueError) as error:
        load_math_dataset(root, subset="thrid")
    assert str(error.value) == (
        f"--dataset_config='thrid' is not a config or a data folder of '{root}': "
        "set --dataset_config to one of ['first', 'second', 'data_a', 'data_b']."
    )
    with pytest.raises(ValueError) as error:
        load_math_dataset(root)
    assert str(error.value) == (
        f"'{root}' has several configs and none was picked: "
        "set --dataset_config to one of ['first', 'second', 'data_a', 'data_b']."
    )
    with pytest.raises(ValueError) as error:
        load_math_dataset(root, subset="second", split="test")
    assert_split_error(str(error.value), f"Could not load split 'test' of '{root}' (subset 'second'): ", ["'train'"])


# ------------------------------------------------------------------ the Hub
@pytest.fixture
def hub_offline(monkeypatch):
    """No test touches the network: datasets refuses the Hub whatever the variables below say."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _hub_error(subset=SUBSET):
    with pytest.raises(ValueError) as error:
        load_math_dataset(HUB_ID, subset=subset)
    return str(error.value)


HUB_PREFIX = (
    "Could not load the Hub dataset 'hkust-nlp/SimpleRL-Zoo-Data' (subset 'simplelr_qwen_level3to5', split 'train'): "
    "ConnectionError: "
)
LOCAL_COPY = (
    ": pass --dataset_name /path/to/train.parquet (or .jsonl), e.g. after "
    "`hf download hkust-nlp/SimpleRL-Zoo-Data --repo-type dataset --local-dir data/`."
)


@pytest.mark.parametrize("value", ["1", "on", "ON", "yes", "YES", "true", "True"])
def test_every_spelling_of_offline_that_huggingface_hub_accepts(hub_offline, value):
    hub_offline.setenv("HF_HUB_OFFLINE", value)
    message = _hub_error()
    assert message.startswith(HUB_PREFIX)
    assert message.endswith(f". HF_HUB_OFFLINE={value} is set: unset it to download, or use a local copy{LOCAL_COPY}")


@pytest.mark.parametrize(
    "variables, named",
    [
        ({"HF_DATASETS_OFFLINE": "Yes", "HF_HUB_OFFLINE": "0"}, "HF_DATASETS_OFFLINE=Yes"),
        ({"TRANSFORMERS_OFFLINE": "1"}, "TRANSFORMERS_OFFLINE=1"),  # huggingface_hub's fallback
        ({"TRANSFORMERS_OFFLINE": "on", "HF_HUB_OFFLINE": ""}, "TRANSFORMERS_OFFLINE=on"),  # empty counts as unset
    ],
)
def test_offline_variables_beside_hf_hub_offline(hub_offline, variables, named):
    for name, value in variables.items():
        hub_offline.setenv(name, value)
    assert _hub_error().endswith(f". {named} is set: unset it to download, or use a local copy{LOCAL_COPY}")


ONLINE = [
    {},
    {"HF_HUB_OFFLINE": "0"},
    {"HF_HUB_OFFLINE": "false"},
    {"HF_HUB_OFFLINE": "off", "HF_DATASETS_OFFLINE": "no"},
    {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"},  # a set HF_HUB_OFFLINE wins over TRANSFORMERS_OFFLINE
]


@pytest.mark.parametrize("variables", ONLINE)
def test_online_failures_point_at_the_connection(hub_offline, variables):
    for name, value in variables.items():
        hub_offline.setenv(name, value)
    message = _hub_error()
    assert message.startswith(HUB_PREFIX)
    assert message.endswith(
        ". check the id and your connection (and `hf auth login` for gated data), or use a local copy" + LOCAL_COPY
    )


@pytest.fixture
def hub_as_local_folder(tmp_path, monkeypatch):
    """The Hub id answered by a local copy with subset folders, and the Hub's listing of its top-level entries."""
    root = _subset_folders(tmp_path)
    real_load = datasets.load_dataset
    monkeypatch.setattr(data, "load_dataset", lambda path, *args, **kwargs: real_load(str(root), *args, **kwargs))
    monkeypatch.setattr(data, "get_dataset_config_names", lambda path: ["default"])
    listed = []

    def list_repo_tree(self, repo_id, **kwargs):
        listed.append((repo_id, kwargs))
        folders = [RepoFolder(path=name, oid="0") for name in (SUBSET, "simplelr_qwen_level1to4")]
        return iter([RepoFile(path="README.md", size=1, oid="0"), *folders])

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", list_repo_tree)
    return listed


def test_a_mistyped_hub_subset_lists_the_subsets_not_the_connection(hub_as_local_folder):
    assert load_math_dataset(HUB_ID, subset=SUBSET)["answer"] == ["11"]
    assert _hub_error("simplelr_qwen_level3to6") == (
        "--dataset_config='simplelr_qwen_level3to6' is not a config or a data folder of 'hkust-nlp/SimpleRL-Zoo-Data': "
        "set --dataset_config to one of ['simplelr_qwen_level1to4', 'simplelr_qwen_level3to5']."
    )
    assert hub_as_local_folder == [(HUB_ID, {"repo_type": "dataset"})]


def test_a_mistyped_hub_subset_when_the_listing_fails(hub_as_local_folder, monkeypatch):
    def gated(self, repo_id, **kwargs):
        raise huggingface_hub.errors.GatedRepoError("gated")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", gated)
    assert _hub_error("level3to5") == (
        "--dataset_config='level3to5' is not a config or a data folder of 'hkust-nlp/SimpleRL-Zoo-Data': "
        "check --dataset_config against its configs and data folders."
    )


def test_a_bad_split_on_the_hub_is_a_split_error_not_a_connection_error(hub_as_local_folder):
    with pytest.raises(ValueError) as error:
        load_math_dataset(HUB_ID, subset=SUBSET, split="test")
    prefix = "Could not load split 'test' of 'hkust-nlp/SimpleRL-Zoo-Data' (subset 'simplelr_qwen_level3to5'): "
    assert_split_error(str(error.value), prefix, ["'train'"])


def test_a_split_error_drops_only_the_reasons_own_full_stops():
    """The reason is quoted inside a sentence: its trailing full stops go, and nothing else of it."""
    error = data._split_error("org/ds", "test", ValueError("No data files for split TEST_X..."), subset="X")
    assert str(error) == (
        "Could not load split 'test' of 'org/ds' (subset 'X'): No data files for split TEST_X. "
        "Check --dataset_train_split and --dataset_config."
    )
    assert str(data._split_error("d", "train", ValueError("Bad split XX"))) == (
        "Could not load split 'train' of 'd': Bad split XX. Check --dataset_train_split and --dataset_config."
    )


# ------------------------------------------------------------------ bad sources
@pytest.mark.parametrize(
    "source", ["./missing", "/no/such/dir", "~/no/such/file", "missing.parquet", "data/train.CSV"]
)
def test_missing_local_paths_are_not_taken_for_hub_ids(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError) as error:
        load_math_dataset(source)
    assert str(error.value) == f"--dataset_name={source!r}: no such file or folder."


@pytest.mark.parametrize("source", [42, None, "", "   ", ["train.parquet"]])
def test_sources_of_the_wrong_kind(source):
    with pytest.raises(ValueError) as error:
        load_math_dataset(source)
    assert str(error.value) == (
        f"--dataset_name must be a Hub dataset id, a local file or folder, or a Dataset; got {source!r}."
    )


def test_unsupported_and_unreadable_files(tmp_path):
    (tmp_path / "train.txt").write_text("What is 1+1?")
    with pytest.raises(ValueError) as error:
        load_math_dataset(tmp_path / "train.txt")
    assert str(error.value) == (
        f"--dataset_name='{tmp_path / 'train.txt'}': unsupported file type '.txt'; "
        "use one of ['.csv', '.json', '.jsonl', '.parquet']."
    )
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=rf"^Could not read {re.escape(str(tmp_path))}/broken\.parquet as parquet: "):
        load_math_dataset(tmp_path / "broken.parquet")


def test_a_file_that_is_not_utf8_text_is_reported_as_unreadable(tmp_path):
    """The emptiness check reads bytes: a Latin-1 file gets the reader's own error, named with the file."""
    path = tmp_path / "latin1.csv"
    path.write_bytes("question,answer\nCaf\u00e9 costs?,1\n".encode("latin-1"))
    assert data._file_has_no_rows(path, "csv") is False
    with pytest.raises(ValueError, match=rf"^Could not read {re.escape(str(path))} as csv: "):
        load_math_dataset(path)
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b" \xa0 \n")  # a non-breaking space in Latin-1 is a byte, not blank
    assert data._file_has_no_rows(blank, "json") is False


def test_a_latin1_jsonl_file_is_refused_with_the_byte_that_is_not_utf8(tmp_path):
    """datasets' JSON reader loads Latin-1 bytes silently; the bad string used to fail later, as a bare
    UnicodeDecodeError, when its row was read."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"question": "Caf\u00e9 costs?", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^Could not read {re.escape(str(path))} as json: byte 17 is not UTF-8 "
                       r"text; re-save the file as UTF-8\.$"):
        load_math_dataset(path)


def test_utf8_check_counts_bytes_across_its_read_chunks(tmp_path):
    """A character cut by the 1 MiB read boundary is valid; a bad byte after it is reported at its file offset."""
    head = b"x" * ((1 << 20) - 1) + "\u00e9".encode()  # the two-byte character straddles the boundary
    good = tmp_path / "good.jsonl"
    good.write_bytes(head + b"\n")
    data._check_utf8(good, "json")  # no error
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(head + b"ab\xff")
    with pytest.raises(ValueError, match=rf"byte {(1 << 20) + 3} is not UTF-8"):
        data._check_utf8(bad, "json")
    third = tmp_path / "third.jsonl"  # the offset keeps counting past the second chunk
    third.write_bytes(b"y" * (2 << 20) + b"abcd\xfe")
    with pytest.raises(ValueError, match=rf"byte {(2 << 20) + 4} is not UTF-8"):
        data._check_utf8(third, "json")
    truncated = tmp_path / "cut.csv"
    truncated.write_bytes(b"question,answer\n1+1,2\xc3")  # a file ending inside a character
    with pytest.raises(ValueError, match=r"as csv: byte 21 is not UTF-8"):
        data._check_utf8(truncated, "csv")


@pytest.mark.parametrize(
    "name, content",
    [
        ("e.jsonl", " \n\n "),
        ("e.json", ""),
        ("e.csv", "\n"),
        ("e.parquet", None),
        ("h.csv", "question,answer\n"),
        ("l.json", "[]"),
    ],
)
def test_empty_files(tmp_path, name, content):
    path = tmp_path / name
    if content is None:
        _write(path, {"question": [], "answer": []})
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as error:
        load_math_dataset(path)
    message = str(error.value)
    assert message == f"The dataset file {path} is empty: point --dataset_name at a file with at least one problem."


def test_an_empty_in_memory_dataset():
    with pytest.raises(ValueError) as error:
        load_math_dataset(Dataset.from_dict({"question": [], "answer": []}))
    assert str(error.value) == (
        "The dataset Dataset (split 'train') is empty: point --dataset_name at a dataset with at least one problem, "
        "or pick another split with --dataset_train_split."
    )


# ------------------------------------------------------------------ columns
def test_missing_columns_list_what_is_there_and_name_the_flag(tmp_path):
    path = _write(tmp_path / "train.parquet", ROWS)
    with pytest.raises(ValueError) as error:
        load_math_dataset(path)  # the default answer column "answer" is absent
    assert str(error.value) == (
        f"Column 'answer' is not in the dataset '{path}'; available columns: ['question', 'gt_answer']. "
        "Set --answer_column to the right one."
    )
    with pytest.raises(ValueError) as error:
        load_math_dataset(Dataset.from_dict(ROWS), question_column="problem", answer_column="gt_answer")
    assert str(error.value) == (
        "Column 'problem' is not in the dataset Dataset; available columns: ['question', 'gt_answer']. "
        "Set --question_column to the right one."
    )


NESTED = {"extra_info": [{"question": "What is 2+2?", "answer": 4}, {"question": "What is 0+0?", "answer": 0}]}


def test_nested_columns():
    dataset = load_math_dataset(
        Dataset.from_dict({"id": [1, 2], **NESTED}),
        question_column="extra_info.question",
        answer_column="extra_info.answer",
    )
    assert dataset["answer"] == ["4", "0"]  # numbers become text for math-verify; 0 is an answer, not a blank
    assert dataset["prompt"] == [PLAIN.format("What is 2+2?"), PLAIN.format("What is 0+0?")]


def test_a_nested_column_of_a_row_whose_parent_is_null_is_blank(caplog):
    """A struct column may be null in some rows: those rows have no question or answer and are dropped."""
    rows = Dataset.from_dict({"extra_info": [NESTED["extra_info"][0], None, NESTED["extra_info"][1]]})
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.scoring.data"):
        dataset = load_math_dataset(rows, question_column="extra_info.question", answer_column="extra_info.answer")
    assert dataset["answer"] == ["4", "0"]
    assert dataset["prompt"] == [PLAIN.format("What is 2+2?"), PLAIN.format("What is 0+0?")]
    assert caplog.messages == ["Dropped 1 of 3 rows with an empty question or answer."]
    assert data._field({"extra_info": "not a record"}, "extra_info.question") is None
    assert data._field({"a": {"b": {"c": 0}}}, "a.b.c") == 0


@pytest.mark.parametrize(
    "question_column, answer_column, missing, flag",
    [
        ("extra_info.problem", "extra_info.answer", "extra_info.problem", "--question_column"),
        ("extra_info.question", "extra_info.answer.value", "extra_info.answer.value", "--answer_column"),
        ("id.question", "extra_info.answer", "id.question", "--question_column"),  # `id` holds numbers, not fields
        ("question", "extra_info.answer", "question", "--question_column"),
        ("meta.question", "extra_info.answer", "meta.question", "--question_column"),  # no `meta` at all
        ("extra_info.question", "meta.answer.value", "meta.answer.value", "--answer_column"),
    ],
)
def test_missing_nested_columns_list_the_nested_names(question_column, answer_column, missing, flag):
    with pytest.raises(ValueError) as error:
        load_math_dataset(
            Dataset.from_dict({"id": [1, 2], **NESTED}), question_column=question_column, answer_column=answer_column
        )
    assert str(error.value) == (
        f"Column {missing!r} is not in the dataset Dataset; available columns: "
        f"['id', 'extra_info', 'extra_info.question', 'extra_info.answer']. Set {flag} to the right one."
    )


@pytest.mark.parametrize(
    "questions, shown",
    [([None, 7], "int values, not text (row 1: 7)"), ([["a", "b"]], "list values, not text (row 0: ['a', 'b'])")],
)
def test_a_question_column_that_is_not_text_is_refused(questions, shown):
    """It used to be rendered into the prompt as "7" or "['a', 'b']" and trained on."""
    rows = Dataset.from_dict({"id": questions, "answer": ["1"] * len(questions)})
    with pytest.raises(ValueError) as error:
        load_math_dataset(rows, question_column="id")
    assert str(error.value) == (
        f"Column 'id' of Dataset holds {shown}: set --question_column to the column with the problem statements."
    )


# ------------------------------------------------------------------ rows and answers
def test_rows_without_question_or_answer_are_dropped_with_a_warning(caplog):
    rows = {
        "question": ["a?", "b?", "c?", "", None, "  \n", "g?"],
        "answer": ["1", "", None, "4", "5", "6", "  "],
    }
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.scoring.data"):
        dataset = load_math_dataset(Dataset.from_dict(rows))
    assert dataset["answer"] == ["1"] and dataset["prompt"] == [PLAIN.format("a?")]
    assert caplog.messages == ["Dropped 6 of 7 rows with an empty question or answer."]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.scoring.data"):
        load_math_dataset(Dataset.from_dict({"question": ["x?"], "answer": ["3"]}))
    assert caplog.messages == []  # nothing dropped, nothing said


def test_every_row_blank_is_an_error_naming_both_flags(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text('{"problem": "q?", "solution": ""}\n{"problem": " ", "solution": "2"}')
    with pytest.raises(ValueError) as error:
        load_math_dataset(path, question_column="problem", answer_column="solution")
    assert str(error.value) == (
        f"Every row of '{path}' has an empty 'problem' or 'solution': check --question_column / --answer_column."
    )


def test_gsm8k_answers_keep_the_text_after_the_last_hash_marks(tmp_path):
    """load_math_dataset(gsm8k, answer_column="answer") used to keep the whole solution: every reward was 0."""
    rows = {
        "question": ["Tom has 5 apples and buys 7 more. How many?", "Pens in 3 days at 400 a day?", "A tricky one?"],
        "answer": ["5 + 7 = <<5+7=12>>12\n#### 12", "400 * 3 = 1200\n#### 1,200", "a first #### 3 inside\n#### 7"],
    }
    dataset = load_math_dataset(_write(tmp_path / "gsm8k.jsonl", rows))
    assert dataset["answer"] == ["12", "1200", "7"]


def test_list_and_tuple_answers_are_one_answer_with_components():
    rows = {"question": ["Find all n.", "Find all m.", "Find k."], "answer": [["$3$", "", "$5$"], ["", " "], ["4"]]}
    assert load_math_dataset(Dataset.from_dict(rows))["answer"] == ["3, 5", "4"]  # the all-blank row is dropped
    pairs = {"question": ["Find the pair.", "Find the triple."], "answer": [(1, 2), (7, 0, -1)]}
    assert load_math_dataset(Dataset.from_dict(pairs))["answer"] == ["1, 2", "7, 0, -1"]


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
