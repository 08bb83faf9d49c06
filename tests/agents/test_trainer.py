"""The trainer with tools: episodes in the rollout, rewards that read their messages (or text),
environments reset per episode with their rows' fields, tool metrics and whole episodes in the
logs, held-out episodes, a hung tool that only costs its timeout (and the wait for it, counted) on
either tool schedule, and exact resumption."""

import json

import pytest
import torch

from fastppo.agents import parsing
from fastppo.agents.calls import Call
from fastppo.trainer import PPOTrainer
from tests.agents import runs
from tests.agents.runs import agent_trainer
from tests.trainer.runs import killed_and_resumed


def test_chat_rewards_read_each_episodes_messages(tmp_path, every_turn_calls):
    runs.SEEN.clear()
    trainer = agent_trainer(tmp_path, reward=["tests.agents.runs:remember"])
    scored = trainer.rollout(0)
    seen = runs.SEEN[-1]
    assert len(seen["completions"]) == 8 and seen["environments"] is None
    for episode, messages in zip(scored.episodes, seen["completions"]):
        assert messages == episode.messages and messages[0]["role"] == "assistant"
        tools = [m for m in messages if m["role"] == "tool"]
        assert len(tools) == episode.calls <= 2  # --max-tool-calls 2
        for m in tools:
            assert m["name"] == "letters" and m["content"].isdigit()
    assert any(e.calls for e in scored.episodes)
    assert all(p.startswith("u:") and p.endswith("<eos>\na:") for p in seen["prompts"])


def test_string_prompts_get_the_episodes_text(tmp_path, every_turn_calls):
    runs.SEEN.clear()
    trainer = agent_trainer(tmp_path, chat=False, reward=["tests.agents.runs:remember"])
    scored = trainer.rollout(0)
    texts = runs.SEEN[-1]["completions"]
    assert all(isinstance(t, str) for t in texts)
    calling = [i for i, e in enumerate(scored.episodes) if e.calls]
    assert calling and all(f"t:{scored.episodes[i].messages[1]['content']}" in texts[i] for i in calling)


def test_an_environment_per_episode_its_reward_and_its_observation(tmp_path, steps):
    runs.SEEN.clear()
    rows = [{"prompt": p, "hint": p.upper()} for p in ("ab", "cd", "ef", "gh")]
    trainer = agent_trainer(
        tmp_path, tools=None, environment="tests.agents.runs:Observed", reward=["tests.agents.runs:remember"]
    )
    trainer = type(trainer)(trainer.config, policy=trainer.policy, tokenizer=trainer.tokenizer, prompts=rows)
    scored = trainer.rollout(0)
    seen = runs.SEEN[-1]
    instances = seen["environments"]
    assert len(instances) == 8 and len({id(e) for e in instances}) == 8  # one per episode
    assert [e.hint for e in instances] == seen["hint"]  # reset with its own row's fields
    for e, episode in zip(instances, scored.episodes):
        assert e.count == episode.calls  # its tools are its own instance's methods
    for prompt, hint in zip(scored.rollout.prompt_ids, seen["hint"]):
        assert trainer.tokenizer.decode(prompt).endswith(f" ({hint})<eos>\na:")
    assert f"({seen['hint'][0]})" in seen["prompts"][0]
    assert torch.equal(scored.each_reward["Observed"], torch.tensor([float(e.count) for e in instances]))
    assert float(scored.each_reward["Observed"].sum()) > 0


def test_an_observation_needs_a_chat_prompt(tmp_path, steps):
    from fastppo.errors import UsageError

    rows = [{"prompt": "ab", "hint": "x"}] * 4
    trainer = agent_trainer(tmp_path, chat=False, tools=None, environment="tests.agents.runs:Observed")
    trainer = type(trainer)(trainer.config, policy=trainer.policy, tokenizer=trainer.tokenizer, prompts=rows)
    with pytest.raises(UsageError, match="reset returned an observation.*string prompt"):
        trainer.rollout(0)


@pytest.mark.parametrize("schedule", ["fixed", "eager"])
def test_a_tool_that_never_returns_costs_its_timeout_only(tmp_path, every_turn_calls, monkeypatch, schedule):
    monkeypatch.setattr(
        parsing, "parse_turn", lambda text, tokenizer=None: (text, [Call("never_returns", {"text": text})])
    )
    trainer = agent_trainer(
        tmp_path, tools=["tests.agents.runs:never_returns"], tool_timeout=0.2, iterations=1, tool_schedule=schedule
    )
    history = trainer.train()
    assert history[0]["tools/timeouts"] > 0 and history[0]["tools/timeouts"] == history[0]["tools/calls"]
    assert 0 <= history[0]["time_tools_wait"] <= history[0]["time_rollout"]  # waits with nothing to decode, counted


