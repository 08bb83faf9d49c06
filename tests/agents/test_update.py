"""The update on episodes: the response is every turn, and the tool results and scaffolding (mask
0) are out of the loss, the KL, the entropy and every count. The gradient equals a float64
reference computed row by row on the concatenated episodes with the mask, and the shared-prefix
layout's equals the padded rows'."""

import pytest
import torch

from fastppo.trainer.update.loss import minibatch_loss
from tests.agents.runs import agent_trainer, end_turns_often
from tests.oracles import logprobs_oracle, ppo_loss_oracle, relative_error
from tests.trainer.runs import TEMPERATURE, ops_on_triton
from tests.trainer.update.test_probe import SHARED, whole_gradient


def drifted_agent(tmp_path, **fields):
    """An agent trainer whose policy has moved from its reference (still ending its turns often;
    LoRA's factors left at their start, which would move every hidden state)."""
    trainer = agent_trainer(tmp_path, **fields)
    with torch.no_grad():
        for name, p in trainer.policy.named_parameters():
            if "lora_" not in name:
                p.add_(torch.randn_like(p) * 0.05)
    end_turns_often(trainer.policy, trainer.tokenizer)
    return trainer


def episodes_of(trainer):
    scored = trainer.rollout(0)
    batch = trainer.prepare(scored.rollout, scored.scores)
    inner = batch.mask.cumsum(1) < batch.mask.sum(1, keepdim=True)  # before each row's last model token
    holes = ~batch.mask & inner & (torch.arange(batch.mask.shape[1]) < batch.lens[:, None])
    assert holes.any(), "the episodes must hold tool tokens between model turns"
    return scored, batch, holes


@pytest.mark.parametrize("layout", ["shared", "padded"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_gradient_is_a_reference_on_the_concatenated_episodes(
    tmp_path, every_turn_calls, monkeypatch, backend, layout
):
    """On both backends (Triton: every op's kernel in the interpreter, the sampler's draw too)."""
    if backend == "triton":
        pytest.importorskip("triton")
        launched = ops_on_triton(monkeypatch)
    fields = dict(kl_coef=0.1, entropy_coef=0.02, recompute_old_logprobs=True, kl_estimator="k3")
    trainer = drifted_agent(tmp_path, **fields)
    _, batch, holes = episodes_of(trainer)
    if layout == "padded":
        trainer.models.shared_prefix = None
    assert backend == "torch" or launched
    batch.old_logprobs = batch.old_logprobs + 0.1 * torch.randn_like(batch.old_logprobs) * batch.mask  # ratios != 1
    tokens = batch.mask.sum()
    trainer.optimizers.zero_grad()
    loss, _ = minibatch_loss(batch, trainer.models, trainer.config, trainer.state.kl_coef, tokens, on_policy=False)
    loss.backward()
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    got = torch.cat([p.grad.flatten() for p in params])

    # the reference: each episode alone, prompt + every turn as one sequence, no padding, in float64
    policy = trainer.policy.double()
    logps, entropies = [], []
    R = batch.mask.shape[1]
    for b in range(len(batch.lens)):
        P, n = int(batch.prompt_lens[b]), int(batch.lens[b])
        ids = batch.input_ids[b, : P + n][None]
        logits = policy(ids).logits[0, P - 1 : P + n - 1]  # the states that predict the response
        labels = batch.response_ids[b, :n].masked_fill(~batch.mask[b, :n], -100)
        logp, entropy = logprobs_oracle(logits, labels, temperature=TEMPERATURE)
        logps.append(torch.nn.functional.pad(logp, (0, R - n)))
        entropies.append(torch.nn.functional.pad(entropy, (0, R - n)))
    expected, _ = ppo_loss_oracle(
        torch.stack(logps),
        batch.old_logprobs,
        batch.advantages,
        batch.mask,
        ref=batch.ref_logprobs,
        entropy=torch.stack(entropies),
        kl_coef=0.1,
        entropy_coef=0.02,
        kl_estimator="k3",
    )
    reference = torch.autograd.grad(expected, params)
    trainer.policy.float()
    assert abs(float(loss.detach()) - float(expected.detach())) <= 1e-5 * abs(float(expected)) + 1e-6
    assert relative_error(got, torch.cat([g.flatten() for g in reference]).float()) <= 1e-5
    # the tool tokens are no part of anything the update read
    assert (batch.advantages[holes] == 0).all() and (batch.old_logprobs[holes] == 0).all()


CASES = {
    "grpo": {},
    "off-policy two epochs": {"recompute_old_logprobs": True, "ppo_epochs": 2},
    "seq-mean-token-sum-norm": {"agg": "seq-mean-token-sum-norm"},
    "gae with a critic": {"estimator": "gae", "samples_per_prompt": 1, "prompts_per_iteration": 8},
    "lora": {"lora_rank": 4},
    "micro-batches": {"max_tokens_per_microbatch": 40, "recompute_old_logprobs": True},
}


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_the_shared_prefix_update_of_episodes_is_the_padded_update(tmp_path, every_turn_calls, fields):
    trainer = drifted_agent(tmp_path, kl_coef=0.05, entropy_coef=0.01, **fields)
    assert trainer.models.shared_prefix is not None, trainer.models.padded_because
    _, batch, _ = episodes_of(trainer)
    shared = whole_gradient(trainer, batch, SHARED)
    padded = whole_gradient(trainer, batch, None)
    assert padded.norm() > 0
    assert relative_error(shared, padded) <= 1e-5


def test_gae_values_and_advantages_are_at_model_tokens_only(tmp_path, every_turn_calls):
    trainer = drifted_agent(tmp_path, estimator="gae", samples_per_prompt=1, prompts_per_iteration=8, kl_coef=0.05)
    _, batch, holes = episodes_of(trainer)
    for name in ("values", "advantages", "returns", "ref_logprobs"):
        assert (getattr(batch, name)[holes] == 0).all(), name
    assert (batch.advantages[batch.mask] != 0).any()
