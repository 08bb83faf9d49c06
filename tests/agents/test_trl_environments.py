"""Environments written for TRL's ``environment_factory`` run unchanged: ``reset(**row)`` gets the
whole row, its prompt included; a factory may be a class, a function, a lambda or a
``functools.partial``, or a dict of them chosen by each row's ``environment`` field; an ``async``
``get_reward`` is awaited, and a ``get_reward`` returning None is no score (TRL's NaN); a class
given as a tool is refused in one line."""

import json
import sys

import pytest
import torch

from fastppo.cli import main as fastppo_main
from fastppo.errors import UsageError
from tests.agents.runs import agent_trainer, char_tokenizer, turn_taking_policy
from tests.trainer.test_hostile_input import one_line_error

MODULE = '''
import asyncio
import functools


class Guess:
    """Written as for TRL: reset takes the row's columns by name, the prompt among them."""

    def reset(self, prompt, answer, **kwargs):
        self.prompt, self.answer, self.kwargs, self.words = prompt, answer, kwargs, []

    def step(self, word: str) -> str:
        """Say a word.

        Args:
            word: the word
        """
        self.words.append(word)
        return "heard " + word

    async def get_reward(self):
        await asyncio.sleep(0)
        return float(len(self.words)) + self.answer


class Echo:
    def __init__(self, prefix):
        self.prefix = prefix

    def reset(self, **kwargs):
        self.kwargs = kwargs

    def step(self, word: str) -> str:
        """Echo a word.

        Args:
            word: the word
        """
        return self.prefix + word

    def echo(self, text: str) -> str:
        """Echo a text.

        Args:
            text: the text
        """
        return self.prefix + text

    def get_reward(self):
        return None  # this environment does not score its episodes


class Rude(Guess):
    def get_reward(self):
        return "great"


class Unsure(Guess):
    def get_reward(self):
        return float("nan") if len(self.answer * "x") % 2 else 1.0  # no score for odd answers, as TRL reads NaN


class Eager(Guess):
    async def reset(self, **kwargs):
        pass


def make_guess():
    return Guess()


guess_lambda = lambda: Guess()  # noqa: E731
guess_partial = functools.partial(Guess)
echo_partial = functools.partial(Echo, "> ")
ENVIRONMENTS = {"guess": Guess, "echo": echo_partial}
'''

ROWS = [{"prompt": p, "answer": a, "level": a % 2} for p, a in (("ab", 1), ("cd", 2), ("ef", 3), ("gh", 4))]


@pytest.fixture
def trl_envs(tmp_path, monkeypatch):
    (tmp_path / "trl_envs.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trl_envs", raising=False)
    yield
    sys.modules.pop("trl_envs", None)


def trainer_of(tmp_path, rows, **fields):
    return agent_trainer(tmp_path, rows, tools=None, reward=None, **fields)


@pytest.mark.parametrize("factory", ["Guess", "make_guess", "guess_lambda", "guess_partial"])
def test_reset_gets_the_whole_row_and_any_factory_makes_the_environments(tmp_path, trl_envs, steps, factory):
    trainer = trainer_of(tmp_path, ROWS, environment=f"trl_envs:{factory}")
    scored = trainer.rollout(0)
    instances = [episode.environment for episode in scored.episodes]
    assert len({id(e) for e in instances}) == 8 and all(type(e).__name__ == "Guess" for e in instances)
    by_prompt = {row["prompt"]: row for row in ROWS}
    for e in instances:
        row = by_prompt[e.prompt]  # the prompt column as the file gives it
        assert e.answer == row["answer"] and e.kwargs == {"level": row["level"]}
        assert len(e.words) == sum(m["role"] == "tool" for m in scored.episodes[instances.index(e)].messages)
    expected = torch.tensor([len(e.words) + float(e.answer) for e in instances])
    assert torch.equal(scored.each_reward["Guess"], expected)  # the async get_reward, awaited
    assert torch.equal(scored.raw, expected)


