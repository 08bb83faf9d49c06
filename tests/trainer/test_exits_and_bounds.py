"""How a run ends when something it was given fails or is absurd: a reward that raises or calls
``sys.exit`` is one line and exit 1, never exit 0 with nothing trained; numbers past any sane
bound are one line and exit 2, never a traceback; a step that makes the weights non-finite ends
the run naming it, and nothing from it is saved; a lock file the run cannot use is one line."""

import errno
import json
import os
import sys

import pytest
import torch

from fastppo.errors import TrainingFailed, UsageError
from fastppo.trainer import PPOTrainer
from fastppo.trainer.run.lock import LOCK_FILE, RunLock
from tests.trainer.runs import config
from tests.trainer.test_hostile_input import TINY, one_line_error


def failed_line(capsys, argv) -> str:
    """The line of ``fastppo train argv``, which must exit 1 with one line and no traceback."""
    return one_line_error(capsys, argv, exit_code=1, says="failed")


@pytest.mark.parametrize(
    "body,said",
    [
        ("import sys; sys.exit(0)", "raised SystemExit: 0"),
        ("raise SystemExit('quota used up')", "raised SystemExit: quota used up"),
        ("raise ConnectionError('reward server went away')", "raised ConnectionError: reward server went away"),
    ],
)
def test_a_reward_that_fails_or_exits_ends_the_run_as_a_failure(tmp_path, monkeypatch, capsys, body, said):
    (tmp_path / "exiting_reward.py").write_text(f"def score(prompts, completions, **_):\n    {body}\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "exiting_reward", raising=False)
    argv = ["--prompts", str(tmp_path / "p.jsonl"), "--reward", "exiting_reward:score", "--out", str(tmp_path / "r")]
    assert f"reward function score {said}" in failed_line(capsys, [*argv, *TINY])


def test_a_reward_past_floats_range_is_refused_as_out_of_it(tmp_path):
    trainer = PPOTrainer(config(tmp_path, save=False), reward_fn=lambda p, c, **_: [10**400] * len(c))
    with pytest.raises(
        UsageError, match="returned an integer of 401 digits for completion 0: it is out of float range"
    ):
        trainer.rollout(0)


@pytest.mark.parametrize(
    "option,value,said",
    [
        ("--lr", "1e308", "config field lr must be in (0, 1]"),
        ("--lr", "2", "config field lr must be in (0, 1]"),
        ("--critic-lr", "1e30", "config field critic_lr must be in (0, 1]"),
        ("--clip-eps", "1e308", "config field clip_eps must be in (0, 1)"),
        ("--clip-eps", "1", "config field clip_eps must be in (0, 1)"),
        ("--kl-coef", "1e39", "config field kl_coef must be within float32's range"),
        ("--prompts-per-iteration", str(2**70), "config field prompts_per_iteration must be < 2**32"),
        ("--lora-rank", str(2**70), "config field lora_rank must be < 2**32"),
        ("--rollout-batch-size", str(2**70), "config field rollout_batch_size must be < 2**32"),
        ("--eval-samples", str(2**70), "config field eval_samples must be < 2**32"),
        ("--reward-weights", "1e39", "config field reward_weights must be within float32's range"),
        ("--tool-timeout", "1e10", "config field tool_timeout must be in (0, 86400] seconds"),
    ],
)
def test_absurd_numbers_are_one_line(tmp_path, capsys, option, value, said):
    assert said in one_line_error(capsys, ["--out", str(tmp_path / "r"), *TINY, option, value])


def test_a_step_that_makes_the_weights_non_finite_ends_the_run_naming_it_and_saves_nothing(tmp_path):
    trainer = PPOTrainer(
        config(tmp_path, iterations=3, save_every=1, prompts_per_iteration=2, samples_per_prompt=2, max_new_tokens=4)
    )
    policy_step = trainer.optimizers.policy.step
    steps = []

    def poisoning_step(*args, **kwargs):  # a finite gradient times an absurd rate, as it lands
        steps.append(1)
        policy_step(*args, **kwargs)
        if len(steps) == 2:
            with torch.no_grad():
                next(trainer.policy.parameters()).view(-1)[0] = float("inf")

    trainer.optimizers.policy.step = poisoning_step
    with pytest.raises(TrainingFailed, match="optimizer step 2 made the weights non-finite"):
        trainer.train()
    run = tmp_path / "run"
    assert [p.name for p in sorted(run.glob("checkpoint-*"))] == ["checkpoint-1"]
    assert not list(run.glob("*.safetensors")), "a non-finite policy was saved"


def test_that_failure_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    from fastppo.trainer.update import optimizers

    monkeypatch.setattr(optimizers, "_total_norm", lambda tensors: torch.tensor(float("inf")))
    line = failed_line(capsys, ["--out", str(tmp_path / "r"), *TINY])
    assert "made the weights non-finite" in line or "skipped for non-finite gradients" in line


@pytest.mark.parametrize("kind", ["a directory", "a dangling symlink", "a symlink to a file"])
def test_a_lock_path_that_is_no_lock_file_is_one_line(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / LOCK_FILE
    if kind == "a directory":
        lock.mkdir()
    elif kind == "a dangling symlink":
        lock.symlink_to(tmp_path / "nowhere" / "lock")
    else:
        (tmp_path / "elsewhere").write_text("")
        lock.symlink_to(tmp_path / "elsewhere")
    expected = "a directory" if kind == "a directory" else "a symbolic link"
    with pytest.raises(UsageError, match=f"cannot take the run directory's lock file {lock}: it is {expected}"):
        RunLock.acquire(run)
    assert not (tmp_path / "nowhere").exists()  # nothing created through the link


def test_a_run_directory_on_a_read_only_filesystem_is_one_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(UsageError, match="lock file .*: Read-only file system"):
        RunLock.acquire(run)
