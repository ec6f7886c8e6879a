"""The `dhpo/` and `gmpo/` metrics, `entropy` and `kl` reduced over 2 processes (forked ranks with torchrun's
environment, gloo) equal the hand computation on the whole batch, also when one process holds only padding.

tests/dist_scripts/metrics_distributed.py gives each rank a slice of tests/metric_batch.py's batch.
"""

import json
from pathlib import Path

import processes
import pytest
from metric_batch import CLIP_EXPECTED, build_policy, expected_metrics, full_batch_entropies

from dhpo_trl.demo.tiny import build_char_tokenizer

SCRIPT = Path(__file__).parent / "dist_scripts" / "metrics_distributed.py"
EXPECTATIONS = {"dhpo_split": {}, "dhpo_padding_rank": {}, "gmpo_split": {"algorithm": "gmpo"}}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out = tmp_path_factory.mktemp("metrics_two_ranks")
    result = processes.forked_ranks(SCRIPT, out, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"metrics_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def entropies():
    return full_batch_entropies(build_policy(build_char_tokenizer()))


@pytest.mark.parametrize("scenario", list(EXPECTATIONS))
def test_metrics_of_the_whole_batch_on_every_rank(dumps, entropies, scenario):
    expected = expected_metrics(entropies, **EXPECTATIONS[scenario])
    prefix = "gmpo/" if "algorithm" in EXPECTATIONS[scenario] else "dhpo/"
    for rank, dump in enumerate(dumps):
        logged = dump[scenario]
        assert {k for k in logged if k.startswith(prefix)} == {k for k in expected if k.startswith(prefix)}, rank
        for key, value in expected.items():
            assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rank, key)


def test_trl_clip_metrics_of_both_ranks_on_every_rank(dumps):
    """Means from summed counts, and the per-sequence extremes from both ranks: rank 1 alone would log a lowest
    share of 1/2 and a highest of 1/4."""
    for rank, dump in enumerate(dumps):
        assert dump["trl_clip"] == pytest.approx(CLIP_EXPECTED, rel=1e-6), rank
