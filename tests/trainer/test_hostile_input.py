"""What a hostile (or unlucky) user gives the trainer is one line naming it, exit 2, never a
traceback or a silently wrong number: broken reward modules and return values, colliding column
names, a CSV with a byte-order mark, devices this machine lacks, a memory plan of impossible
numbers, a full disk at a save, and a second Ctrl-C while a reward function hangs."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastppo.cli import main as fastppo_main
from fastppo.errors import UsageError
from fastppo.trainer import PPOTrainer
from tests.trainer.runs import config, untrained

TINY = [
    "--device",
    "cpu",
    "--iterations",
    "1",
    "--evaluate",
    "false",
    "--save",
    "false",
    "--prompts-per-iteration",
    "2",
    "--samples-per-prompt",
    "2",
    "--max-new-tokens",
    "4",
]


def one_line_error(capsys, argv, exit_code: int = 2, says: str = "error") -> str:
    """The error line of ``fastppo train argv``, which must exit ``exit_code`` with one line,
    ``fastppo train: {says}: ...``, and no traceback (after any progress bars of what loaded first)."""
    capsys.readouterr()
    assert fastppo_main(["train", *argv]) == exit_code, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    line = err.splitlines()[-1].split("\r")[-1]
    assert line.startswith(f"fastppo train: {says}: "), err
    return line


# reward functions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,match",
    [
        ("def score(prompts, completions:\n", "importing broken_reward raised SyntaxError"),
        ("raise RuntimeError('no API key')\n", "importing broken_reward raised RuntimeError: no API key"),
    ],
)
def test_a_reward_module_that_does_not_import(tmp_path, monkeypatch, capsys, source, match):
    (tmp_path / "broken_reward.py").write_text(source)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_reward", raising=False)
    err = one_line_error(
        capsys,
        [
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--reward",
            "broken_reward:score",
            "--out",
            str(tmp_path / "run"),
            *TINY,
        ],
    )
    assert match in err


@pytest.mark.parametrize(
    "returned,match",
    [
        (
            lambda c: {i: 0.0 for i in range(len(c))},
            "returned dict; it must return one real number \\(or None\\) per completion",
        ),
        (lambda c: None, "returned NoneType; it must return one real number \\(or None\\) per completion"),
        (lambda c: 0.5, "returned float; it must return one real number \\(or None\\) per completion"),
        (lambda c: "1" * len(c), "returned str"),
        (lambda c: torch.zeros(len(c), 1), "returned a 2-dim tensor"),
    ],
)
def test_a_reward_that_returns_no_list_of_scores(tmp_path, returned, match):
    trainer = PPOTrainer(config(tmp_path, save=False), reward_fn=lambda p, c, **_: returned(c))
    with pytest.raises(UsageError, match=match):
        trainer.rollout(0)


def test_a_reward_that_empties_its_lists_changes_nothing_of_the_trainer_s(tmp_path):
    def emptying(prompts, completions, **_):
        scores = [float(len(c)) for c in completions]
        prompts.clear()
        completions.clear()
        return scores

    trainer = untrained(tmp_path, save=False)
    trainer.rollouts.rewards.named.insert(0, ("emptying", emptying))
    trainer.rollouts.rewards.weights.insert(0, 1.0)
    scored = trainer.rollout(0)  # the vowels reward after it still sees every completion
    assert [len(v) for v in scored.each_reward.values()] == [32, 32]


def test_a_reward_that_empties_its_lists_and_returns_none_of_them(tmp_path):
    def emptying(prompts, completions, **_):
        completions.clear()
        return []

    trainer = PPOTrainer(config(tmp_path, save=False), reward_fn=emptying)
    with pytest.raises(UsageError, match="returned 0 scores for 128 completions"):
        trainer.rollout(0)


# prompt files --------------------------------------------------------------------------------


@pytest.mark.parametrize("column,field_map", [("prompts", None), ("completions", None), ("hint", "hint=prompts")])
def test_a_column_that_would_shadow_a_reward_argument(tmp_path, capsys, column, field_map):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1=", column: "x"}) + "\n")
    err = one_line_error(
        capsys,
        [
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--reward",
            "gsm8k",
            "--out",
            str(tmp_path / "run"),
            *TINY,
            *(["--field-map", field_map] if field_map else []),
        ],
    )
    target = field_map.split("=")[1] if field_map else column
    assert f"column {column!r} would reach the reward functions as {target!r}" in err


def test_a_csv_with_a_byte_order_mark_reads_its_first_column(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes("\ufeffprompt,answer\nab,1\ncd,2\n".encode("utf-8"))  # as Excel saves UTF-8
    trainer = PPOTrainer(config(tmp_path, prompts=str(path), reward="fastppo.trainer.prompts.tasks:vowels_reward"))
    assert trainer.prompts.texts == ["ab", "cd"] and trainer.prompts.fields[0] == {"answer": "1"}


# devices and the memory plan -----------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_machine_without_it(tmp_path, capsys, device):
    err = one_line_error(capsys, ["--device", device, "--out", str(tmp_path / "run")])
    assert (
        "config field device names CUDA, and this machine has no CUDA device (torch.cuda.is_available() is "
        f"false), got '{device}'"
    ) in err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--plan-device-memory", "nan"], "--plan-device-memory must be a positive number of GiB, got nan"),
        (["--plan-device-memory", "-4"], "--plan-device-memory must be a positive number of GiB, got -4"),
        (["--plan-world-size", "0"], "--plan-world-size must be >= 1, got 0"),
        (["--plan-world-size", "-2"], "--plan-world-size must be >= 1, got -2"),
        (["--plan-prompt-tokens", "0"], "--plan-prompt-tokens must be >= 1, got 0"),
        (["--plan-prompt-tokens", "100000"], "--plan-prompt-tokens 100000 with --max-new-tokens 8 exceeds the context"),
    ],
)
def test_a_plan_of_impossible_numbers(capsys, argv, match):
    assert match in one_line_error(capsys, ["--plan", *argv])


# saves and signals ---------------------------------------------------------------------------


@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_a_full_disk_at_a_save_is_one_line_and_damages_nothing(tmp_path, monkeypatch, capsys, writer):
    """What the writers raise when the disk is full: safetensors' own error, torch.save's stream writer."""
    import safetensors
    import transformers.modeling_utils

    run = tmp_path / "run"
    assert (
        fastppo_main(
            [
                "train",
                "--device",
                "cpu",
                "--iterations",
                "1",
                "--save-every",
                "1",
                "--evaluate",
                "false",
                "--out",
                str(run),
            ]
        )
        == 0
    )

    def saved():  # every run adds a TensorBoard event file of its own
        return sorted(p.relative_to(run) for p in run.rglob("*") if "tensorboard" not in p.parts)

    before = saved()
    if writer == "safetensors":

        def full(*args, **kwargs):
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)  # save_pretrained's writer
    else:

        def full(*args, **kwargs):
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing "
                "file data/0: file write failed"
            )

        monkeypatch.setattr(torch, "save", full)
    err = one_line_error(capsys, ["--resume", str(run), "--iterations", "2"])
    assert f"could not write {run / 'checkpoint-2'}" in err and "what was saved before is intact" in err
    assert saved() == before  # no checkpoint-2, no leftovers
    monkeypatch.undo()
    assert PPOTrainer.resume(run, {"iterations": 2})[1] == 1


HANGING_REWARD = """
import pathlib, time

