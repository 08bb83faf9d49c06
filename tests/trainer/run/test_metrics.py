"""What a run logs is what happened: loss terms that do not shrink with the minibatch count,
held-out scores per reward function, generated and trained tokens apart, a summary of the whole
run, and a warning when the loss is left with little to learn from."""

import copy
import json

import pytest
import torch

from tests.trainer.runs import drifted, rolled_out


def logged_update(trainer, batch, **algo) -> dict:
    """The stats ``update`` logs for ``batch`` with ``algo`` fields set, no optimizer step taken."""
    for name, value in algo.items():
        setattr(trainer.config.algo, name, value)
    trainer.optimizers.step = lambda state: None
    return trainer.update(copy.deepcopy(batch), 0)


@pytest.mark.parametrize("estimator,kl_coef", [("grpo", 0.1), ("gae", 0.0)])
def test_logged_loss_terms_do_not_depend_on_how_a_step_is_split(tmp_path, estimator, kl_coef):
    """entropy, kl, pg_loss (token-mean) and vf_loss are the step's token means, whether its
    tokens went through one minibatch or four."""
    trainer = drifted(tmp_path, estimator=estimator, kl_coef=kl_coef, entropy_coef=0.01, recompute_old_logprobs=True)
    _, batch = rolled_out(trainer)
    whole = logged_update(trainer, batch, minibatches=1, grad_accumulation=1)
    split = logged_update(trainer, batch, minibatches=4, grad_accumulation=4)
    keys = ["entropy", "pg_loss"] + (["kl"] if kl_coef else []) + (["vf_loss"] if estimator == "gae" else [])
    assert all(k in whole for k in keys)
    for key in keys:
        assert split[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), key
    assert whole["entropy"] > 0.1


def test_generated_and_trained_tokens_are_logged_apart_and_the_evaluation_is_timed(tmp_path):
    """With --mask-truncated the loss keeps fewer tokens than were sampled: both rates are logged;
    most of a batch masked out is said once."""
    from tests.trainer.runs import untrained

    trainer = untrained(tmp_path, iterations=2, mask_truncated=True, max_new_tokens=3, evaluate=True, save=False)
    with pytest.warns(UserWarning, match=r"of a batch's responses hit max_new_tokens=3 and are left out") as caught:
        trainer.train()
    assert sum("left out of the loss" in str(w.message) for w in caught) == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "reward_mean" in row]
    for row in trained:
        generated = row["response_length"] * 32  # 8 prompts x 4 samples
        assert row["tokens_per_s_generated"] > row["tokens_per_s_trained"]
        assert row["tokens_per_s_generated"] * (
            row["time_rollout"] + row["time_forward"] + row["time_update"]
        ) == pytest.approx(generated, rel=0.05)
    assert [("time_eval" in row) for row in rows] == [True, False, True]  # before iteration 0, and at the end


def half(prompts, completions, **_):
    return [0.5] * len(completions)


def test_held_out_scores_of_each_reward_beside_their_weighted_sum(tmp_path):
    from fastppo.rewards.scoring import Rewards
    from fastppo.trainer.prompts.tasks import vowels_reward
    from tests.trainer.runs import untrained

    trainer = untrained(tmp_path, evaluate=True, save=False)
    trainer.rollouts.rewards = Rewards([("vowels", vowels_reward), ("half", half)], [1.0, 0.2])
    metrics = trainer.evaluate(0)
    assert metrics["eval/half/greedy"] == metrics["eval/half/pass@4"] == pytest.approx(0.5)
    for kind in ("greedy", "mean@4"):
        assert metrics[f"eval/{kind}"] == pytest.approx(metrics[f"eval/vowels/{kind}"] + 0.2 * 0.5)