def test_a_dict_of_environments_chooses_by_the_environment_field_and_none_is_no_score(tmp_path, trl_envs, steps):
    rows = [{**row, "environment": "guess" if i % 2 else "echo"} for i, row in enumerate(ROWS)]
    trainer = trainer_of(tmp_path, rows, environment="trl_envs:ENVIRONMENTS")
    assert [s["function"]["name"] for s in trainer.agent.schemas_of(rows[0], "row 1")] == ["echo", "step"]
    assert [s["function"]["name"] for s in trainer.agent.schemas_of(rows[1], "row 2")] == ["step"]
    with pytest.warns(UserWarning, match="no reward function scored 4 of 8 completions.*their score is 0"):
        scored = trainer.rollout(0)
    kinds = [type(episode.environment).__name__ for episode in scored.episodes]
    chosen = {row["prompt"]: row["environment"] for row in rows}
    for episode, kind in zip(scored.episodes, kinds):
        e = episode.environment
        prompt = e.prompt if kind == "Guess" else e.kwargs["prompt"]
        assert {"Guess": "guess", "Echo": "echo"}[kind] == chosen[prompt]
        assert "environment" not in (e.kwargs if kind == "Echo" else {"prompt": 1, **e.kwargs})
        if kind == "Echo":
            assert all(m["content"].startswith("> ") for m in episode.messages if m["role"] == "tool")
    guess = torch.tensor([kind == "Guess" for kind in kinds])
    assert scored.each_reward["Guess"][~guess].isnan().all() and not scored.each_reward["Guess"][guess].isnan().any()
    assert scored.each_reward["Echo"].isnan().all()  # a column per class with get_reward, as TRL's: all None
    assert torch.equal(scored.raw[~guess], torch.zeros(4))


def test_a_reward_column_of_no_scores_is_left_out_of_the_metrics_and_the_logs(tmp_path, trl_envs, steps):
    rows = [{**row, "environment": "guess" if i % 2 else "echo"} for i, row in enumerate(ROWS)]
    trainer = trainer_of(tmp_path, rows, environment="trl_envs:ENVIRONMENTS", save=True, iterations=1)
    with pytest.warns(UserWarning, match="no reward function scored"):
        trainer.train()
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/Guess" in metrics and "reward/Echo" not in metrics
    for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)  # strict JSON: no NaN
        assert row.get("Guess") is None or isinstance(row["Guess"], float)


def test_rows_the_dict_cannot_place_are_named_at_start_up(tmp_path, trl_envs):
    rows = [{**ROWS[0], "environment": "guess"}, {**ROWS[1], "environment": "chess"}]
    with pytest.raises(UsageError, match=r"has environment='chess': .* chooses by it among 'guess', 'echo'"):
        trainer_of(tmp_path, rows, environment="trl_envs:ENVIRONMENTS")
    with pytest.raises(UsageError, match=r"has no 'environment' field"):
        trainer_of(tmp_path, ROWS, environment="trl_envs:ENVIRONMENTS")


def test_what_get_reward_returns_wrong_names_the_class(tmp_path, trl_envs, steps):
    trainer = trainer_of(tmp_path, ROWS, environment="trl_envs:Rude")
    with pytest.raises(UsageError, match=r"reward function Rude.get_reward returned str 'great' for completion 0"):
        trainer.rollout(0)


def test_a_nan_from_get_reward_is_no_score_as_none_is(tmp_path, trl_envs, steps):
    trainer = trainer_of(tmp_path, ROWS, environment="trl_envs:Unsure")
    with pytest.warns(UserWarning, match="no reward function scored 4 of 8 completions.*their score is 0"):
        scored = trainer.rollout(0)
    odd = torch.tensor([episode.environment.answer % 2 == 1 for episode in scored.episodes])
    assert scored.each_reward["Unsure"][odd].isnan().all() and torch.equal(scored.raw[odd], torch.zeros(4))
    assert torch.equal(scored.each_reward["Unsure"][~odd], torch.ones(4))


def test_an_async_reset_is_one_line_and_no_warning(tmp_path, trl_envs, steps):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would be a RuntimeWarning
        with pytest.raises(UsageError, match="--environment trl_envs:Eager: reset is async; it must be a plain"):
            trainer_of(tmp_path, ROWS, environment="trl_envs:Eager").rollout(0)
        import gc

        gc.collect()  # where a coroutine never closed would warn


def test_a_class_given_as_a_tool_is_one_line(tmp_path, trl_envs, capsys):
    line = one_line_error(capsys, ["--tools", "trl_envs:Guess", "--chat", "--out", str(tmp_path / "r")])
    assert "--tools trl_envs:Guess is a class, not a function" in line and "--environment" in line


def test_a_dict_of_environments_through_the_command_line(tmp_path, trl_envs, steps):
    tokenizer = char_tokenizer()
    turn_taking_policy(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    rows = [{**row, "environment": "guess" if i % 2 else "echo"} for i, row in enumerate(ROWS)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    args = ["--model", str(tmp_path / "model"), "--prompts", str(prompts), "--chat", "--out", str(out)]
    args += ["--environment", "trl_envs:ENVIRONMENTS", "--iterations", "1", "--evaluate", "false"]
    args += ["--prompts-per-iteration", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6"]
    args += ["--max-tool-tokens", "40", "--device", "cpu"]
    with pytest.warns(UserWarning, match="no reward function scored"):
        assert fastppo_main(["train", *args]) == 0
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["tools/calls"] > 0
