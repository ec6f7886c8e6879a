"""What the command-line tools report as the user's mistake, and what they leave to a traceback.

A user error is an exception of `USER_ERROR_TYPES` raised while a command reads its input, before its work starts:
the arguments and config files, the data, the model and tokenizer, an optional package, the vLLM server. It is
printed as one `<prog>: error: <message>` line on stderr with exit status 2, as argparse does. Whatever is raised
during the work itself (training, sampling, plotting) and any other exception type (KeyError, TypeError,
RuntimeError...) is a bug, or a failure that needs its whole stack: it keeps its traceback. `--debug` prints the whole
traceback of every error a command reports on one line (`report`), with the same exit status, so that a script
reading the status sees no difference and `dhpo-train` still releases its process groups before it exits. A usage
error stays argparse's one line after the usage, with exit status 2, under `--debug` too: argparse's own (an unknown
option, a value of the wrong type or outside the choices, a missing argument) and `UsageError` (the same mistakes
found past argparse). Its line names the option already, and its traceback would show the parser's frames only.

Each command splits itself in two for `run_command`: `setup` (parse, validate, load) and `work`.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

USER_ERROR_TYPES = (
    ValueError,  # our checks and the libraries' on values: config fields, data columns, Hub ids
    OSError,  # files and folders that are missing or unreadable, models not found, ConnectionError (vLLM, Hub)
    ImportError,  # an optional package that is not installed (vllm, deepspeed), named with its install command
)
DEBUG_FLAG = "--debug"
DEBUG_HELP = (
    "show the Python traceback of an error instead of its one-line message (a usage error, such as an unknown option "
    "or a value of the wrong type, stays one line: its traceback would show the parser only)"
)


class UsageError(ValueError):
    """A mistake in the command line itself that a command finds past argparse (`dhpo-train`'s unknown flags, read
    after its config files): one line with exit status 2, as argparse's own usage errors, with or without `--debug`."""


def run_command(prog: str, setup: Callable[[], object], work: Callable[[object], object] | None = None, *,
                debug: bool = False) -> int:  # fmt: skip
    """`work(setup())`; a `USER_ERROR_TYPES` exception from `setup` is reported (`report`) and returns 2."""
    try:
        prepared = setup()
    except USER_ERROR_TYPES as error:
        report(prog, error, debug=debug)
        return 2
    if work is not None:
        work(prepared)
    return 0


def report(prog: str, error: BaseException, *, debug: bool = False) -> None:
    """`prog: error: <one line>` on stderr; with `debug`, the error's traceback instead, as the interpreter prints it,
    except for a `UsageError`."""
    if debug and not isinstance(error, UsageError):
        traceback.print_exception(error, file=sys.stderr)
    else:
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    sys.stderr.flush()  # before a distributed run's teardown, which may block


def one_line(error: BaseException) -> str:
    """The exception's message on one line (library messages often span several)."""
    text = " ".join(str(error).split())
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"  # "[Errno 2] No such file or directory: 'x'" reads worse
    return text or type(error).__name__


def debug_given(argv: list[str]) -> bool:
    """Whether an argparse parser that has `--debug` (a flag, with argparse's default `allow_abbrev`) reads it in
    `argv`: the flag itself or a prefix of it such as `--deb`, before a `--`. A prefix the parser finds ambiguous is
    its usage error, raised before anything reads this."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return any(len(arg) > 2 and DEBUG_FLAG.startswith(arg) for arg in options)


def pop_debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """Remove a bare `--debug` from `argv`. `--debug VALUE` is left alone: it is transformers' own `debug` option."""
    argv, debug = list(argv), False
    index = 0
    while index < len(argv):
        bare = argv[index] == DEBUG_FLAG and (index + 1 == len(argv) or argv[index + 1].startswith("-"))
        if bare:
            del argv[index]
            debug = True
        else:
            index += 1
    return argv, debug


def positive_int(text: str) -> int:
    """argparse `type=` for counts: a bad value is argparse's own one-line error, naming the flag."""
    if not text.strip().isdecimal() or int(text) < 1:  # isdecimal: "²" is a digit that int() refuses
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


SEED_MAX = 2**32 - 1  # numpy's legacy seeding, which accelerate's `set_seed` (TRL's trainer) and vLLM call


def seed_int(text: str) -> int:
    """argparse `type=` for seeds: a whole number numpy can seed with, else argparse's one-line error."""
    if not text.strip().isdecimal() or int(text) > SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 2**32 - 1, got {text!r}")
    return int(text)


def repeated_values(args: argparse.Namespace, *names: str) -> str | None:
    """The one-line error for the first list option among `names` that holds a value twice, else None (an option
    left at None holds nothing): a study's repeated seed or objective would run one cell twice into the same folder
    and count it twice in the averages."""
    for name in names:
        values = getattr(args, name) or []
        twice = sorted({value for value in values if values.count(value) > 1}, key=values.index)
        if twice:
            listed = " ".join(map(str, twice))
            return f"--{name.replace('_', '-')}: {listed} given more than once; give each value once"
    return None


def make_folder(path, flag: str) -> None:
    """Create `path` now, so that a file in the way or a missing permission is an input error, not a late crash."""
    try:
        Path(path).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag}: cannot create the folder {path} ({one_line(error)}).") from error


# Used with fullmatch ("$" would accept a trailing "\n"); ASCII, as the Hub's own check (\w would take "ä").
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", re.ASCII)


def check_model_path(model: str, *, label: str = "Model path") -> str:
    """`"local"` for a model folder (config.json, or a PEFT adapter's adapter_config.json), `"hub"` for a Hub id.

    Anything meant as a local path that does not exist is a ValueError naming it, before the Hub client would
    answer with "Repo id must use alphanumeric chars".
    """
    path = Path(model).expanduser()
    if path.exists():
        if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
            raise ValueError(
                f"{label} {path} has no config.json: pass a saved model or checkpoint directory, or a Hub model id."
            )
        return "local"
    if model != model.strip():  # "Qwen/Qwen3\n" from a config file or a shell variable
        raise ValueError(f"{label} {model!r} has leading or trailing whitespace: pass {model.strip()!r}.")
    # A Hub id is "name" or "org/name" starting with a letter or digit, so "./x", "/x", "~/x" and "a/b/c" are refused
    # by the pattern; "outputs/run1" fits it but names a folder that exists: a local path with a typo.
    parts = Path(model).parts
    meant_local = len(parts) > 1 and Path(parts[0]).is_dir()
    if meant_local or not _HUB_ID.fullmatch(model):
        raise ValueError(f"{label} {model} does not exist. Pass an existing directory or a Hub model id.")
    return "hub"