def score(prompts, completions, **_):
    pathlib.Path(__file__).with_name("scoring").write_text("")
    time.sleep(600)
"""

HANGING_IN_C = """
import hashlib, pathlib

def score(prompts, completions, **_):
    pathlib.Path(__file__).with_name("scoring").write_text("")
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 10**9)  # minutes in one C call
"""


def hanging_in_a_subprocess(tmp_path, reward_source: str, *options):
    """The real command in a subprocess, scoring with ``hang:score`` (``reward_source``, which
    writes ``scoring`` beside itself when it starts to hang), returned once it hangs; the prompts
    are ``tmp_path/p.jsonl``."""
    (tmp_path / "hang.py").write_text(reward_source)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n")
    command = [
        sys.executable,
        "-m",
        "fastppo",
        "train",
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--reward",
        "hang:score",
        "--out",
        str(tmp_path / "run"),
        *TINY,
        *options,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "scoring").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    return process


@pytest.mark.slow  # the real command in a subprocess
@pytest.mark.parametrize(
    "reward,first,second",
    [(HANGING_REWARD, "SIGINT", "SIGINT"), (HANGING_IN_C, "SIGTERM", "SIGTERM"), (HANGING_IN_C, "SIGTERM", "SIGINT")],
    ids=["in Python", "in C", "in C, two kinds"],
)
def test_a_second_signal_stops_a_hung_reward_at_once(tmp_path, reward, first, second):
    process = hanging_in_a_subprocess(tmp_path, reward)
    process.send_signal(getattr(signal, first))  # the first asks for a checkpoint after this iteration ...
    time.sleep(1)
    assert process.poll() is None  # ... which the hung reward never reaches
    process.send_signal(getattr(signal, second))
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert err.strip().splitlines()[-1] == (
        f"fastppo train: stopped at once by a second signal ({first} then {second}), "
        "without a checkpoint; the newest checkpoint is intact"
    )


HANGING_AT_THE_END = """
import pathlib, time

