"""Under DeepSpeed ZeRO-3 every forward gathers the parameters from every rank, so both ranks must run the same
number of forwards in every pass, the no-gradient passes over the generation batch (pi_old's log-probs) included.

DeepSpeed keeps parameters smaller than `stage3_param_persistence_threshold` (1e5 elements by default) resident,
which is every parameter of the tests' tiny models: a forward gathers nothing there, and a rank running a forward
more than the other goes unnoticed. `tests/dist_scripts/zero3_gathered_forwards.py` sets the threshold to 0 (and
small buckets), gives rank 0 long completions and rank 1 short ones under a token budget, and counts each rank's
forwards; a pass whose count is not agreed blocks a rank in a collective, which the launch's timeout stops (its
whole process tree is killed).
"""

import json
from pathlib import Path

import processes
import pytest

SCRIPT = Path(__file__).parent / "dist_scripts" / "zero3_gathered_forwards.py"
PATHS = ["packed", "dynamic", "shared"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch, one run per path (a blocked rank fails its collective after 60 s; the launch is killed at 400)."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("zero3_forwards")
    result = processes.forked_ranks(SCRIPT, out, *PATHS, timeout=400, accelerate_cpu=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.mark.parametrize("path", PATHS)
def test_two_processes_gather_in_every_forward_and_agree_on_every_pass(launched, path):
    ranks = [json.loads((launched / path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for seen in ranks:
        assert seen["path"] == path
        # nothing resident: every forward gathered its parameters, so the counts below had to match
        assert seen["persistent"] == 0 and seen["resident"] == 0 and seen["parameters"] > 0
        assert seen["gloo_threads_left"] == []  # the release found the engines and groups the runs built
    own0, own1 = ranks[0]["own_needed"], ranks[1]["own_needed"]
    assert len(own0) == len(own1) >= 1  # one no-gradient pass per generation batch
    assert any(a != b for a, b in zip(own0, own1))  # the ranks' own counts differ: the agreement acts
    agreed = sum(max(a, b) for a, b in zip(own0, own1, strict=True))
    assert ranks[0]["forwards"]["no_grad"] == ranks[1]["forwards"]["no_grad"] == agreed
    assert ranks[0]["forwards"]["policy"] == ranks[1]["forwards"]["policy"]
    assert ranks[0]["forwards"]["policy"] > 2 * 2  # the budget split micro-steps: more than one pass each
    assert ranks[0]["norm"] == pytest.approx(ranks[1]["norm"], rel=1e-6)
