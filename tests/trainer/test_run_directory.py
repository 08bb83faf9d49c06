"""A run directory loses nothing: resume writes where it is told, one run per directory, damaged or
half-written files are survived, and nothing a kill leaves behind stays."""

import hashlib
import json
import shutil

import pytest

from fastppo.cli import main as fastppo_main
from fastppo.trainer import PPOTrainer
from fastppo.trainer.checkpoint import MANIFEST_FILE, clear_leftovers, save_atomically
from fastppo.trainer.errors import UsageError
from tests.trainer.test_trainer import untrained


def digest(directory):
    """sha256 of every file under ``directory``, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def iterations(run):
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def finished_run(tmp_path):
    """A 2-iteration run with a checkpoint after each iteration: ``tmp_path / "run"``."""
    untrained(tmp_path, iterations=2, save_every=1, keep_checkpoints=0).train()
    return tmp_path / "run"


def test_resuming_a_copy_writes_into_the_copy_and_never_the_original(finished_run, tmp_path):
    before = digest(finished_run)
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    trainer, start = PPOTrainer.resume(copy, {"iterations": 3})
    assert trainer.config.run.out == str(copy) and start == 2
    trainer.train(start)
    assert digest(finished_run) == before  # the original run is untouched
    assert iterations(copy) == [0, 1, 2]
    assert (copy / "checkpoint-3").is_dir()


def test_resuming_a_moved_run(finished_run, tmp_path):
    moved = tmp_path / "moved"
    finished_run.rename(moved)
    trainer, start = PPOTrainer.resume(moved, {"iterations": 3})
    trainer.train(start)
    assert not finished_run.exists()  # no stray config.json where the run used to be
    assert iterations(moved) == [0, 1, 2]


def test_resume_refuses_another_out_and_overwrite(finished_run, tmp_path):
    with pytest.raises(UsageError, match=r"writes into .*run; drop --out"):
        PPOTrainer.resume(finished_run, {"out": str(tmp_path / "elsewhere")})
    with pytest.raises(UsageError, match="give one of them"):
        PPOTrainer.resume(finished_run, {"overwrite": True})
    assert PPOTrainer.resume(finished_run, {"out": str(finished_run)})[1] == 2  # naming it is fine


def test_a_new_run_refuses_a_non_empty_directory_unless_told_to_clear_it(finished_run, tmp_path):
    before = digest(finished_run)
    with pytest.raises(UsageError, match="is not empty; continue that run with --resume"):
        untrained(tmp_path, iterations=1)
    assert digest(finished_run) == before
    fresh = untrained(tmp_path, iterations=1, overwrite=True)
    assert digest(finished_run) == before  # cleared only once the new run starts
    fresh.train()
    assert iterations(finished_run) == [0]
    assert sorted(p.name for p in finished_run.glob("checkpoint-*")) == ["checkpoint-1"]  # the old run's are gone
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("years of work")
    with pytest.raises(UsageError, match="not a fastppo run directory"):
        untrained(tmp_path, iterations=1, out=str(tmp_path / "notes"), overwrite=True)
    assert (tmp_path / "notes" / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("damage", ["partial last line", "deleted", "garbage line"])
def test_resume_survives_a_damaged_metrics_file(finished_run, damage):
    metrics = finished_run / "metrics.jsonl"
    if damage == "deleted":
        metrics.unlink()
    elif damage == "partial last line":
        metrics.write_text(metrics.read_text() + '{"iteration": 2, "reward_me')
    else:
        lines = metrics.read_text().splitlines()
        metrics.write_text(lines[0] + "\n\x00\x00\x00\n" + lines[1] + "\n")
    with pytest.warns(UserWarning, match="missing|dropping a line"):
        trainer, start = PPOTrainer.resume(finished_run, {"iterations": 3})
        trainer.train(start)
    assert iterations(finished_run) == ([2] if damage == "deleted" else [0, 1, 2])


def test_leftovers_of_a_killed_save_are_cleared_or_put_back(finished_run, tmp_path):
    tmp = finished_run / ".checkpoint-3.tmp-99999"
    (tmp / "policy").mkdir(parents=True)
    (finished_run / ".config.json.tmp-99999").write_text("{")
    policy = finished_run / "policy"
    policy.rename(finished_run / ".policy.old-99999")  # killed between the two renames of a replacement
    PPOTrainer.resume(finished_run, {"iterations": 3})  # at start
    assert not tmp.exists() and not (finished_run / ".config.json.tmp-99999").exists()
    assert (policy / "model.safetensors").is_file() and not (finished_run / ".policy.old-99999").exists()

    (finished_run / ".checkpoint-7.tmp-4242").mkdir()
    save_atomically(finished_run / "checkpoint-9", lambda d: (d / "x").write_text("x"))  # at every save
    assert not (finished_run / ".checkpoint-7.tmp-4242").exists()
    assert (finished_run / "checkpoint-9" / MANIFEST_FILE).read_text().endswith("  x\n")
    clear_leftovers(tmp_path / "nothing here")  # a run directory that does not exist yet is fine


def test_a_checkpoint_whose_bytes_changed_is_skipped_for_the_previous_one(finished_run):
    weights = finished_run / "checkpoint-2" / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4000] = bytes(4000)  # same size, 4000 bytes overwritten
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"skipping .*checkpoint-2.*does not match its sha256"):
        _, start = PPOTrainer.resume(finished_run, {"iterations": 3})
    assert start == 1
    (finished_run / "checkpoint-1" / MANIFEST_FILE).unlink()
    with pytest.warns(UserWarning), pytest.raises(UsageError, match="no complete checkpoint"):
        PPOTrainer.resume(finished_run, {"iterations": 3})


def test_resume_applies_the_config_file_with_the_rule_of_the_options(finished_run, tmp_path, capsys):
    changed = tmp_path / "change.toml"
    changed.write_text("lr = 0.5\n")
    assert fastppo_main(["train", "--resume", str(finished_run), "--config", str(changed)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastppo train: error: cannot resume") and "changed lr" in err and err.count("\n") == 1
    longer = tmp_path / "longer.toml"
    longer.write_text("iterations = 3\n")
    assert fastppo_main(["train", "--resume", str(finished_run), "--config", str(longer)]) == 0
    assert iterations(finished_run) == [0, 1, 2]
