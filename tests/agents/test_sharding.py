"""Episodes under FSDP2 on two gloo ranks: the update of one unsharded rank that sees every episode."""

import json

import pytest
import torch

from fastppo.agents import parsing
from fastppo.agents.calls import Call
from fastppo.trainer import TrainConfig
from tests.agents.runs import TEMPLATE, char_tokenizer, turn_taking_policy
from tests.oracles import relative_error
from tests.ranks import rank_environment, spawn
from tests.trainer.parallel.test_distributed import FIELDS, one_update
from tests.trainer.parallel.test_sharding import leave


def _reads_calls():
    parsing.parse_turn = lambda text, tokenizer=None: (text, [Call("letters", {"text": text})])


def _episode_worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    _reads_calls()  # in this process too: the fixture's patch does not cross the spawn
    config = TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu", "fsdp": True}).validate()
    result = one_update(config)
    if rank == 0:
        torch.save(result, f"{out_dir}/sharded.pt")
    leave()


@pytest.mark.slow  # two processes: with the other end-to-end runs, out of the default suite
def test_two_sharded_ranks_make_the_episode_update_of_one_unsharded_rank(tmp_path, every_turn_calls):
    tokenizer = char_tokenizer()
    turn_taking_policy(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("ab", "cde", "f", "gh")))
    fields = {
        **FIELDS,
        "model": str(tmp_path / "model"),
        "prompts": str(tmp_path / "prompts.jsonl"),
        "chat": True,
        "tools": ["tests.agents.runs:letters"],
        "reward": ["tests.agents.runs:reward_calls"],
        "max_tool_calls": 2,
        "max_tool_tokens": 40,
        "max_new_tokens": 6,
        "samples_per_prompt": 2,
        "kl_coef": 0.02,
    }
    assert TEMPLATE  # the tokenizer saved with it renders the prompts and the results
    spawn(_episode_worker, str(tmp_path), {**fields, "prompts_per_iteration": 2})
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=False)
    single = one_update(
        TrainConfig.from_flat({**fields, "prompts_per_iteration": 4, "out": str(tmp_path / "one")}).validate()
    )
    assert single["metrics"]["tools/calls"] > 0
    assert any(g.abs().sum() > 0 for g in single["grads"]["policy"].values())
    for name, value in single["grads"]["policy"].items():
        assert relative_error(sharded["grads"]["policy"][name], value) <= 1e-5, name
    assert sharded["metrics"]["tools/calls"] == single["metrics"]["tools/calls"]