CALLS = []

def score(prompts, completions, **_):
    CALLS.append(1)
    if len(CALLS) == 4:  # held-out greedy, held-out samples, iteration 0, then the final greedy
        pathlib.Path(__file__).with_name("scoring").write_text("")
        time.sleep(600)
    return [0.0] * len(completions)
"""


@pytest.mark.slow  # the real command in a subprocess
def test_one_ctrl_c_stops_the_final_evaluation_once_everything_is_saved(tmp_path):
    process = hanging_in_a_subprocess(
        tmp_path,
        HANGING_AT_THE_END,
        "--eval-prompts",
        str(tmp_path / "p.jsonl"),
        "--evaluate",
        "true",
        "--save",
        "true",
    )
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert err.strip().splitlines()[-1] == (
        "fastppo train: stopped during the final held-out evaluation; the trained "
        "policy and checkpoint-1 are saved (SIGTERM)"
    )
    assert (tmp_path / "run" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoint-1").is_dir()


def test_a_reward_module_in_the_working_directory_is_found_without_python_m(tmp_path, monkeypatch):
    """The ``fastppo`` script has no working directory on sys.path; ``python -m fastppo`` has."""
    from fastppo.rewards.loading import load_reward

    (tmp_path / "here_reward.py").write_text(
        "def score(prompts, completions, **_):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "here_reward", raising=False)
    assert load_reward("here_reward:score")([], ["a", "b"]) == [1.0, 1.0]
    with pytest.raises(UsageError, match="cannot import no_such_reward"):
        load_reward("no_such_reward:score")


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(prompts="missing.jsonl", reward=["gsm8k"]), "--prompts missing.jsonl: no such file"),
        (dict(reward=["nowhere_module:score"]), "cannot import nowhere_module"),
        (dict(eval_prompts="held.txt", evaluate=True), "--eval-prompts held.txt: unknown format '.txt'"),
    ],
)
def test_prompt_and_reward_errors_come_before_the_model_loads(tmp_path, monkeypatch, fields, match):
    from fastppo.trainer import build

    def no_loading(path):
        raise AssertionError("the model loaded before the prompts and rewards were checked")

    monkeypatch.setattr(build, "load_policy", no_loading)
    with pytest.raises(UsageError, match=match):
        PPOTrainer(config(tmp_path, **fields))
