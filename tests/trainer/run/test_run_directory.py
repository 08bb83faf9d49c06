"""A run directory loses nothing: resume writes where it is told, one run per directory, damaged or
half-written files are survived, and nothing a kill leaves behind stays."""

import hashlib
import json
import shutil

import pytest

from fastppo.cli import main as fastppo_main
from fastppo.errors import UsageError
from fastppo.trainer import PPOTrainer
from fastppo.trainer.run.checkpoint import WORLD_FILE
from fastppo.trainer.run.directory import MANIFEST_FILE, clear_leftovers, save_atomically
from fastppo.trainer.run.lock import LOCK_FILE
from fastppo.trainer.update.optimizers import lr_factor
from tests.trainer.runs import untrained


def digest(directory):
    """sha256 of every file under ``directory``, by relative path; the lock a live trainer holds aside."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


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
    assert PPOTrainer.resume(finished_run, {"out": str(finished_run), "iterations": 3})[1] == 2  # naming it is fine


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
    data[len(data) // 2 : len(data) // 2 + 4000] = bytes(4000)  # same size, 4000 bytes overwritten
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"skipping .*checkpoint-2.*does not match its sha256"):
        _, start = PPOTrainer.resume(finished_run, {"iterations": 3})
    assert start == 1
    (finished_run / "checkpoint-1" / MANIFEST_FILE).unlink()
    with pytest.warns(UserWarning), pytest.raises(UsageError, match="no complete checkpoint"):
        PPOTrainer.resume(finished_run, {"iterations": 3})


@pytest.mark.parametrize("edit", ["emptied", "the weights' line removed", "the state's line removed"])
def test_a_manifest_that_no_longer_lists_every_file_fails(finished_run, edit):
    """Corrupted weights behind an edited manifest are skipped like corrupted weights alone."""
    checkpoint = finished_run / "checkpoint-2"
    weights = checkpoint / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4000] = bytes(4000)
    weights.write_bytes(bytes(data))
    manifest = checkpoint / MANIFEST_FILE
    dropped = {
        "emptied": "",
        "the weights' line removed": "model.safetensors",
        "the state's line removed": "trainer_state.pt",
    }[edit]
    manifest.write_text(
        "".join(line + "\n" for line in manifest.read_text().splitlines() if dropped and not line.endswith(dropped))
    )
    if edit == "the state's line removed":
        (checkpoint / "trainer_state.pt").unlink()
    with pytest.warns(UserWarning, match=rf"skipping .*checkpoint-2.*{MANIFEST_FILE} does not list"):
        _, start = PPOTrainer.resume(finished_run, {"iterations": 3})
    assert start == 1


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


@pytest.mark.parametrize("iterations", [1, 2])
def test_resume_with_nothing_left_to_train_is_refused(finished_run, iterations, capsys):
    config = (finished_run / "config.json").read_text()
    assert fastppo_main(["train", "--resume", str(finished_run), "--iterations", str(iterations)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has trained 2 iterations (checkpoint-2); give --iterations above 2" in err
    assert (finished_run / "config.json").read_text() == config  # nothing rewritten


def test_a_world_file_that_does_not_parse_is_a_damaged_checkpoint(finished_run):
    """Checked after the manifest, so the checkpoint is skipped for the previous one, not a crash."""
    (finished_run / "checkpoint-2" / WORLD_FILE).write_text("{not json")
    with pytest.warns(UserWarning, match=r"skipping .*checkpoint-2"):
        assert PPOTrainer.resume(finished_run, {"iterations": 3})[1] == 1


def test_the_world_size_is_checked_before_any_model_is_built(finished_run, monkeypatch):
    from fastppo.trainer import build
    from fastppo.trainer.run import checkpoint

    def never_built(*args, **kwargs):
        raise AssertionError("the models were built before the world size was checked")

    monkeypatch.setattr(checkpoint, "world_size", lambda: 2)
    monkeypatch.setattr(build, "load_policy", never_built)
    with pytest.raises(checkpoint.WorldSizeMismatch, match=r"written by 1 rank\(s\); resume with as many, not 2"):
        PPOTrainer.resume(finished_run, {"iterations": 3})


@pytest.mark.parametrize("damage", ["config.json a list", "metrics.jsonl a directory"])
def test_a_damaged_run_directory_is_a_one_line_error(finished_run, damage, capsys):
    if damage == "config.json a list":
        (finished_run / "config.json").write_text("[1, 2]")
    else:
        (finished_run / "metrics.jsonl").unlink()
        (finished_run / "metrics.jsonl").mkdir()
    assert fastppo_main(["train", "--resume", str(finished_run), "--iterations", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and {
            "config.json a list": "config.json holds a list",
            "metrics.jsonl a directory": "metrics.jsonl is not a file",
        }[damage]
        in err
    )


def test_a_checkpoint_name_on_a_file_is_reported(finished_run):
    (finished_run / "checkpoint-7").write_text("not a checkpoint")
    with pytest.warns(UserWarning, match=r"checkpoint-7 is not a directory; it is no checkpoint"):
        assert PPOTrainer.resume(finished_run, {"iterations": 3})[1] == 2


def test_extending_a_finished_cosine_run_continues_the_stretched_schedule(tmp_path):
    """A 2-iteration cosine run ends at learning rate 0; resumed to 4 iterations, its iteration 2
    runs at the 4-iteration schedule's rate, as a 4-iteration run does."""
    run = untrained(tmp_path, iterations=2, save_every=1, lr_schedule="cosine", evaluate=False)
    run.train()
    trainer, start = PPOTrainer.resume(tmp_path / "run", {"iterations": 4})
    trainer.train(start)
    rates = {row["iteration"]: row["lr"] for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())}
    lr = trainer.config.optim.lr
    assert rates[2] == pytest.approx(lr * lr_factor(2, trainer.config.optim, trainer.config.run.iterations)) and rates[
        2
    ] == pytest.approx(lr * 0.5)
    assert rates[3] == pytest.approx(lr * lr_factor(3, trainer.config.optim, trainer.config.run.iterations))


