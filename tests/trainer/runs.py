"""Builders the trainer's tests share: configs and trainers of the tiny models, a rolled-out batch,
the log-probs of a batch from the op itself, and a process holding a run directory's lock."""

import subprocess
import sys

import torch

import fastppo
from fastppo.rollout import Rollout
from fastppo.trainer import PPOTrainer, TrainConfig
from fastppo.trainer.modeling.default import char_tokenizer
from fastppo.trainer.update.batch import response_hidden


def config(tmp_path, **fields):
    """Three iterations into ``tmp_path/run``; no held-out evaluation unless asked for."""
    return TrainConfig.from_flat(
        {"out": str(tmp_path / "run"), "iterations": 3, "evaluate": False, **fields}
    ).validate()


def untrained(tmp_path, **fields):
    """A trainer on the vowels task from an untrained tiny model: learns in seconds."""
    from fastppo.trainer.modeling.default import tiny_policy

    tokenizer = char_tokenizer()
    fields = {"task": "vowels", "lr": 1e-3, "prompts_per_iteration": 8, "samples_per_prompt": 4, **fields}
    return PPOTrainer(config(tmp_path, **fields), policy=tiny_policy(tokenizer, seed=0), tokenizer=tokenizer)


def mean_reward(history, part):
    return sum(h["reward_mean"] for h in part(history)) / len(part(history))


TEMPERATURE = 0.7


def drifted(tmp_path, **fields):
    """A trainer whose policy has moved away from its reference, so the KL between them is not 0."""
    trainer = untrained(tmp_path, temperature=TEMPERATURE, save=False, **fields)
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return trainer


def direct_logprobs(model, batch, temperature):
    """The response tokens' log-probs under ``model`` at ``temperature``, from the op itself."""
    hidden = response_hidden(model, batch.layout())
    head = model.get_output_embeddings()
    labels = batch.response_ids.masked_fill(~batch.mask, -100)
    return fastppo.token_logprobs_from_hidden(hidden, head.weight, labels, bias=head.bias, temperature=temperature)


def rolled_out(trainer):
    scored = trainer.rollout(0)
    rollout, scores = scored.rollout, scored.scores
    return scores, trainer.prepare(rollout, scores)


def rollout_of(texts, tokenizer, finish="length"):
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    R = max(len(i) for i in ids)
    response_ids = torch.full((len(ids), R), tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), R, dtype=torch.bool)
    for b, row in enumerate(ids):
        response_ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = True
    logprobs = -torch.rand(len(ids), R) * mask
    return Rollout([[3]] * len(ids), response_ids, mask, mask.sum(1), logprobs, [finish] * len(ids))


HOLD = (
    "import sys; from fastppo.trainer.run.lock import RunLock; lock = RunLock.acquire(sys.argv[1]); "
    "print('held', flush=True); sys.stdin.read()"
)


def holder(directory):
    """Another process holding ``directory``'s lock until its stdin closes."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process


def killed_and_resumed(killed, run) -> object:
    """Train ``killed`` until its process dies mid-iteration 2 (after checkpoint-2), then resume the
    run directory ``run`` to its end; the resumed trainer."""
    import pytest

    run_iteration = killed.iteration

    def killed_at_2(i):
        if i == 2:
            raise KeyboardInterrupt  # the process dies mid-iteration, after checkpoint-2
        return run_iteration(i)

    killed.iteration = killed_at_2
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    resumed, start = PPOTrainer.resume(run)
    assert start == 2
    resumed.train(start)
    return resumed


def ops_on_triton(monkeypatch) -> list:
    """Every op's ``"auto"`` backend resolved to its Triton kernel (the interpreter, without a GPU);
    the backends asked for are appended to the list returned."""
    import sys

    from fastppo.ops import dispatch

    launched = []

    def triton_for_auto(backend, device):
        launched.append(backend)
        return dispatch.resolve_backend("triton" if backend == "auto" else backend, device)

    for name, module in list(sys.modules.items()):
        if name.startswith("fastppo.ops.") and module is not dispatch and hasattr(module, "resolve_backend"):
            monkeypatch.setattr(module, "resolve_backend", triton_for_auto)
    return launched
