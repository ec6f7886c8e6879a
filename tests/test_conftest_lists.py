"""tests/conftest.py's file lists (tiers, the slowest-first order) name test files that exist, each once: a stale
name would silently leave a file in the wrong tier or start it late."""

from pathlib import Path

import conftest
import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("name", ["PURE", "PROCESSES", "SLOWEST"])
def test_each_listed_file_exists_once(name):
    listed = list(getattr(conftest, name))
    assert [module for module in listed if not (TESTS / f"{module}.py").is_file()] == []
    assert len(set(listed)) == len(listed)
    assert not conftest.PURE & conftest.PROCESSES
