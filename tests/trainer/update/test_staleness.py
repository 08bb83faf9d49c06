"""Rollouts that never drain (``--max-staleness``): the next iterations' prompts enter while an
iteration's last rows finish; the update on stale tokens equals a float64 decoupled-PPO reference
computed from the recorded behaviour log-probs; resume is exact with rows in flight; the metrics
say how stale; episodes run through the stream; bad values are one line."""

import json

import pytest
import torch

from fastppo.cli import main as fastppo_main
from fastppo.trainer import PPOTrainer
from fastppo.trainer.configuration.config import STALE_IS_CAP
from fastppo.trainer.update.loss import minibatch_loss, step_normalisers
from tests.trainer.runs import config, killed_and_resumed, untrained

FIELDS = dict(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=12, temperature=1.0)


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def untimed(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("time_", "tokens_per_s"))} for row in rows]


def test_stale_tokens_are_recorded_and_reported(tmp_path):
    trainer = untrained(tmp_path, max_staleness=1, iterations=3, **FIELDS)
    history = trainer.train()
    assert history[0]["staleness_max"] == 0 and history[0]["staleness/share_0"] == 1
    assert any(h["staleness_max"] == 1 and 0 < h["staleness/share_1"] < 1 for h in history[1:])
    for h in history:
        assert h["staleness/share_0"] + h["staleness/share_1"] == pytest.approx(1)
        assert h["staleness_mean"] == pytest.approx(h["staleness/share_1"])
        assert 0 < h["decode_rows_per_step"] <= 16 and 0 <= h["decode_sparse_steps"] <= 1
        assert "rollout_is_weight" in h  # the correction is on, at its default cap
    assert trainer.rollouts.streaming.stream.in_flight == 0  # the run's last iteration drained it


@pytest.mark.parametrize("epochs,cap", [(1, None), (2, None), (1, 1.001)], ids=["1 epoch", "2 epochs", "a low cap"])
def test_the_stale_update_equals_a_float64_decoupled_ppo_reference(tmp_path, epochs, cap):
    """Iteration 1 of a run at staleness 1: its batch holds tokens drawn by the weights before
    iteration 0's update. Its loss and gradient equal, in float64, the token mean of
    -min(r A w, clip(r, 1 - eps, 1 + eps) A w), r the ratio of the policy to the policy at the
    update's start and w = min(pi_start / pi_behaviour, cap), pi_behaviour the sampler's recorded
    log-probs. One epoch: the update's own forward is the policy at its start (every r is 1); two:
    the start's log-probs are a pass of their own, and the policy has moved a step from them. The
    cap is the default, ``STALE_IS_CAP``, or one low enough that some weights reach it."""
    fields = dict(max_staleness=1, iterations=2, clip_eps=0.1, ppo_epochs=epochs, rollout_is_cap=cap, **FIELDS)
    trainer = untrained(tmp_path, **fields)
    assert trainer.config.rollout_is_cap == (cap or STALE_IS_CAP)
    trainer.iteration(0)
    scored = trainer.rollout(1)
    assert (scored.rollout.versions[scored.rollout.response_mask] == 0).any()  # stale tokens
    batch = trainer.prepare(scored.rollout, scored.scores)
    policy, on_policy = trainer.policy, epochs == 1
    assert (batch.old_logprobs is None) == on_policy
    if not on_policy:
        with torch.no_grad():  # a step away from the update's start, so some ratios clip
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.03)
    policy.train()
    tokens, whole = step_normalisers([batch], trainer.config, trainer.ranks)
    loss, _ = minibatch_loss(batch, trainer.models, trainer.config, 0.0, tokens, on_policy, whole)
    grads = torch.autograd.grad(loss, list(policy.parameters()))

    reference = type(policy)(policy.config).double()
    reference.load_state_dict(policy.state_dict())
    params = list(reference.parameters())
    logp = []
    for row in range(batch.mask.shape[0]):  # one forward per row, no padding
        P, n = int(batch.prompt_lens[row]), int(batch.lens[row])
        ids = batch.input_ids[row, : P + n][None]
        logits = reference(input_ids=ids).logits[0, P - 1 : P - 1 + n] / trainer.config.rollout.temperature
        own = torch.zeros(batch.mask.shape[1], dtype=torch.float64)
        own[:n] = logits.log_softmax(-1).gather(1, ids[0, P:, None])[:, 0]
        logp.append(own)
    logp, mask = torch.stack(logp), batch.mask
    old = logp.detach() if on_policy else batch.old_logprobs.double()
    behaviour = batch.sampler_logprobs.double()
    ratio = torch.exp(logp - old)
    weight = torch.exp(old - behaviour).clamp(max=cap or STALE_IS_CAP)
    assert cap is None or (torch.exp(old - behaviour)[mask] > cap).any()  # the cap is met
    advantage = batch.advantages.double() * weight
    eps = 0.1
    per_token = -torch.minimum(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage)
    expected = (per_token * mask).sum() / mask.sum()
    expected_grads = torch.autograd.grad(expected, params)
    assert ((weight[mask] - 1).abs() > 1e-3).any()
    assert on_policy or ((ratio[mask] - 1).abs() > eps).any()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        assert (got.double() - want).norm() / want.norm().clamp(min=1e-12) < 1e-4


