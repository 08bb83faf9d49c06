"""The trainer end to end on the CPU: the command, learning, the estimators, config and bad input."""

import json

import pytest
import torch

from fastppo.cli import main as fastppo_main
from fastppo.trainer import PPOTrainer
from fastppo.trainer.configuration.arguments import from_arguments
from fastppo.trainer.prompts.tasks import vowels_reward
from fastppo.trainer.update.optimizers import lr_factor
from tests.trainer.runs import config, killed_and_resumed, mean_reward, untrained


def test_command_runs_end_to_end_and_saves_a_loadable_policy(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    assert fastppo_main(["train", "--iterations", "3", "--out", str(out), "--estimator", "gae"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the held-out evaluation: before the first iteration, and after the last in a row of its own
    rows, final = rows[:-1], rows[-1]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert set(final) == {"iteration", "eval/greedy", "eval/mean@4", "eval/pass@4", "time_eval"}
    assert final["iteration"] == 3
    assert "eval/greedy" in rows[0] and "eval/greedy" not in rows[1]
    for key in (
        "reward_mean",
        "reward_std",
        "approx_kl",
        "clipfrac",
        "entropy",
        "vf_loss",
        "response_length",
        "stop_rate",
        "logprob_mismatch",
        "time_rollout",
        "time_forward",
        "time_update",
        "tokens_per_s_generated",
        "tokens_per_s_trained",
    ):
        assert all(key in r for r in rows), key
    assert json.loads((out / "config.json").read_text())["estimator"] == "gae"
    policy = AutoModelForCausalLM.from_pretrained(out / "policy")
    tokenizer = AutoTokenizer.from_pretrained(out / "policy")
    assert policy.config.vocab_size == len(tokenizer)
    from fastppo.trainer.modeling.critic import Critic

    critic = Critic.from_pretrained(out / "critic")
    ids = torch.tensor([[3, 4, 5]], device=critic.head.weight.device)
    assert critic(ids, torch.ones_like(ids)).shape == (1, 3)
    assert "explained_variance" in rows[-1]
    printed = capsys.readouterr().out
    assert "mean reward: first 5 iterations" in printed and "held-out (64 prompts): greedy " in printed


@pytest.mark.parametrize("estimator,kl_coef", [("grpo", 0.0), ("rloo", 0.05), ("gae", 0.02)])
def test_reward_rises_from_an_untrained_model(tmp_path, estimator, kl_coef):
    history = untrained(tmp_path, estimator=estimator, kl_coef=kl_coef, iterations=30, save=False).train()
    first, last = mean_reward(history, lambda h: h[:5]), mean_reward(history, lambda h: h[-5:])
    assert last > first + 0.2, (first, last)
    assert all(h["skipped_steps"] == 0 for h in history)


def test_rollouts_through_fewer_slots_than_rows_learn(tmp_path):
    """An iteration's 32 rows through a sampler of 6 slots: the rows wait for free ones, and the
    sampler's log-probs still equal the trainer's."""
    trainer = untrained(tmp_path, rollout_batch_size=6, iterations=30, save=False)
    assert trainer.rollouts.sampler.max_batch_size == 6 and trainer.rollouts.sampler.cached.cache.slots == 6
    history = trainer.train()
    assert mean_reward(history, lambda h: h[-5:]) > mean_reward(history, lambda h: h[:5]) + 0.2
    assert max(h["logprob_mismatch"] for h in history) < 1e-4


def test_the_shipped_default_learns_its_arithmetic(tmp_path):
    history = PPOTrainer(config(tmp_path, iterations=150, save=False)).train()
    first, last = mean_reward(history, lambda h: h[:5]), mean_reward(history, lambda h: h[-5:])
    assert 0.1 < first < 0.6 and last > first + 0.1, (first, last)


def test_recomputed_logprobs_use_the_rollout_temperature(tmp_path):
    trainer = PPOTrainer(config(tmp_path, temperature=0.7, save=False))
    metrics = trainer.iteration(0)
    assert metrics["logprob_mismatch"] < 1e-4  # sampler and trainer agree token by token


def test_stop_token_is_in_the_mask_and_never_stopping_is_penalised(tmp_path):
    trainer = PPOTrainer(config(tmp_path, max_new_tokens=6, no_stop_penalty=-1.0, save=False))
    eos = trainer.tokenizer.eos_token_id
    scored = trainer.rollout(0)
    rollout, scores, raw, no_stop = scored.rollout, scored.scores, scored.raw, scored.no_stop
    torch.testing.assert_close(scores, raw - no_stop.float())
    stopped = [i for i, f in enumerate(rollout.finish_reason) if f == "stop"]
    for i in stopped:
        n = int(rollout.response_lens[i])
        assert rollout.response_ids[i, n - 1] == eos and rollout.response_mask[i, n - 1]
    batch = trainer.prepare(rollout, scores)
    assert torch.equal(batch.mask, rollout.response_mask)


def test_dropout_is_off(tmp_path):
    from torch import nn

    from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy

    tokenizer = char_tokenizer()
    policy = tiny_policy(tokenizer, seed=0)
    policy.model.layers[0].mlp.dropout = nn.Dropout(0.3)
    PPOTrainer(config(tmp_path, task="vowels", save=False), policy=policy, tokenizer=tokenizer)
    assert all(m.p == 0 for m in policy.modules() if isinstance(m, nn.Dropout))


def test_config_file_and_command_line(tmp_path):
    import argparse

    from fastppo.trainer.configuration.arguments import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--samples-per-prompt" in parser.format_help() and "GRPO" in parser.format_help()
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 0.01\nestimator = "rloo"\n')
    cfg = from_arguments(parser.parse_args(["--config", str(toml), "--lr", "0.02", "--critic", "false"]))
    assert cfg.optim.lr == 0.02 and cfg.algo.estimator == "rloo" and cfg.model.critic is False
    (tmp_path / "c.json").write_text(json.dumps({"iterations": 7}))
    assert from_arguments(parser.parse_args(["--config", str(tmp_path / "c.json")])).run.iterations == 7


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(lr=-1.0), r"config field lr must be in \(0, 1\]"),
        (dict(clip_eps=0.0), r"config field clip_eps must be in \(0, 1\)"),
        (dict(minibatches=3), "config field minibatches must be >= 1 and divide"),
        (dict(estimator="ppo2"), "config field estimator must be one of"),
        (dict(estimator="gae", critic=False), "config field critic must be on for estimator=gae"),
        (dict(learning_rate=1.0), r"unknown config field\(s\): learning_rate"),
        (dict(critic_init="reward_model"), "config field critic_init reward_model needs --reward-model"),
        (dict(task="chess"), "config field task must be one of"),
    ],
)
def test_bad_config_is_rejected_naming_the_field(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **fields)


