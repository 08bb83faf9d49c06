"""What fastppo 0.2 wrote and named keeps working: a run it checkpointed resumes as if never stopped
(exactly, to the rounding of the CPU that made it), and the flat
trainer's module paths still import, each with a DeprecationWarning naming where it went."""

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fastppo.cli import main as fastppo_main
from fastppo.trainer import PPOTrainer, TrainConfig
from fastppo.trainer.moved import MOVED
from fastppo.trainer.update import unit_attention

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "run-0.2.0"
# how the fixture was made, with fastppo 0.2.0: this config, killed during iteration 2 (after checkpoint-2)
FIXTURE = {
    "iterations": 3,
    "save_every": 1,
    "keep_checkpoints": 1,
    "evaluate": False,
    "prompts_per_iteration": 4,
    "samples_per_prompt": 2,
}


def untimed_metrics(run: Path) -> list:
    """Each iteration's metrics, timings aside."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("time", "tokens_per_s"))} for row in rows]


def learned(run: Path) -> tuple:
    """Each iteration's metrics (timings aside) and the final policy's weights."""
    return untimed_metrics(run), load_file(str(run / "policy" / "model.safetensors"))


def test_a_run_checkpointed_by_0_2_resumes_as_if_never_stopped(tmp_path, monkeypatch):
    # both runs attend under the dense mask, as 0.2.0 did (the split attention rounds otherwise)
    monkeypatch.setattr(unit_attention, "adopt", lambda model: False)
    resumed = tmp_path / "resumed"
    shutil.copytree(RUN, resumed)
    assert fastppo_main(["train", "--resume", str(resumed)]) == 0
    PPOTrainer(TrainConfig.from_flat({**FIXTURE, "out": str(tmp_path / "fresh")}).validate()).train()
    (metrics, weights), (fresh_metrics, fresh_weights) = learned(resumed), learned(tmp_path / "fresh")
    assert [row["iteration"] for row in metrics] == [0, 1, 2]
    assert metrics[:2] == untimed_metrics(RUN)[:2], "the fixture's own iterations are kept as they were"
    # the sampler's log-probs, and so their mismatch with the update's, are what changed since 0.2.0
    # (its fused, packed products round differently, within 1e-6): the training is the same
    mismatch, fresh_mismatch = ([row.pop("logprob_mismatch") for row in m] for m in (metrics, fresh_metrics))
    assert max(abs(a - b) for a, b in zip(mismatch, fresh_mismatch)) < 1e-6
    # Bitwise on a CPU that rounds as the one that made the fixture; another (an AVX2 AMD against
    # that AVX-512 Xeon) rounds the fixture's two iterations' products differently, by about 1e-7
    # relative, so the continuation is held to that: the same tokens, the same steps, to rounding
    # (Adam's steps of lr 5e-4 carry the rounding of a near-zero gradient to ~1e-5 in a few weights:
    # each matrix is held to 1e-5 of its norm)
    assert metrics[-1].keys() == fresh_metrics[-1].keys()  # the fixture's rows lack the metrics added since
    for row, fresh in zip(metrics, fresh_metrics):
        assert row == pytest.approx({k: fresh[k] for k in row}, rel=1e-5, abs=1e-7), row["iteration"]
    assert weights.keys() == fresh_weights.keys()
    for k in weights:
        assert (weights[k] - fresh_weights[k]).norm() <= 1e-5 * fresh_weights[k].norm(), k


def forget(old: str) -> None:
    """Import ``old`` afresh next time (as a new process would, warning again)."""
    sys.modules.pop(old, None)
    parent, _, leaf = old.rpartition(".")
    vars(sys.modules[parent]).pop(leaf, None)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_warns_and_forwards_every_name(old):
    forget(old)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to"):
        module = importlib.import_module(old)
    for home in MOVED[old]:
        real = importlib.import_module(home)
        public = [name for name in vars(real) if not name.startswith("_") and name not in ("annotations",)]
        assert public, home
        for name in public:
            assert getattr(module, name) is getattr(real, name), (old, name)


def test_a_name_set_through_an_old_path_is_set_where_the_code_reads_it(monkeypatch):
    from fastppo.trainer.run import lock

    forget("fastppo.trainer.run_lock")
    with pytest.warns(DeprecationWarning):
        from fastppo.trainer import run_lock
    monkeypatch.setattr(run_lock, "LOCK_FILE", "elsewhere.lock")
    assert lock.LOCK_FILE == "elsewhere.lock"


def test_the_summary_of_0_2_is_the_start_summary():
    from fastppo.trainer.run.summaries import start_summary

    forget("fastppo.trainer.summary")
    with pytest.warns(DeprecationWarning):
        from fastppo.trainer.summary import summary
    assert summary is start_summary


def test_a_name_patched_through_a_split_path_is_put_back_when_the_patch_is_undone():
    from fastppo.trainer.prompts import files

    forget("fastppo.trainer.data")
    with pytest.warns(DeprecationWarning):
        from fastppo.trainer import data
    before = files.SUFFIXES
    patch = pytest.MonkeyPatch()
    patch.setattr(data, "SUFFIXES", (".txt",))
    assert files.SUFFIXES == (".txt",)
    patch.undo()
    assert files.SUFFIXES is before


def test_a_module_under_its_old_path_keeps_its_own_spec():
    forget("fastppo.trainer.run_lock")
    with pytest.warns(DeprecationWarning):
        from fastppo.trainer import run_lock
    assert run_lock.__spec__.name == "fastppo.trainer.run.lock"
