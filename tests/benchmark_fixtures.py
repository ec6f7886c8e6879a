"""Invented benchmark fixtures (tests/fixtures/benchmarks/<name>.jsonl, one file per real format), laid out as a
user's `--data-dir` (<name>/test.jsonl) in a temporary folder. The repository keeps them as flat files so that
nothing in it looks like a copy of the real test sets."""

import atexit
import shutil
import tempfile
from pathlib import Path

SOURCE = Path(__file__).parent / "fixtures" / "benchmarks"


def _materialise() -> Path:
    root = Path(tempfile.mkdtemp(prefix="dhpo-benchmark-fixtures-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for source in SOURCE.glob("*.jsonl"):
        (root / source.stem).mkdir()
        shutil.copyfile(source, root / source.stem / "test.jsonl")
    return root


FIXTURES = _materialise()
