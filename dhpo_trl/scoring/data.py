r"""Math training data in the SimpleRL-Zoo format: prompts with a `\boxed{}` instruction, and their ground truths.

`load_math_dataset` reads a Hub dataset id, a local parquet / JSONL / JSON / CSV file or folder, or an in-memory
`datasets.Dataset`, checks it (columns present, not empty, reachable) and returns the two columns that
`DHPOTrainer` and `dhpo_trl.scoring.rewards.math_verify_reward` consume: `prompt` and `answer`. Every problem is raised as
a `ValueError` that names the fix, before the caller loads a model.

Answers go through `dhpo_trl.scoring.golds.normalise_gold` with their question, exactly as the benchmark loader's do, so the
reward reads a gold the way the evaluation does: GSM8K's "... #### 72" keeps the text after the last `####`, a
list (or tuple) is one answer with several components ("1, 2"), `4.5e33` becomes `4.5 \times 10^{33}`, and so on.

The paper's data is `hkust-nlp/SimpleRL-Zoo-Data`, subset (folder) `simplelr_qwen_level3to5`: a `train.parquet`
with top-level columns `question` and `gt_answer` (plus `level`, `subject`, and a pre-rendered Qwen `prompt` that
we do not use: the prompt is rebuilt here for whatever tokenizer is trained).
"""

from __future__ import annotations

import codecs
import logging
import os
from pathlib import Path

import datasets
from datasets import Dataset, DatasetDict, get_dataset_config_names, load_dataset, load_from_disk
from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

from .golds import normalise_gold

logger = logging.getLogger(__name__)

SIMPLERL_SYSTEM_PROMPT = "You are a helpful assistant."
SIMPLERL_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# Column flags of the training script, named in error messages so the fix is one flag away.
QUESTION_FLAG, ANSWER_FLAG, DATASET_FLAG = "--question_column", "--answer_column", "--dataset_name"
_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def format_prompt(question: str, tokenizer=None) -> str | list[dict]:
    """The SimpleRL-Zoo prompt for `question`.

    Chat messages (system + user, rendered by TRL with the tokenizer's chat template) when the tokenizer has a
    chat template, as Qwen3 base tokenizers do; otherwise one plain string with the same three parts and an
    answer cue, for tokenizers without a template.
    """
    user = f"{question.strip()}\n{SIMPLERL_INSTRUCTION}"
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "system", "content": SIMPLERL_SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return f"{SIMPLERL_SYSTEM_PROMPT}\n\n{user}\n\nAnswer:"


def load_math_dataset(
    source,
    *,
    split: str = "train",
    subset: str | None = None,
    question_column: str = "question",
    answer_column: str = "answer",
    tokenizer=None,
) -> Dataset:
    """Load, check and format a math dataset into `prompt` / `answer` columns.

    Args:
        source: Hub dataset id, path to a .parquet/.jsonl/.json/.csv file or a dataset folder, or a
            `datasets.Dataset` / `DatasetDict`.
        split: split to read. A `Dataset` or a single file holds one split: any split but "train" is refused.
        subset: Hub config name, or a sub-folder of the repository (SimpleRL-Zoo-Data keeps its subsets in
            folders such as `simplelr_qwen_level3to5`, which are tried as `data_dir` when no config matches).
        question_column, answer_column: column names; a dotted name (`extra_info.question`) reads a nested field.
        tokenizer: decides the prompt format (see `format_prompt`).
    """
    raw = _load_raw(source, split=split, subset=subset)
    if len(raw) == 0:
        raise ValueError(
            f"The dataset {_describe(source)} (split {split!r}) is empty: point {DATASET_FLAG} at a dataset with "
            "at least one problem, or pick another split with --dataset_train_split."
        )
    for column, flag in ((question_column, QUESTION_FLAG), (answer_column, ANSWER_FLAG)):
        _check_column(raw, column, flag, source)

    questions = [_field(row, question_column) for row in raw]
    _check_text(questions, question_column, source)
    answers = [
        normalise_gold(_field(row, answer_column), question=question if _present(question) else None)
        for row, question in zip(raw, questions)
    ]
    keep = [i for i, (q, a) in enumerate(zip(questions, answers)) if _present(q) and a is not None]
    if not keep:
        raise ValueError(
            f"Every row of {_describe(source)} has an empty {question_column!r} or {answer_column!r}: check "
            f"{QUESTION_FLAG} / {ANSWER_FLAG}."
        )
    if len(keep) < len(raw):
        # SimpleRL-Zoo level3to5 itself ships two problems without a gold answer: they cannot be rewarded.
        logger.warning("Dropped %d of %d rows with an empty question or answer.", len(raw) - len(keep), len(raw))
    return Dataset.from_dict(
        {
            "prompt": [format_prompt(str(questions[i]), tokenizer) for i in keep],
            "answer": [answers[i] for i in keep],
        }
    )


