"""Held-out evaluation: its metrics against a hand computation, its greedy pass against Hugging
Face's ``generate``, and where it lands in a run (metrics.jsonl, TensorBoard, the plot)."""

import json

import pytest
import torch

from fastppo.rewards.scoring import Rewards
from fastppo.trainer.experience import evaluation
from fastppo.trainer.prompts.tasks import vowels_reward
from tests.trainer.runs import rollout_of, untrained

# prompt -> (its greedy completion, its three sampled ones); a completion "a" scores 1
OUTCOMES = {
    "ab": ("a", ("a", "a", "b")),
    "cd": ("b", ("b", "b", "b")),
    "ef": ("a", ("a", "a", "a")),
    "gh": ("b", ("b", "a", "b")),
    "ij": ("b", ("b", "b", "b")),
}


def test_the_metrics_of_fixed_outcomes_equal_a_hand_computation(tmp_path, monkeypatch):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in OUTCOMES))
    # a sampler of 4 slots takes all 5 prompts in one call per pass (rows wait for free slots)
    trainer = untrained(
        tmp_path, evaluate=True, eval_prompts=str(path), eval_samples=3, prompts_per_iteration=2, samples_per_prompt=2
    )
    trainer.rollouts.rewards = Rewards(
        [("is_a", lambda prompts, completions, **_: [float(c == "a") for c in completions])]
    )
    calls = []

    def sample(prompt_ids, temperature, n, seed, on_rows_ended=None, turns=None, sampler=None):  # Rollouts.sample
        prompts = [trainer.tokenizer.decode(ids) for ids in prompt_ids]
        calls.append((len(prompts), n))
        texts = [OUTCOMES[p][0] if temperature == 0 else OUTCOMES[p][1][j] for p in prompts for j in range(n)]
        return rollout_of(texts, trainer.tokenizer)

    monkeypatch.setattr(trainer.rollouts, "sample", sample)
    metrics = evaluation.evaluate(trainer.rollouts, trainer.eval_prompts, 3, iteration=0)
    assert trainer.rollouts.sampler.max_batch_size == 4 and calls == [(5, 1), (5, 3)]
    greedy = 2 / 5  # ab, ef
    mean_at_3 = (2 / 3 + 0 + 1 + 1 / 3 + 0) / 5
    pass_at_3 = 3 / 5  # ab, ef, gh
    assert metrics == pytest.approx({"eval/greedy": greedy, "eval/mean@3": mean_at_3, "eval/pass@3": pass_at_3})


def test_greedy_accuracy_is_the_mean_reward_of_hugging_faces_greedy_generate(tmp_path):
    trainer = untrained(tmp_path, evaluate=True, max_new_tokens=6)
    metrics = evaluation.evaluate(trainer.rollouts, trainer.eval_prompts, 2, iteration=0)
    tok, scores = trainer.tokenizer, []
    for ids in trainer.eval_prompts.ids:
        out = trainer.policy.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        text = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
        scores += vowels_reward(None, [text])
    assert len(scores) == 64
    assert metrics["eval/greedy"] == pytest.approx(sum(scores) / len(scores), abs=1e-12)
    assert 0 < metrics["eval/mean@2"] <= metrics["eval/pass@2"] <= 1


def test_a_run_evaluates_at_the_start_every_n_iterations_and_at_the_end(tmp_path):
    pytest.importorskip("tensorboard")
    trainer = untrained(tmp_path, evaluate=True, eval_every=2, eval_samples=2, iterations=5, save=False)
    history = trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4, 5] and rows[:5] == history
    assert [r["iteration"] for r in rows if "eval/greedy" in r] == [0, 2, 4, 5]
    assert [e["iteration"] for e in trainer.evaluations] == [0, 2, 4, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/pass@2")] == [0, 2, 4, 5]


def test_evaluation_leaves_the_training_draws_as_they_were(tmp_path):
    """Same seed with and without evaluation: the same training rollouts and rewards."""
    plain = untrained(tmp_path / "a", iterations=3, save=False).train()
    evaluated = untrained(tmp_path / "b", iterations=3, save=False, evaluate=True, eval_every=1).train()
    for a, b in zip(plain, evaluated):
        assert a["reward_mean"] == b["reward_mean"] and a["entropy"] == b["entropy"]


def test_evaluation_draws_apart_from_the_training_of_its_iteration(tmp_path):
    """Held-out samples never share the noise of the training rollout of the same iteration."""
    trainer = untrained(tmp_path, save=False, evaluate=True)
    seeds, sample = {"train": set(), "eval": set()}, trainer.rollouts.sample
    phase = []

    def recording(prompt_ids, temperature, n, seed, on_rows_ended=None, turns=None, sampler=None):  # Rollouts.sample
        seeds[phase[-1]].add(seed)
        return sample(prompt_ids, temperature, n, seed, on_rows_ended, turns, sampler)

    trainer.rollouts.sample = recording
    for iteration in range(3):
        phase.append("train")
        trainer.rollout(iteration)
        phase.append("eval")
        trainer.evaluate(iteration)
    assert len(seeds["train"]) == 3 and len(seeds["eval"]) == 6 and not seeds["train"] & seeds["eval"]


def test_the_evaluation_shows_its_progress_row_by_row(tmp_path, capsys):
    """A bar over every held-out row, moved by the sampler as rows end (it used to sit still for
    minutes on a real model)."""
    trainer = untrained(tmp_path, save=False, evaluate=True, eval_samples=2)
    ended = []
    sample = trainer.rollouts.sample
    trainer.rollouts.sample = lambda *args, **kwargs: sample(*args[:4], lambda k: (ended.append(k), args[4](k)))
    capsys.readouterr()
    trainer.evaluate(0)
    rows = len(trainer.eval_prompts) * 3  # one greedy and two sampled per prompt
    assert sum(ended) == rows and len(ended) > 2  # in several steps, not at the end
    err = capsys.readouterr().err
    assert "held-out before iteration 0" in err and f"/{rows} [" in err