def test_a_resume_drops_the_metrics_rows_of_the_iterations_it_repeats(tmp_path):
    from fastppo.trainer.run.directory import metrics_before

    rows = tmp_path / "metrics.jsonl"
    rows.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(5)))
    assert [json.loads(line)["iteration"] for line in metrics_before(rows, 3)] == [0, 1, 2]


@pytest.mark.parametrize(
    "change", [{"rollout_batch_size": 8}, {"rollout_kv_memory": 0.5}, {"tool_schedule": "eager"}, {"tool_window": 4}]
)
def test_a_changed_sampler_memory_or_tool_schedule_resumes_saying_it_is_not_exact(finished_run, change):
    with pytest.warns(UserWarning, match="samples other tokens than the uninterrupted run would"):
        PPOTrainer.resume(finished_run, {"iterations": 3, **change})


def test_a_checkpoint_keeps_the_epoch_cursor(tmp_path):
    """The prompts drawn so far, not iterations x prompts (dynamic sampling draws more)."""
    trainer = untrained(tmp_path, iterations=1, save_every=1, evaluate=False)
    trainer.train()
    trainer.state.prompts_drawn = 37  # as after batches dynamic sampling drew and left out
    trainer.checkpoint(tmp_path / "run", 1)
    resumed, start = PPOTrainer.resume(tmp_path / "run", {"iterations": 2})
    assert start == 1 and resumed.state.prompts_drawn == 37


def test_a_run_saves_by_the_clock_by_default(tmp_path, monkeypatch):
    """Without --save-every a run still saves every --save-every-minutes (30 by default): here the
    clock moves 20 minutes an iteration, so iterations 2 and 4 of 5 save, and the last."""
    from fastppo.trainer import ppo

    assert untrained(tmp_path, iterations=1).config.run.save_every_minutes == 30
    minutes = iter(range(0, 1000, 20))
    monkeypatch.setattr(ppo.time, "monotonic", lambda: 60.0 * next(minutes))
    untrained(tmp_path, iterations=5, keep_checkpoints=0, evaluate=False, overwrite=True).train()
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