# ------------------------------------------------------------------ loading
def _load_raw(source, *, split: str, subset: str | None) -> Dataset:
    if isinstance(source, DatasetDict):
        _refuse_setting("a DatasetDict", subset=subset)
        if split not in source:
            raise ValueError(
                f"Split {split!r} is not in the DatasetDict (splits: {list(source)}): set --dataset_train_split."
            )
        return source[split]
    if isinstance(source, Dataset):
        _refuse_setting("a Dataset", subset=subset, split=split)
        return source
    if not isinstance(source, (str, os.PathLike)) or not str(source).strip():
        raise ValueError(
            f"{DATASET_FLAG} must be a Hub dataset id, a local file or folder, or a Dataset; got {source!r}."
        )
    path = Path(source).expanduser()
    if path.is_file():
        _refuse_setting(f"the single file {path}", subset=subset, split=split)
        return _load_file(path)
    if path.is_dir():
        return _load_folder(path, split=split, subset=subset)
    if _looks_like_path(str(source)):
        raise ValueError(f"{DATASET_FLAG}={str(source)!r}: no such file or folder.")
    return _load_hub(str(source), split=split, subset=subset)


def _load_file(path: Path) -> Dataset:
    builder = _FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"{DATASET_FLAG}={str(path)!r}: unsupported file type {path.suffix!r}; use one of {sorted(_FILE_BUILDERS)}."
        )
    empty = ValueError(f"The dataset file {path} is empty: point {DATASET_FLAG} at a file with at least one problem.")
    if _file_has_no_rows(path, builder):  # datasets fails on these with an Arrow error, not "empty"
        raise empty
    if builder != "parquet":
        _check_utf8(path, builder)
    try:
        return load_dataset(builder, data_files=str(path), split="train")
    except Exception as error:
        if "corresponds to no data" in str(error):  # a CSV header or a JSON `[]`: read, but no rows
            raise empty from error
        raise ValueError(f"Could not read {path} as {builder}: {error}") from error


def _file_has_no_rows(path: Path, builder: str) -> bool:
    if builder == "parquet":
        import pyarrow.parquet

        try:
            return pyarrow.parquet.ParquetFile(path).metadata.num_rows == 0
        except Exception:  # noqa: BLE001
            return False  # not readable as parquet: let datasets report why
    with open(path, "rb") as handle:
        return not handle.read(1 << 16).strip()