def test_bad_prompts_file_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ab"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        PPOTrainer(config(tmp_path, prompts=str(path), reward="fastppo.trainer.prompts.tasks:vowels_reward"))
    path.write_text('{"prompt": "ab"}\n{"question": "cd"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: the row has no 'prompt' field"):
        PPOTrainer(config(tmp_path, prompts=str(path), reward="fastppo.trainer.prompts.tasks:vowels_reward"))


def test_user_prompts_and_reward_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "target": "a"}) for p in ["ab", "cde", "fg", "hij"]))
    seen = {}

    def reward(prompts, completions, target):
        seen["target"] = target
        return [float(c.count(t)) for c, t in zip(completions, target)]

    trainer = PPOTrainer(config(tmp_path, prompts=str(path), prompts_per_iteration=4, save=False), reward_fn=reward)
    trainer.iteration(0)
    assert seen["target"] == ["a"] * 32  # 4 prompts x 8 samples


@pytest.mark.parametrize(
    "reward,match",
    [
        (lambda prompts, completions, **_: 1 / 0, "raised ZeroDivisionError"),
        (lambda prompts, completions, **_: [1.0], "returned 1 scores for 128 completions"),
        (lambda prompts, completions, **_: [float("inf")] * len(completions), "scores must be finite"),
    ],
)
def test_reward_faults_are_clear(tmp_path, reward, match):
    trainer = PPOTrainer(config(tmp_path, save=False), reward_fn=reward)
    with pytest.raises((RuntimeError, ValueError), match=match):
        trainer.iteration(0)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="is not a Hugging Face model directory"):
        PPOTrainer(config(tmp_path, model=str(tmp_path / "nowhere")))


def test_vowels_reward():
    assert vowels_reward([], ["aeb", "", "zz"]) == [2 / 3, 0.0, 0.0]