def test_every_rank_streams_with_a_seed_of_its_own(tmp_path, monkeypatch):
    """Ranks that drew alike would draw the same random numbers for their rows: one seed per rank."""
    from types import SimpleNamespace

    trainer = untrained(tmp_path, max_staleness=1, iterations=2, **FIELDS)
    streaming, seeds = trainer.rollouts.streaming, []
    monkeypatch.setattr(trainer.rollouts.sampler, "stream", lambda **options: seeds.append(options["seed"]))
    for rank in range(4):
        monkeypatch.setattr(trainer.rollouts, "ranks", SimpleNamespace(world=4, rank=rank))
        streaming._start()
    assert len(set(seeds)) == 4, seeds


@pytest.mark.parametrize("ahead", [1, 2])
def test_resume_with_rows_in_flight_is_exact(tmp_path, ahead):
    """4 iterations at staleness ``ahead``, killed after checkpoint-2 (rows of iterations 3 and on in
    flight) and resumed == 4 straight: the same metrics, bitwise weights; the held-out evaluation
    runs on its own sampler beside the stream."""
    fields = dict(FIELDS, max_staleness=ahead, iterations=4, save_every=2, evaluate=True, eval_every=2)
    straight = PPOTrainer(config(tmp_path / "a", **fields))
    straight.train()
    resumed = killed_and_resumed(PPOTrainer(config(tmp_path / "b", **fields)), tmp_path / "b" / "run")
    rows = [metrics(tmp_path / d / "run") for d in ("a", "b")]
    assert untimed(rows[0]) == untimed(rows[1])
    assert any(row.get("staleness_max") for row in rows[0]) and any("eval/greedy" in row for row in rows[0][1:])
    for a, b in zip(straight.policy.state_dict().values(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b)


def test_a_resume_that_changes_max_staleness_warns_and_samples_the_batches_in_flight_again(tmp_path):
    killed = PPOTrainer(config(tmp_path, max_staleness=1, iterations=3, save_every=2, **FIELDS))
    run_iteration = killed.iteration
    killed.iteration = lambda i: (_ for _ in ()).throw(KeyboardInterrupt) if i == 2 else run_iteration(i)
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    in_flight = killed.rollouts.streaming.batches[0][0]  # iteration 2's prompts, drawn at iteration 1
    for changed in (2, 0):
        with pytest.warns(UserWarning) as said:
            resumed, start = PPOTrainer.resume(tmp_path / "run", {"max_staleness": changed})
        said = [str(warning.message) for warning in said]
        assert any("batch(es) in flight are sampled again from their prompts" in text for text in said)
        dropped = f"the changed max_staleness drops the importance weights' cap ({STALE_IS_CAP} -> None;"
        assert any(dropped in text for text in said) == (changed == 0), said
        assert start == 2
    assert list(resumed.rollouts.waiting) == [in_flight] and resumed.rollouts.streaming is None
    history = resumed.train(start)
    assert [h["iteration"] for h in history] == [2] and not resumed.rollouts.waiting


def test_a_finished_run_resumed_for_longer_warns_that_it_drained_at_its_end(tmp_path):
    PPOTrainer(config(tmp_path, max_staleness=1, iterations=2, **FIELDS)).train()
    with pytest.warns(UserWarning, match="checkpoint-2 is the run's last: its rollouts drained there"):
        resumed, start = PPOTrainer.resume(tmp_path / "run", {"iterations": 3})
    assert start == 2 and [h["iteration"] for h in resumed.train(start)] == [2]


@pytest.mark.parametrize(
    "args,match",
    [
        (["--max-staleness", "-1"], "max_staleness must be >= 0"),
        (["--max-staleness", "1.5"], "--max-staleness: invalid int value"),
        (["--max-staleness", "4", "--iterations", "3"], "max_staleness must be at most iterations"),
        (["--max-staleness", "1", "--filter-groups"], "max_staleness must be at most iterations, and without"),
    ],
)
def test_bad_max_staleness_is_one_line(tmp_path, capsys, monkeypatch, args, match):
    monkeypatch.chdir(tmp_path)
    try:
        code = fastppo_main(["train", *args])
    except SystemExit as stop:  # argparse's own refusal, of a value that is no int
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_a_kv_budget_too_small_for_a_batch_in_the_stream_is_one_line(tmp_path, capsys):
    """The budget holds one row at the cap, so the sampler is made; the stream's first batch, whose
    groups of samples it cannot admit, is refused as at K = 0, naming the option."""
    args = ["train", "--out", str(tmp_path / "run"), "--iterations", "1", "--max-staleness", "1"]
    assert fastppo_main([*args, "--rollout-kv-memory", "2e-5"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("fastppo train: error: --rollout-kv-memory 2e-05 is too small")
    assert "samples of the longest prompt" in last and "smallest that works is" in last
