"""Rollout options the trainer exposes: stop strings, top-k / top-p, the overlong penalty."""

import pytest
import torch

from fastppo.trainer.experience import responses
from fastppo.trainer.modeling.default import char_tokenizer
from tests.trainer.runs import rollout_of, untrained


def test_a_stop_string_ends_the_response_at_the_token_that_completes_it():
    tokenizer = char_tokenizer()
    rollout = rollout_of(["ab. cd. ef", "no stop here", "x cd y cd", "cd"], tokenizer)
    cut = responses.cut_at_stop_strings(rollout, tokenizer, [".", "cd"])
    assert responses.completions(cut, tokenizer) == ["ab.", "no stop here", "x cd", "cd"]
    assert cut.response_lens.tolist() == [3, 12, 4, 2]
    assert cut.finish_reason == ["stop", "length", "stop", "stop"]
    assert torch.equal(cut.response_mask, torch.arange(12) < cut.response_lens[:, None])
    assert torch.equal(cut.logprobs, rollout.logprobs * cut.response_mask)  # kept up to the cut, 0 after
    assert torch.equal(cut.response_ids[cut.response_mask], rollout.response_ids[cut.response_mask])
    assert (cut.response_ids[~cut.response_mask] == tokenizer.pad_token_id).all()
    assert responses.cut_at_stop_strings(rollout, tokenizer, None) is rollout


def test_the_binary_search_finds_the_first_completing_token_at_every_position():
    tokenizer = char_tokenizer()
    for n in range(1, 12):
        text = "a" * (n - 1) + "bz"
        cut = responses.cut_at_stop_strings(rollout_of([text], tokenizer), tokenizer, ["bz"])
        assert int(cut.response_lens[0]) == n + 1


def test_the_trainer_cuts_its_rollouts_at_stop_strings(tmp_path):
    trainer = untrained(tmp_path, max_new_tokens=8, stop=["a", "e"])
    scored = trainer.rollout(0)
    texts = responses.completions(scored.rollout, trainer.tokenizer)
    for text, reason in zip(texts, scored.rollout.finish_reason):
        hit = [i for i, c in enumerate(text) if c in "ae"]
        assert not hit or (hit[0] == len(text) - 1 and reason == "stop")
    assert any(t and t[-1] in "ae" for t in texts)


def test_top_k_and_top_p_reach_the_sampler(tmp_path):
    greedy = untrained(tmp_path / "g", temperature=1.0)
    greedy.models.rollout_weights.refresh()
    reference = greedy.rollouts.sampler.generate(
        greedy.prompts.ids[:4],
        max_new_tokens=8,
        temperature=0.0,
        stop_token_ids=(greedy.tokenizer.eos_token_id,),
        pad_token_id=greedy.tokenizer.pad_token_id,
    )
    for options in ({"top_k": 1}, {"top_p": 1e-6}):
        trainer = untrained(tmp_path / str(options), temperature=1.0, **options)
        rollout = trainer.rollouts.sample(trainer.prompts.ids[:4], 1.0, 1, seed=5)
        assert torch.equal(rollout.response_ids, reference.response_ids), options
    free = untrained(tmp_path / "free", temperature=1.0).rollouts.sample(greedy.prompts.ids[:4], 1.0, 1, seed=5)
    assert not torch.equal(free.response_ids, reference.response_ids)


def test_the_overlong_penalty_falls_linearly_over_the_buffer():
    lengths = torch.arange(1, 9)
    penalty = responses.overlong_penalty(lengths, max_new_tokens=8, buffer=4, penalty=2.0)
    torch.testing.assert_close(penalty, torch.tensor([0, 0, 0, 0, -0.5, -1.0, -1.5, -2.0]))
    assert not responses.overlong_penalty(lengths, 8, 0, 2.0).any()


def test_the_trainer_adds_the_overlong_penalty_to_the_scores(tmp_path):
    trainer = untrained(tmp_path, max_new_tokens=6, overlong_buffer=3, overlong_penalty=0.5)
    scored = trainer.rollout(0)
    lengths = scored.rollout.response_lens.float()
    expected = scored.raw - 0.5 * (lengths - 3).clamp(min=0) / 3
    assert (lengths > 3).any()
    torch.testing.assert_close(scored.scores, expected)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(stop=[""]), "stop must not hold an empty string"),
        (dict(overlong_buffer=8), "overlong_buffer must be >= 0 and < max_new_tokens"),
        (dict(dual_clip=1.0), "dual_clip must be > 1"),
        (dict(agg="mean"), "agg must be one of"),
    ],
)
def test_bad_rollout_and_loss_options_are_refused(tmp_path, fields, match):
    from fastppo.errors import UsageError
    from tests.trainer.runs import config

    with pytest.raises(UsageError, match=match):
        config(tmp_path, **fields)


def test_filter_groups_keeps_only_groups_whose_scores_differ_and_samples_until_full(tmp_path):
    """Prompts starting with a-m always score 1 (their groups carry no advantage); the others by
    their completion's vowels. The batch is refilled from further prompts until it holds only the
    others, or is padded with equal groups once the attempts run out."""
    from fastppo.rewards.scoring import Rewards
    from fastppo.trainer.prompts.tasks import vowels_reward

    def reward(prompts, completions, **_):
        return [1.0 if p[0] <= "m" else v for p, v in zip(prompts, vowels_reward(prompts, completions))]

    trainer = untrained(
        tmp_path, filter_groups=True, filter_groups_attempts=6, prompts_per_iteration=4, samples_per_prompt=3
    )
    trainer.rollouts.rewards = Rewards([("reward", reward)])
    scored = trainer.rollout(0)
    groups = scored.scores.view(4, 3)
    assert not (groups == groups[:, :1]).all(dim=1).any()  # every kept group differs
    assert scored.stats["groups_informative"] == 1.0 and scored.stats["sampling_attempts"] > 1
    assert trainer.state.prompts_drawn == 4 * scored.stats["sampling_attempts"]
    texts = responses.completions(scored.rollout, trainer.tokenizer)
    prompts = [trainer.tokenizer.decode(p) for p in scored.rollout.prompt_ids]
    assert scored.raw.tolist() == pytest.approx(reward(prompts, texts))  # rows and scores stay together
    assert all(p[0] > "m" for p in prompts)
    assert torch.equal(
        scored.rollout.response_mask,
        torch.arange(scored.rollout.response_ids.shape[1]) < scored.rollout.response_lens[:, None],
    )

    trainer = untrained(
        tmp_path / "short", filter_groups=True, filter_groups_attempts=1, prompts_per_iteration=4, samples_per_prompt=3
    )
    trainer.rollouts.rewards = Rewards([("always", lambda prompts, completions, **_: [1.0] * len(completions))])
    scored = trainer.rollout(0)
    assert scored.stats == {"groups_informative": 0.0, "sampling_attempts": 1.0, "reward_sampled": 1.0}
    assert scored.scores.shape == (12,)
    batch = trainer.prepare(scored.rollout, scored.scores)
    assert not batch.advantages.any()  # the filler groups teach nothing