def test_the_default_model_script_makes_a_loadable_model(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "scripts/make_default_model.py", "--steps", "5", "--out", str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sampled accuracy" in result.stdout
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 2


def test_adaptive_kl_coefficient():
    from fastppo.trainer.run.state import TrainerState

    fixed = TrainerState(kl_coef=0.1)
    fixed.adapt_kl(5.0, 100, target=None, horizon=1000)
    assert fixed.kl_coef == 0.1
    adaptive = TrainerState(kl_coef=0.1)
    adaptive.adapt_kl(1.0, 100, target=0.05, horizon=1000)  # far above target: the error is clipped to +0.2
    assert adaptive.kl_coef == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    adaptive.adapt_kl(0.0, 100, target=0.05, horizon=1000)  # below target
    assert adaptive.kl_coef < 0.1 * 1.02


def test_kl_in_the_loss_with_an_adaptive_coefficient(tmp_path):
    trainer = untrained(tmp_path, kl_coef=0.1, kl_target=0.01, kl_horizon=100, iterations=4, save=False)
    history = trainer.train()
    coefs = [h["kl_coef"] for h in history]
    assert coefs[0] == 0.1 and len(set(coefs)) > 1 and all("rollout_kl" in h and "kl" in h for h in history)


def test_reward_model(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from fastppo.trainer.modeling.default import char_tokenizer

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    scorer = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    scorer.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    trainer = untrained(tmp_path, reward_model=str(tmp_path / "rm"), save=False)
    metrics = trainer.iteration(0)
    assert metrics["reward_std"] > 0 and torch.isfinite(torch.tensor(metrics["reward_mean"]))
    # a critic that starts from the reward model: its values at first are the reward model's scores
    trainer = untrained(
        tmp_path, reward_model=str(tmp_path / "rm"), estimator="gae", critic_init="reward_model", save=False
    )
    ids = torch.tensor([[5, 6, 7]], device=trainer.device)
    expected = scorer.to(trainer.device)(input_ids=ids).logits[0, 0]
    torch.testing.assert_close(trainer.critic(ids, torch.ones_like(ids))[0, -1], expected, rtol=1e-4, atol=1e-5)
    trainer.iteration(0)
    with pytest.raises(ValueError, match="--reward-model .* is not a Hugging Face model directory"):
        untrained(tmp_path, reward_model=str(tmp_path / "nothing"))


def test_periodic_checkpoints(tmp_path):
    untrained(tmp_path, iterations=4, save_every=2).train()
    assert (tmp_path / "run" / "checkpoint-2" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoint-4" / "trainer_state.pt").is_file()  # the end is a checkpoint too


def test_plot_and_tensorboard_of_a_run(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    untrained(tmp_path, iterations=2, save=False, evaluate=True, eval_samples=2).train()  # a panel of held-out scores
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    png = tmp_path / "run" / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # written at the end of the run
    assert fastppo_main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 1000


def test_gradient_accumulation_is_normalised_by_the_global_token_count(tmp_path):
    """Two minibatches accumulated into one step give the gradient of the whole batch."""
    results = []
    for minibatches, accumulation in ((1, 1), (2, 2)):
        trainer = untrained(tmp_path, minibatches=minibatches, grad_accumulation=accumulation, save=False)
        scored = trainer.rollout(0)
        rollout, scores = scored.rollout, scored.scores
        steps = []
        trainer.optimizers.step = lambda state: steps.append([p.grad.clone() for p in trainer.policy.parameters()])
        trainer.update(trainer.prepare(rollout, scores), 0)
        assert len(steps) == 1
        results.append(steps[0])
    for whole, accumulated in zip(*results):
        torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before `optimizer.step()`")
def test_non_finite_gradients_skip_the_step(tmp_path):
    trainer = untrained(tmp_path, save=False)
    head = trainer.policy.get_output_embeddings().weight
    before = head.detach().clone()
    hook = head.register_hook(lambda grad: grad * float("nan"))
    with pytest.warns(UserWarning, match="optimizer step 1 skipped: the gradient is not finite"):
        metrics = trainer.iteration(0)
    hook.remove()
    assert metrics["skipped_steps"] == 1 and torch.equal(head.detach(), before)


def test_cosine_schedule(tmp_path):
    trainer = untrained(tmp_path, lr_schedule="cosine", warmup_iterations=2, iterations=10, save=False)
    factors = [lr_factor(i, trainer.config.optim, trainer.config.run.iterations) for i in range(10)]
    assert (
        factors[:3] == [0.5, 1.0, 1.0]
        and factors[-1] < 0.1
        and factors == sorted(factors[:2]) + sorted(factors[2:], reverse=True)
    )


def test_saves_are_atomic_and_old_checkpoints_pruned(tmp_path):
    from fastppo.trainer.run.directory import save_atomically

    trainer = untrained(tmp_path, iterations=6, save_every=2, keep_checkpoints=1)
    trainer.train()
    run = tmp_path / "run"
    assert [p.name for p in sorted(run.glob("checkpoint-*"))] == ["checkpoint-6"]  # 2 and 4 pruned
    assert not list(run.glob(".*tmp*")) and not list(run.glob(".*old*"))

    def crash(directory):
        trainer.save(directory)
        raise KeyboardInterrupt  # a crash in the middle of a save

    before = sorted(p.relative_to(run) for p in (run / "checkpoint-6").rglob("*"))
    with pytest.raises(KeyboardInterrupt):
        save_atomically(run / "checkpoint-6", crash)
    assert sorted(p.relative_to(run) for p in (run / "checkpoint-6").rglob("*")) == before  # intact
    with pytest.raises(KeyboardInterrupt):
        save_atomically(run / "checkpoint-8", crash)
    assert not (run / "checkpoint-8").exists() and not list(run.glob(".*tmp*"))


def untimed(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("time_", "tokens_per_s"))} for row in rows]


@pytest.mark.parametrize("estimator,kl_coef", [("grpo", 0.05), ("gae", 0.02)])
def test_resume_is_exact(tmp_path, estimator, kl_coef):
    """A 4-iteration run killed after its checkpoint at 2 and resumed == 4 iterations straight: the
    same metrics, the same learning rates, bitwise weights."""
    # the run's own model: a resumed trainer rebuilds its reference from the config, as a run does;
    # a warm-up and a cosine schedule, so a schedule restarted on resume would show
    fields = dict(
        estimator=estimator,
        kl_coef=kl_coef,
        kl_target=0.01,
        minibatches=2,
        ppo_epochs=2,
        prompts_per_iteration=4,
        samples_per_prompt=4,
        lr_schedule="cosine",
        warmup_iterations=1,
        iterations=4,
        save_every=2,
    )
    straight = PPOTrainer(config(tmp_path / "a", **fields))
    straight.train()
    resumed = killed_and_resumed(PPOTrainer(config(tmp_path / "b", **fields)), tmp_path / "b" / "run")
    rows = [
        [json.loads(line) for line in (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()]
        for d in ("a", "b")
    ]
    assert untimed(rows[0]) == untimed(rows[1])
    lr = straight.config.optim.lr
    assert [row["lr"] for row in rows[1]] == pytest.approx(
        [lr * lr_factor(i, straight.config.optim, straight.config.run.iterations) for i in range(4)]
    )
    assert len({row["lr"] for row in rows[1]}) == 3  # 1, 0.75 and 0.25 of lr: the resumed half is not a restart
    for a, b in zip(straight.policy.state_dict().values(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b)


def test_a_checkpoint_of_an_older_format_is_refused_naming_its_format(tmp_path, capsys):
    """fastppo 0.1 wrote the trainer state as loose keys and no format number: it is refused in one
    line, never half-loaded or skipped for a still older checkpoint."""
    from fastppo.trainer.run.checkpoint import STATE_FILE, CheckpointFormat
    from fastppo.trainer.run.directory import MANIFEST_FILE, write_manifest

    PPOTrainer(config(tmp_path, iterations=2, save_every=1)).train()
    run = tmp_path / "run"
    for number in (1, 2):
        path = run / f"checkpoint-{number}" / STATE_FILE
        saved = torch.load(path, weights_only=False)
        old = {k: v for k, v in saved.items() if k not in ("format", "trainer_state")}
        torch.save({**old, **saved["trainer_state"]}, path)
        (path.parent / MANIFEST_FILE).unlink()
        write_manifest(run / f"checkpoint-{number}")
    with pytest.raises(
        CheckpointFormat,
        match=r"checkpoint-2 is a checkpoint of format 1 \(fastppo 0.1\); this "
        r"fastppo reads format 2 only",
    ):
        PPOTrainer.resume(run, {"iterations": 3})
    capsys.readouterr()
    assert fastppo_main(["train", "--resume", str(run), "--iterations", "3"]) == 2  # before any model loads
    assert capsys.readouterr().err.count("\n") == 1


def test_resume_refuses_changed_math_and_skips_a_broken_checkpoint(tmp_path):
    untrained(tmp_path, iterations=4, save_every=2).train()
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="cannot resume .* with changed lr, temperature; only"):
        PPOTrainer.resume(run, {"lr": 0.5, "temperature": 0.5, "iterations": 6})
    (run / ".checkpoint-6.tmp-123" / "policy").mkdir(parents=True)  # a save a crash cut short
    assert PPOTrainer.resume(run, {"iterations": 6})[1] == 4
    (run / "checkpoint-4" / "policy" / "model.safetensors").write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="skipping .*checkpoint-4"):
        _, start = PPOTrainer.resume(run, {"iterations": 6})
    assert start == 2
    (run / "checkpoint-2" / "trainer_state.pt").unlink()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no complete checkpoint"):
        PPOTrainer.resume(run, {})


def test_a_signal_checkpoints_and_says_how_to_resume(tmp_path):
    import os
    import signal

    from fastppo.trainer.run.signals import TrainingInterrupted

    trainer = untrained(tmp_path, iterations=10)
    real = trainer.iteration

    def interrupted(i):
        if i == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-iteration; the iteration still finishes
        return real(i)

    trainer.iteration = interrupted
    with pytest.raises(TrainingInterrupted, match=r"stopped by SIGTERM after iteration 1.*--resume"):
        trainer.train()
    assert (tmp_path / "run" / "checkpoint-2" / "trainer_state.pt").is_file()
    assert PPOTrainer.resume(tmp_path / "run")[1] == 2


def test_a_checkpoint_restores_the_global_generators_a_reward_may_use(tmp_path):
    import random

    import numpy

    trainer = untrained(tmp_path, save=False)
    trainer.save_checkpoint(tmp_path / "ckpt", next_iteration=0)
    expected = (random.random(), numpy.random.rand(), torch.rand(()))
    random.random(), numpy.random.rand(), torch.rand(())  # the run moves on
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert (random.random(), numpy.random.rand(), torch.rand(())) == expected


def test_a_reward_crash_leaves_the_last_checkpoint_resumable(tmp_path):
    from fastppo.rewards.scoring import Rewards
    from fastppo.trainer.prompts.tasks import vowels_reward

    def flaky(prompts, completions, **fields):
        calls.append(1)
        if len(calls) == 3:
            raise ConnectionError("reward server went away")
        return vowels_reward(prompts, completions, **fields)

    calls = []
    trainer = untrained(tmp_path, iterations=4, save_every=1)
    trainer.rollouts.rewards = Rewards([("flaky", flaky)])
    with pytest.raises(RuntimeError, match="raised ConnectionError"):
        trainer.train()
    run = tmp_path / "run"
    assert [p.name for p in sorted(run.glob("checkpoint-*"))] == ["checkpoint-1", "checkpoint-2"]
    assert PPOTrainer.resume(run)[1] == 2


def test_ctrl_c_on_the_command_checkpoints_and_exits_non_zero(tmp_path):
    """The real command in a subprocess, interrupted by SIGINT once it is training."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "fastppo",
        "train",
        "--iterations",
        "100000",
        "--save-every",
        "100000",
        "--device",
        "cpu",
        "--out",
        str(run),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "--resume" in out + err
    (checkpoint,) = run.glob("checkpoint-*")
    assert PPOTrainer.resume(run)[1] == int(checkpoint.name.split("-")[1]) >= 2


def test_a_reward_or_tool_seeding_torchs_generator_changes_nothing_the_run_draws(tmp_path):
    """The update's minibatch order is the run's own draw: a reward (or tool) that calls
    ``torch.manual_seed`` leaves the rollouts, and so the weights, as they were."""
    from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy

    def reseeding(prompts, completions, **fields):
        torch.manual_seed(len(calls))
        calls.append(1)
        return vowels_reward(prompts, completions, **fields)

    weights = []
    for reward in (vowels_reward, reseeding):
        calls, tokenizer = [], char_tokenizer()
        fields = dict(task="vowels", lr=1e-3, prompts_per_iteration=4, samples_per_prompt=2, minibatches=4)
        run = config(tmp_path / reward.__name__, save=False, iterations=2, ppo_epochs=2, **fields)
        trainer = PPOTrainer(run, policy=tiny_policy(tokenizer, seed=0), tokenizer=tokenizer, reward_fn=reward)
        trainer.train()
        weights.append(torch.cat([p.detach().flatten() for p in trainer.policy.parameters()]))
    assert calls, "the reseeding reward never ran"
    assert torch.equal(weights[0], weights[1])