def _check_utf8(path: Path, builder: str) -> None:
    """Refuse a text file that is not UTF-8. datasets' JSON reader loads Latin-1 bytes without a word, and the
    bad string only fails, as a bare UnicodeDecodeError, when its row is read."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"Could not read {path} as {builder}: byte {offset - pending + error.start} is not UTF-8 text; "
                    "re-save the file as UTF-8."
                ) from None
            if not chunk:
                return
            offset += len(chunk)


def _load_folder(path: Path, *, split: str, subset: str | None) -> Dataset:
    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():  # Dataset.save_to_disk output
        try:
            saved = load_from_disk(str(path))
        except IndexError as error:  # datasets cannot load a saved dataset (or split) of zero rows
            raise ValueError(
                f"The saved dataset {path} is empty (or one of its splits is, which datasets cannot load): save it "
                f"again with at least one problem in every split, or point {DATASET_FLAG} at another dataset."
            ) from error
        return _load_raw(saved, split=split, subset=subset)
    return _load_with_subset(str(path), split=split, subset=subset)


def _refuse_setting(what: str, *, subset: str | None, split: str = "train") -> None:
    """A file or an in-memory / saved dataset has no configs, and a file or a Dataset holds one split: a subset or a
    split other than the default would be silently ignored, so it is refused."""
    if subset:
        raise ValueError(f"--dataset_config={subset!r} does not apply to {what}, which has no configs: drop it.")
    if split != "train":
        raise ValueError(
            f"--dataset_train_split={split!r} does not apply to {what}, which holds one split: drop it, or point "
            f"{DATASET_FLAG} at a folder of split files or a DatasetDict."
        )


def _load_hub(dataset_id: str, *, split: str, subset: str | None) -> Dataset:
    try:
        return _load_with_subset(dataset_id, split=split, subset=subset)
    except ValueError:
        raise
    except Exception as error:  # offline, unreachable, unknown or gated repository
        offline = _offline_setting()
        hint = (
            f"{offline} is set: unset it to download, or use a local copy"
            if offline
            else "check the id and your connection (and `hf auth login` for gated data), or use a local copy"
        )
        raise ValueError(
            f"Could not load the Hub dataset {dataset_id!r} (subset {subset!r}, split {split!r}): "
            f"{type(error).__name__}: {error}. {hint}: pass {DATASET_FLAG} /path/to/train.parquet (or .jsonl), "
            f"e.g. after `hf download {dataset_id} --repo-type dataset --local-dir data/`."
        ) from error


def _offline_setting() -> str | None:
    """The variable that puts the Hub in offline mode, as `NAME=value`, read the way huggingface_hub reads it."""
    # huggingface_hub falls back on TRANSFORMERS_OFFLINE only when HF_HUB_OFFLINE is unset or empty;
    # any of "1", "ON", "YES", "TRUE" in any case is true (so HF_HUB_OFFLINE=on is offline too).
    hub = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    for name in (hub, "HF_DATASETS_OFFLINE"):
        value = os.environ.get(name)
        if value is not None and value.upper() in ENV_VARS_TRUE_VALUES:
            return f"{name}={value}"
    return None


def _load_with_subset(path: str, *, split: str, subset: str | None) -> Dataset:
    try:
        return _as_split(load_dataset(path, subset, split=split), split)
    except ValueError as error:
        about_config = "BuilderConfig" in str(error) or "config" in str(error).lower()
        if not about_config:
            raise _split_error(path, split, error, subset) from error
        if subset is None:  # several configs and none picked: datasets' own message spans four lines
            raise _subset_error(path, subset) from error
    # Repositories without configs keep subsets in folders: retry the subset as a data directory.
    try:
        return _as_split(load_dataset(path, data_dir=subset, split=split), split)
    except FileNotFoundError as error:  # no such folder either (datasets' EmptyDatasetError): a mistyped subset
        raise _subset_error(path, subset) from error
    except ValueError as error:
        raise _split_error(path, split, error, subset) from error


def _subset_error(path: str, subset: str | None) -> ValueError:
    what = (
        f"--dataset_config={subset!r} is not a config or a data folder of {path!r}"
        if subset
        else f"{path!r} has several configs and none was picked"
    )
    choices = _subsets(path)
    fix = (
        f"set --dataset_config to one of {choices}"
        if choices
        else "check --dataset_config against its configs and data folders"
    )
    return ValueError(f"{what}: {fix}.")


def _subsets(path: str) -> list[str]:
    """Config names and top-level folders of a local folder or Hub dataset, best effort: only for messages."""
    try:
        configs = [name for name in get_dataset_config_names(path) if name != "default"]
    except Exception:  # noqa: BLE001
        configs = []
    return configs + [name for name in _top_folders(path) if name not in configs]


def _top_folders(path: str) -> list[str]:
    if Path(path).is_dir():
        return sorted(p.name for p in Path(path).iterdir() if p.is_dir() and not p.name.startswith("."))
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFolder

        tree = HfApi().list_repo_tree(path, repo_type="dataset")
        return sorted(entry.path for entry in tree if isinstance(entry, RepoFolder))
    except Exception:  # noqa: BLE001  (offline, gated: the message goes without the list)
        return []


def _as_split(loaded, split: str) -> Dataset:
    if isinstance(loaded, Dataset):
        return loaded
    raise ValueError(f"Expected one split {split!r}, got {type(loaded).__name__}.")


def _split_error(path: str, split: str, error: Exception, subset: str | None = None) -> ValueError:
    where = f"{path!r}" + (f" (subset {subset!r})" if subset else "")
    reason = str(error).rstrip(".")  # datasets' messages end with a full stop of their own
    return ValueError(
        f"Could not load split {split!r} of {where}: {reason}. Check --dataset_train_split and --dataset_config."
    )


# ------------------------------------------------------------------ checks and fields
def _check_column(raw: Dataset, column: str, flag: str, source) -> None:
    top, *nested = column.split(".")
    features = raw.features
    ok = top in features
    for key in nested:
        features = features[top] if ok else None
        ok = isinstance(features, (dict, datasets.Features)) and key in features
        top = key
    if not ok:
        raise ValueError(
            f"Column {column!r} is not in the dataset {_describe(source)}; available columns: "
            f"{_column_names(raw.features)}. Set {flag} to the right one."
        )


def _check_text(questions: list, column: str, source) -> None:
    # A number or a list would be rendered as "42" or "['a', 'b']" in the prompt: a wrong column, not a problem.
    for row, question in enumerate(questions):
        if question is not None and not isinstance(question, str):
            raise ValueError(
                f"Column {column!r} of {_describe(source)} holds {type(question).__name__} values, not text "
                f"(row {row}: {question!r}): set {QUESTION_FLAG} to the column with the problem statements."
            )


def _column_names(features, prefix: str = "") -> list[str]:
    names = []
    for name, feature in features.items():
        names.append(prefix + name)
        if isinstance(feature, (dict, datasets.Features)):
            names.extend(_column_names(feature, prefix + name + "."))
    return names


def _field(row: dict, column: str):
    value = row
    for key in column.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _present(question: str | None) -> bool:
    return question is not None and bool(question.strip())


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or Path(source).suffix.lower() in _FILE_BUILDERS


def _describe(source) -> str:
    return repr(str(source)) if isinstance(source, (str, os.PathLike)) else type(source).__name__
