"""The files a run reads are pinned to it: a run started with relative paths resumes from any
directory reading the same files, and refuses prompts that changed since."""

import json
import sys

import pytest

from fastppo.cli import main as fastppo_main
from fastppo.errors import UsageError
from fastppo.trainer.run.inputs import INPUTS_FILE, check, pinned

REWARD = "def score(prompts, completions, **_):\n    return [float(len(c)) for c in completions]\n"
TINY = [
    "--iterations",
    "1",
    "--save-every",
    "1",
    "--device",
    "cpu",
    "--evaluate",
    "false",
    "--prompts-per-iteration",
    "2",
    "--samples-per-prompt",
    "2",
    "--max-new-tokens",
    "4",
]


@pytest.fixture
def started_elsewhere(tmp_path, monkeypatch):
    """A run started in ``tmp_path/start`` with ``--prompts p.jsonl`` and a reward module found
    through ``PYTHONPATH=.``; then the working directory moves to ``tmp_path/later``, which holds
    another p.jsonl and no reward module."""
    start, later = tmp_path / "start", tmp_path / "later"
    for directory, prompts in ((start, ["12+3=", "4+4="]), (later, ["x"])):
        directory.mkdir()
        (directory / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (start / "pinned_reward.py").write_text(REWARD)
    monkeypatch.chdir(start)
    monkeypatch.syspath_prepend(".")
    monkeypatch.delitem(sys.modules, "pinned_reward", raising=False)  # another test's
    run = tmp_path / "run"
    assert (
        fastppo_main(["train", "--prompts", "p.jsonl", "--reward", "pinned_reward:score", "--out", str(run), *TINY])
        == 0
    )
    monkeypatch.chdir(later)
    sys.path.remove(".")
    sys.modules.pop("pinned_reward")
    return run, start


def test_a_resume_from_another_directory_reads_the_files_the_run_started_with(started_elsewhere, capsys):
    run, start = started_elsewhere
    assert json.loads((run / "config.json").read_text())["prompts"] == str(start / "p.jsonl")
    assert json.loads((run / INPUTS_FILE).read_text())["reward_modules"]["pinned_reward"]["root"] == str(start)
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "2"]) == 0, capsys.readouterr().err
    assert sys.modules["pinned_reward"].__file__ == str(start / "pinned_reward.py")


def test_the_same_relative_path_given_again_on_resume_is_no_change(started_elsewhere, monkeypatch):
    run, start = started_elsewhere
    monkeypatch.chdir(start)
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "2", "--prompts", "p.jsonl"]) == 0


def test_a_resume_refuses_prompts_that_changed(started_elsewhere, capsys):
    run, start = started_elsewhere
    (start / "p.jsonl").write_text(json.dumps({"prompt": "9+9="}) + "\n")
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--prompts {start / 'p.jsonl'} changed since the run started" in err
    (start / "p.jsonl").unlink()
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "2"]) == 2
    assert "is gone" in capsys.readouterr().err


def test_a_changed_reward_module_resumes_with_a_warning(started_elsewhere):
    run, start = started_elsewhere
    (start / "pinned_reward.py").write_text(REWARD.replace("len(c)", "-len(c)"))
    with pytest.warns(UserWarning, match="reward module pinned_reward .* changed since the run started"):
        assert fastppo_main(["train", "--resume", str(run), "--iterations", "2"]) == 0


def test_a_reward_module_that_is_gone_is_refused_though_another_of_its_name_is_on_the_path(
    started_elsewhere, tmp_path, monkeypatch, capsys
):
    run, start = started_elsewhere
    (start / "pinned_reward.py").unlink()
    (tmp_path / "later" / "pinned_reward.py").write_text(REWARD.replace("len(c)", "-len(c)"))
    monkeypatch.syspath_prepend(str(tmp_path / "later"))
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"reward module pinned_reward ({start / 'pinned_reward.py'}) is gone" in err


def test_the_module_the_run_started_with_comes_before_another_of_its_name(started_elsewhere, tmp_path, monkeypatch):
    run, start = started_elsewhere
    (tmp_path / "later" / "pinned_reward.py").write_text(REWARD.replace("len(c)", "-len(c)"))
    monkeypatch.syspath_prepend(str(tmp_path / "later"))
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "2"]) == 0
    assert sys.modules["pinned_reward"].__file__ == str(start / "pinned_reward.py")


@pytest.mark.parametrize("name", ["prompts", "chat_template"])
def test_a_pinned_file_changed_at_the_same_size_is_refused(tmp_path, name):
    file = tmp_path / "pinned.txt"
    file.write_text("abcd")
    (tmp_path / INPUTS_FILE).write_text(pinned({name: str(file)}))
    check(tmp_path)  # unchanged: passes
    file.write_text("abce")
    with pytest.raises(UsageError, match=f"--{name.replace('_', '-')} {file} changed since the run started"):
        check(tmp_path)
