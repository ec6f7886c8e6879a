"""`dhpo_trl.training.trl_mirror`: the installed TRL still holds every mirrored block at the listed lines, and TRL's tail
corrections apply in TRL's order."""

import functools
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

from dhpo_trl.training import trl_mirror


def trl_lines():
    origin = Path(importlib.util.find_spec("trl").origin).parent.parent
    return (origin / trl_mirror.TRL_FILE).read_text().splitlines()


@pytest.mark.parametrize("mirror", trl_mirror.MIRRORED, ids=lambda m: m.ours)
def test_every_mirrored_trl_block_is_where_the_list_says(mirror):
    """A TRL upgrade that moves or changes a mirrored block fails here: review that block, then update the list."""
    lines = trl_lines()
    first, last = mirror.lines
    assert 1 <= first <= last <= len(lines)
    assert lines[first - 1].strip() == mirror.first
    assert lines[last - 1].strip() == mirror.last
    assert f"def {mirror.trl}(" in "\n".join(lines[:first])  # the block lies after TRL's method starts


def resolve(owner: str):
    module, _, qualname = owner.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


@functools.cache
def file_lines(path: Path) -> list[str]:  # many names per file: each file read once
    return path.read_text().splitlines()


@functools.cache
def source_lines(owner) -> tuple[list[str], int]:  # inspect parses the whole module for a class: once per owner
    return inspect.getsourcelines(owner)


@pytest.mark.parametrize("private", trl_mirror.PRIVATE, ids=lambda p: f"{p.owner.split(':')[-1]}.{p.name}")
def test_every_private_name_still_exists_where_the_list_says(private):
    """A TRL / transformers upgrade that renames, moves or drops a private name dhpo-trl uses fails here."""
    owner = resolve(private.owner)
    site = Path(importlib.util.find_spec(private.owner.split(".")[0]).origin).parent.parent
    lines = file_lines(site / private.file)
    first, last = private.lines
    assert 1 <= first <= last <= len(lines)
    assert re.search(rf"\b{private.name}\b", "\n".join(lines[first - 1 : last])), (private.file, private.lines)
    if inspect.ismodule(owner):
        assert hasattr(owner, private.name)
        return
    source, start = source_lines(owner)
    assert Path(inspect.getsourcefile(owner)).resolve() == (site / private.file).resolve()
    inside = start <= first <= last < start + len(source)  # defined (or assigned) within the owner's source
    assert inside or (inspect.isclass(owner) and hasattr(owner, private.name))


# Our own private attributes and methods on the trainer (not TRL's).
OURS = {"_update", "_routing", "_stop_callback", "_warned_on_policy", "_epoch_sampler", "_gradient_check",
        "_last_run", "_making_optimizer"}


@pytest.mark.parametrize("module", ["trainer", "resume"])
def test_every_private_trainer_name_we_use_is_listed(module):
    """A new use of a private TRL / transformers trainer attribute must be added to `trl_mirror.PRIVATE`."""
    path = Path(importlib.util.find_spec(f"dhpo_trl.training.{module}").origin)
    text = path.read_text()
    used = set(re.findall(r"\b(?:self|trainer)\.(_[a-z]\w*)", text))
    ours = set(re.findall(r"def (_[a-z]\w*)\(", text)) | OURS
    listed = {private.name for private in trl_mirror.PRIVATE}
    assert used - ours - listed == set()


def test_corrections_multiply_in_trl_order_then_add_the_kl():
    loss = torch.tensor([[2.0, 3.0]])
    out = trl_mirror.apply_corrections(
        loss, off_policy_mask=torch.tensor([[1.0, 0.0]]), entropy_mask=torch.tensor([[0.5, 1.0]]),
        importance_sampling_ratio=torch.tensor([[3.0, 3.0]]), beta=0.1, kl=torch.tensor([[10.0, 20.0]]),
    )  # fmt: skip
    assert out[0].tolist() == pytest.approx([2.0 * 0.5 * 3.0 + 1.0, 0.0 + 2.0])
    assert trl_mirror.apply_corrections(loss).tolist() == [[2.0, 3.0]]  # nothing given: unchanged


def test_per_token_kl_is_k3_and_zero_on_padding():
    ref = torch.tensor([[0.0, float("nan")]])  # padding holds no reference log-prob
    logps = torch.tensor([[-1.0, -5.0]])
    mask = torch.tensor([[1.0, 0.0]])
    kl = trl_mirror.per_token_kl(ref, logps, mask)
    assert kl[0].tolist() == pytest.approx([torch.e - 1.0 - 1.0, 0.0])
    weighted = trl_mirror.per_token_kl(ref, logps, mask, weight=torch.tensor([[2.0, 2.0]]))
    assert weighted[0].tolist() == pytest.approx([2 * (torch.e - 2.0), 0.0])