def test_the_summary_of_a_resumed_run_covers_the_whole_run(tmp_path, monkeypatch, capsys):
    from fastppo.cli import main as fastppo_main

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    run = tmp_path / "run"
    argv = [
        "--device",
        "cpu",
        "--task",
        "vowels",
        "--reward",
        "fastppo.trainer.prompts.tasks:vowels_reward",
        "--reward",
        "tests.trainer.run.test_metrics:half",
        "--prompts-per-iteration",
        "2",
        "--save-every",
        "1",
    ]
    assert fastppo_main(["train", *argv, "--iterations", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"resuming {run} from checkpoint-2: iterations 2 to 2\n")
    assert "(3 iterations)" in out
    held_out = [line for line in out.splitlines() if line.startswith("held-out")]
    assert len(held_out) == 3 and all(line.endswith("(iteration 0 -> 3)") for line in held_out)
    assert "tests.trainer.run.test_metrics:half: greedy 0.500 -> 0.500" in out


def test_completions_are_logged_as_text_and_a_resume_keeps_them_in_step(tmp_path):
    from fastppo.trainer import PPOTrainer
    from tests.trainer.runs import untrained

    untrained(tmp_path, iterations=2, save_every=1, evaluate=False, log_completions=3).train()
    path = tmp_path / "run" / "completions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 0, 0, 1, 1, 1]
    assert set(rows[0]) == {"iteration", "prompt", "completion", "score", "vowels"}
    assert all(row["prompt"] and isinstance(row["completion"], str) for row in rows)
    assert rows[0]["score"] == rows[0]["vowels"]  # the task's one reward, weight 1
    trainer, start = PPOTrainer.resume(tmp_path / "run", {"iterations": 3})
    path.write_text(path.read_text() + json.dumps({**rows[-1], "iteration": 2}) + "\n")  # a run that went on
    trainer.train(start)
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_a_run_says_what_it_is_before_it_starts(tmp_path, capsys):
    from tests.trainer.runs import untrained

    untrained(tmp_path, iterations=1, evaluate=False, save=False).train()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model: ") and "parameters" in out[0] and "rewards: vowels x 1" in out[0]
    assert out[1].startswith(
        "each iteration: 8 prompts x 4 samples, up to 8 new tokens each, of 256 prompts; "
        "the first, as the sampler sees it: '"
    )
    assert out[2] == "sampler: fast: a hand-written llama forward over fastppo's KV cache; decode attention: sdpa"
    assert out[3] == "update forwards: each prompt encoded once for its samples"
    assert out[4].startswith("memory plan for one cpu device: ") and out[4].endswith(
        "(the lines: fastppo train --plan)"
    )
    padded = untrained(tmp_path / "padded", iterations=1, save=False, shared_prefix=False, max_tokens_per_microbatch=64)
    padded.train()
    out = capsys.readouterr().out.splitlines()
    assert out[3] == "update forwards: one padded row per sample (--no-shared-prefix), micro-batches of <= 64 tokens"


def test_a_model_of_one_s_own_with_the_toy_defaults_gets_a_note(tmp_path, capsys):
    from fastppo.trainer.run.summaries import toy_defaults
    from tests.trainer.runs import untrained

    trainer = untrained(tmp_path, model="my-model", lr=5e-4, iterations=1)  # the default lr, given or not
    assert toy_defaults(trainer.config)[-1] == (
        "note: lr 0.0005 and max_new_tokens 8 are the defaults for the shipped tiny "
        "model's task; a pretrained model usually wants an lr near 1e-6 and room for "
        "hundreds of new tokens (--lr, --max-new-tokens)"
    )
    tuned = untrained(tmp_path / "b", model="my-model", lr=1e-6, max_new_tokens=64, iterations=1)
    assert not toy_defaults(tuned.config)
    assert not toy_defaults(untrained(tmp_path / "c", iterations=1).config)  # the shipped task


def test_a_steps_fraction_statistics_are_the_mean_of_its_minibatches():
    from types import SimpleNamespace

    from fastppo.trainer.update.loss import step_stats

    ranks = SimpleNamespace(sum=lambda t: t)
    parts = [
        {"clipfrac": torch.tensor(0.2), "pg_loss": torch.tensor(1.0)},
        {"clipfrac": torch.tensor(0.4), "pg_loss": torch.tensor(2.0)},
    ]
    stats = step_stats(parts, "token-mean", ranks)
    assert stats["clipfrac"] == pytest.approx(0.3) and stats["pg_loss"] == pytest.approx(3.0)
    stats = step_stats(parts, "seq-mean-token-mean", ranks)
    assert stats["pg_loss"] == pytest.approx(1.5)
