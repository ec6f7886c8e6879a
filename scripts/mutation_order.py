"""pytest plugin used by scripts/mutation.sh: run each mutant's tests cheapest first, so that it dies early.

mutmut runs the tests of a mutant with `-x` (stop at the first failure) in an arbitrary order. Ordering them by
the durations mutmut measured in its stats run (mutants/mutmut-stats.json) lets a killed mutant fail on its fastest
test instead of after a slow one. Tests stay grouped by file, so module-scoped fixtures are built once.
"""

import json
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
