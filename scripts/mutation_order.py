"""pytest plugin used by scripts/mutation.sh: run each mutant's tests cheapest first, so that it dies early.

mutmut runs the tests of a mutant with `-x` (stop at the first failure) in an arbitrary order. Ordering them by
the durations mutmut measured in its stats run (mutants/mutmut-stats.json) lets a killed mutant fail on its fastest
test instead of after a slow one. Tests stay grouped by file, so module-scoped fixtures are built once.

It also empties every `functools` cache of `dhpo_trl` when a mutant's test session starts. mutmut forks each mutant's
process from the one that ran the clean tests, so without this the gold parsing (`gold_form`, `_gold_text`) would
answer from results the unmutated code cached, and its mutants would survive untested.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path


def pytest_collection_modifyitems(config, items):
    stats = Path(config.rootpath) / "mutmut-stats.json"
    if not stats.is_file():  # the stats run itself, or a plain pytest run
        return
    durations = json.loads(stats.read_text()).get("duration_by_test", {})
    per_file = defaultdict(float)
    for item in items:
        per_file[item.path] += durations.get(item.nodeid, 0.0)
    items.sort(key=lambda item: (per_file[item.path], str(item.path), durations.get(item.nodeid, 0.0)))


def pytest_sessionstart(session):
    for name, module in list(sys.modules.items()):
        if name == "dhpo_trl" or name.startswith("dhpo_trl."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()