def test_logs_hold_tool_metrics_and_whole_episodes_and_evaluation_runs_episodes(tmp_path, every_turn_calls):
    trainer = agent_trainer(tmp_path, evaluate=True, log_completions=2)
    trainer.eval_prompts = trainer.prompts.select([0, 1])
    history = trainer.train()
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for name in ("tools/calls", "tools/calling", "tools/turns", "tools/failures", "tools/seconds"):
        assert name in history[0] and name in rows[1], name
    assert "eval/tools/calling" in rows[0] and 0 <= rows[0]["eval/tools/calling"] <= 1
    examples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert examples and all(e["messages"][0]["role"] == "assistant" for e in examples)
    assert any(m["role"] == "tool" for e in examples for m in e["messages"])


def test_resume_with_tools_is_exact(tmp_path, every_turn_calls):
    """A run resumes from its files alone: the model and tokenizer, the prompts and the template
    on disk (the episodes' draws are the run's seeds, whatever the tools' timing)."""
    from fastppo.trainer import TrainConfig

    model = tmp_path / "model"
    tokenizer = runs.char_tokenizer()
    runs.turn_taking_policy(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (tmp_path / "template.jinja").write_text(runs.TEMPLATE)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("ab", "cde", "f", "gh")))
    fields = dict(
        model=str(model),
        chat_template=str(tmp_path / "template.jinja"),
        prompts=str(tmp_path / "prompts.jsonl"),
        chat=True,
        tools=["tests.agents.runs:letters"],
        reward=["tests.agents.runs:reward_calls"],
        max_tool_calls=2,
        max_tool_tokens=40,
        max_new_tokens=6,
        temperature=0.7,
        prompts_per_iteration=2,
        samples_per_prompt=2,
        lr=1e-3,
        iterations=4,
        save_every=2,
        evaluate=False,
    )

    def trainer(directory):
        return PPOTrainer(TrainConfig.from_flat({**fields, "out": str(directory / "run")}).validate())

    straight = trainer(tmp_path / "a")
    straight.train()
    resumed = killed_and_resumed(trainer(tmp_path / "b"), tmp_path / "b" / "run")

    def untimed(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [
            {k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s", "tools/seconds"))} for r in rows
        ]

    metrics = untimed(tmp_path / "a" / "run" / "metrics.jsonl")
    assert metrics == untimed(tmp_path / "b" / "run" / "metrics.jsonl")
    assert sum(row["tools/calls"] for row in metrics) > 0
    for a, b in zip(straight.policy.state_dict().values(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("schedule", ["fixed", "eager"])
def test_episodes_stream_at_staleness_1(tmp_path, every_turn_calls, schedule):
    """Episodes of the next iteration enter while this one's finish: each batch's episodes are its
    own (their tool messages read by its reward), and stale tokens are reported."""
    trainer = agent_trainer(tmp_path, max_staleness=1, iterations=3, tool_schedule=schedule)
    history = trainer.train()
    for h in history:
        assert h["tools/calls"] > 0 and h["reward_mean"] == pytest.approx(h["tools/calls"])
    assert any(h["staleness_max"] == 1 for h in history[1:])


@pytest.mark.parametrize("environment", ["Counter", "Observed"])
def test_environments_stream_at_staleness_1(tmp_path, steps, environment):
    """Two batches in flight at once never share an environment instance: each batch's reward (its
    instances' counts of calls) is its own episodes' calls. An observation (``Observed``) makes each
    row's prompt its own, and the batch streams one row per prompt."""
    runs.SEEN.clear()
    rows = [{"prompt": p, "hint": p.upper()} for p in ("ab", "cde", "f", "ghij", "kl", "mno", "pq", "r")]
    trainer = agent_trainer(
        tmp_path,
        tools=None,
        environment=f"tests.agents.runs:{environment}",
        reward=["tests.agents.runs:remember"],
        max_staleness=1,
        iterations=3,
    )
    trainer = type(trainer)(trainer.config, policy=trainer.policy, tokenizer=trainer.tokenizer, prompts=rows)
    history = trainer.train()
    assert any(h["staleness_max"] == 1 for h in history[1:])
    seen = [s for s in runs.SEEN if len(s["completions"]) == 8]  # the training batches, in order
    assert len(seen) == 3
    for earlier, later in zip(seen, seen[1:]):  # in flight together
        assert not {id(e) for e in earlier["environments"]} & {id(e) for e in later["environments"]}
    for batch, h in zip(seen, history):  # the instances' counts when their batch was scored: its calls
        assert h[f"reward/{environment}"] == pytest.approx(h["tools/calls"])
        if environment == "Observed":
            assert all(prompt.endswith(f" ({hint})<eos>\na:") for prompt, hint in zip(batch["prompts"], batch["hint"]))
    assert sum(h["tools/calls"] for h in history) > 0
