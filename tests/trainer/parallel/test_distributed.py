"""Data parallelism: two gloo ranks on the CPU make the same update as one rank on all the prompts."""

import json
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

from fastppo.rollout import Rollout
from fastppo.rollout.turns import Turns
from fastppo.trainer import PPOTrainer, TrainConfig
from tests.ranks import free_port, rank_environment, spawn

FIELDS = dict(
    task="arithmetic", samples_per_prompt=4, minibatches=1, ppo_epochs=1, iterations=1, save=False, evaluate=False
)


class Shifted(Turns):
    """A batch's turns, for a call that samples the batch's rows from ``first`` on."""

    def __init__(self, turns, first: int):
        self.turns, self.first = turns, first

    def turn_ended(self, row, turn, may_continue):
        return self.turns.turn_ended(self.first + row, turn, may_continue)

    def continuation(self, row, room):
        return self.turns.continuation(self.first + row, room)

    def truncated(self, row):
        self.turns.truncated(self.first + row)


def prompt_by_prompt(generate):
    """``generate`` run one prompt at a time, seeded by the prompt's tokens, so a prompt's rows are
    the same however prompts are split across ranks (a batched decode may round differently at
    another batch size), and its samples still differ (a group of equal samples has no advantage)."""

    def rollout(prompts, turns=None, **options):
        n = options["num_samples_per_prompt"]
        parts = [
            generate(
                [prompt],
                **{**options, "seed": zlib.crc32(bytes(str(list(prompt)), "ascii"))},
                turns=None if turns is None else Shifted(turns, j * n),
            )
            for j, prompt in enumerate(prompts)
        ]
        width = max(part.response_ids.shape[1] for part in parts)

        def stack(field, fill):  # (rows, width): each part right-padded to the widest response
            return torch.cat(
                [F.pad(getattr(part, field), (0, width - getattr(part, field).shape[1]), value=fill) for part in parts]
            )

        return Rollout(
            prompt_ids=[ids for part in parts for ids in part.prompt_ids],
            response_ids=stack("response_ids", options["pad_token_id"]),
            response_mask=stack("response_mask", False),
            response_lens=torch.cat([part.response_lens for part in parts]),
            logprobs=stack("logprobs", 0.0),
            finish_reason=[reason for part in parts for reason in part.finish_reason],
        )

    return rollout


def one_update(config: TrainConfig) -> dict:
    """One iteration with rollouts identical however rows are split: the whole gradient of its
    one optimizer step, the policy's and the critic's whole weights after it (a sharded run's on
    rank 0; every rank must call this) and its metrics."""
    from torch.distributed.tensor import DTensor

    from fastppo.trainer.parallel import sharding

    trainer = PPOTrainer(config)
    trainer.rollouts.sampler.generate = prompt_by_prompt(trainer.rollouts.sampler.generate)
    models = {"policy": trainer.policy, "critic": trainer.critic}
    grads, step = {}, trainer.optimizers.step

    def step_recording_gradients(state):  # the whole gradient of the step, gathered from any shards
        for part, model in models.items():
            grads[part] = model and {
                name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                for name, p in model.named_parameters()
                if p.requires_grad
            }
        step(state)

    trainer.optimizers.step = step_recording_gradients
    metrics = trainer.iteration(0)
    whole = sharding.full_state_dict if trainer.models.sharded else (lambda m: m.state_dict())
    return {
        "weights": {part: model and whole(model) for part, model in models.items()},
        "grads": grads,
        "metrics": metrics,
    }


def _worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    config = TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate()
    result = one_update(config)
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "options",
    [  # one in the default run; the others (about 10 s each on 2 cores) with -m slow
        pytest.param({"estimator": "grpo"}, marks=pytest.mark.slow),
        {"estimator": "gae"},
        pytest.param({"estimator": "dr_grpo"}, marks=pytest.mark.slow),
        pytest.param({"estimator": "grpo", "agg": "seq-mean-token-mean"}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_two_ranks_make_the_update_of_one_rank_on_all_prompts(tmp_path, options):
    """Each loss normalised over both ranks' step: tokens, or rows (seq-mean), or rows x the budget."""
    fields = {**FIELDS, "kl_coef": 0.02, **options}
    spawn(_worker, str(tmp_path), {**fields, "prompts_per_iteration": 2})
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = one_update(
        TrainConfig.from_flat(
            {**fields, "prompts_per_iteration": 4, "out": str(tmp_path / "one"), "device": "cpu"}
        ).validate()
    )
    for g0, g1, g in zip(*(run["grads"]["policy"].values() for run in (*ranks, single))):
        torch.testing.assert_close(g0, g1)  # every rank holds the same, summed gradient ...
        torch.testing.assert_close(g0, g.cpu(), rtol=1e-4, atol=1e-6)  # ... the gradient of the whole batch
    assert ranks[0]["metrics"]["reward_mean"] == pytest.approx(single["metrics"]["reward_mean"])
    for key in ("entropy", "kl", "vf_loss"):  # the step's means over both ranks' tokens, not half of them
        if key in single["metrics"]:
            assert ranks[0]["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4), key


def _train_worker(rank, port, out_dir, fields, resume_to):
    rank_environment(rank, port)
    if resume_to:
        trainer, start = PPOTrainer.resume(f"{out_dir}/run", {"iterations": resume_to})
        trainer.train(start)
    else:
        PPOTrainer(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate()).train()
    torch.distributed.destroy_process_group()


def _threads_worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    one_update(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate())
    torch.distributed.destroy_process_group()
    threads = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(threads, f)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads of a Linux process")
def test_destroying_the_process_group_ends_its_threads(tmp_path):
    """No reference to the group may outlive destroy_process_group, or its gloo threads live on to
    interpreter shutdown, where one freeing its last all-reduce aborts the rank. Two held one here:
    torch._dynamo imported after the group existed (transformers imports it), and the trainer,
    which one_update's test hook keeps alive in a reference cycle."""
    spawn(_threads_worker, str(tmp_path), {**FIELDS, "estimator": "grpo", "prompts_per_iteration": 2})
    for rank in range(2):
        threads = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not [name for name in threads if "gloo" in name], threads


def _refused_worker(rank, port, out_dir, fields):
    from fastppo.trainer.run.lock import RunDirectoryBusy

    rank_environment(rank, port)
    try:
        PPOTrainer(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate())
        refusal = None
    except RunDirectoryBusy as error:
        refusal = str(error)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(refusal, f)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_every_rank_is_refused_a_run_directory_another_run_holds(tmp_path):
    """Rank 0 holds the lock for the job; its refusal reaches every rank, which would otherwise
    wait for rank 0 forever."""
    from tests.trainer.runs import holder

    process = holder(tmp_path / "run")
    try:
        spawn(_refused_worker, str(tmp_path), {**FIELDS, "prompts_per_iteration": 2})
    finally:
        process.communicate("")
    refusals = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert refusals[0] == refusals[1] and f"in use by a live run, pid {process.pid}" in refusals[0]


def straight_and_resumed(tmp_path, fields: dict) -> list:
    """The metrics rows of two two-rank runs of ``fields``: 3 iterations straight, and 2 then resumed to 3
    (timings aside)."""
    spawn(_train_worker, str(tmp_path / "straight"), {**fields, "iterations": 3}, 0)
    spawn(_train_worker, str(tmp_path / "split"), {**fields, "iterations": 2}, 0)
    spawn(_train_worker, str(tmp_path / "split"), None, 3)
    return [
        [
            {k: v for k, v in json.loads(line).items() if not k.startswith(("time_", "tokens_per_s"))}
            for line in (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()
        ]
        for d in ("straight", "split")
    ]


@pytest.mark.slow
def test_two_rank_resume_is_exact(tmp_path):
    rows = straight_and_resumed(tmp_path, {**FIELDS, "estimator": "grpo", "prompts_per_iteration": 2, "save": True})
    assert len(rows[0]) == 3 and rows[0] == rows[1]
    from safetensors.torch import load_file

    weights = [load_file(str(tmp_path / d / "run" / "policy" / "model.safetensors")) for d in ("straight", "split")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow
def test_two_ranks_streaming_resume_exactly_with_rows_in_flight(tmp_path):
    """At --max-staleness 1 each rank streams its share; a copy of the run resumed from checkpoint-2
    (each rank's rows of iteration 2 in flight there) ends with the straight run's weights."""
    import shutil

    fields = {**FIELDS, "estimator": "grpo", "prompts_per_iteration": 2, "save": True, "max_staleness": 1}
    spawn(_train_worker, str(tmp_path / "straight"), {**fields, "iterations": 4, "save_every": 2}, 0)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "run" / "checkpoint-4")
    spawn(_train_worker, str(tmp_path / "resumed"), None, 4)
    rows = [
        [
            {k: v for k, v in json.loads(line).items() if not k.startswith(("time_", "tokens_per_s"))}
            for line in (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()
        ]
        for d in ("straight", "resumed")
    ]
    assert rows[0] == rows[1] and any(row.get("staleness_max") == 1 for row in rows[0])
    from safetensors.torch import load_file

    weights = [load_file(str(tmp_path / d / "run" / "policy" / "model.safetensors")) for d in ("straight", "resumed")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _decoder_worker(rank, port, out_dir, fields):
    from fastppo.rollout import decoders

    rank_environment(rank, port)
    decoders._faster = lambda *args: ("modules" if rank == 1 else "lean", None)  # rank 1 alone times modules faster
    trainer = PPOTrainer(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate())
    with open(f"{out_dir}/rank{rank}.txt", "w") as f:
        f.write(f"{trainer.rollouts.sampler.decoder} {trainer.rollouts.held_out_sampler.decoder}")
    torch.distributed.destroy_process_group()


def test_every_rank_runs_the_decoder_rank_0_timed_faster(tmp_path):
    """With ``decoder="auto"``, ranks whose timings disagree still run one decoder: rank 0's."""
    spawn(_decoder_worker, str(tmp_path), {**FIELDS, "max_staleness": 1})  # a held-out sampler of its own
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["lean lean", "lean lean"]


@pytest.mark.parametrize(
    "nodes, sharded",
    [pytest.param(1, False, marks=pytest.mark.slow), (2, False), pytest.param(2, True, marks=pytest.mark.slow)],
)
def test_torchrun_end_to_end(tmp_path, nodes, sharded):
    """The real launcher: two ranks on one node, or two one-rank "nodes" meeting through torchrun's
    c10d rendezvous (as on a cluster, with both nodes on this machine), with or without --fsdp."""
    import subprocess
    import sys

    run = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={2 // nodes}"]
    launch += (
        ["--standalone"]
        if nodes == 1
        else ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=test"]
    )
    train = ["-m", "fastppo", "train", "--iterations", "3", "--device", "cpu", "--out", str(run)] + ["--fsdp"] * sharded
    processes = [
        subprocess.Popen(launch + train, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(nodes)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0] * nodes, outputs
    assert sum(out.count("mean reward: first 5 iterations") for out in outputs) == 1  # rank 0 alone reports
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]  # the last, the held-out score of the trained policy
    assert "eval/greedy" in rows[0] and set(rows[-1]) == {
        "iteration",
        "eval/greedy",
        "eval/mean@4",
        "eval/pass@4",
        "time_eval",
    }
    assert sum(out.count("held-out (64 prompts)") for out in outputs) == 1
    state = torch.load(run / "checkpoint-3" / "trainer_state.pt", weights_only=False)
    assert len(state["rng"]) == 2  # both ranks' random states
    if sharded:  # each rank's shards, and the whole model from rank 0
        assert sorted(p.name for p in (run / "checkpoint-3" / "shards").glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(run / "policy")


def rank_specific_reward(prompts, completions, **_):
    """Rank 0's groups all score 1 (no signal), rank 1's by exactness: only rank 0 is short."""
    rank = torch.distributed.get_rank()
    return [
        1.0 if rank == 0 else float(c == str(sum(map(int, p.rstrip("=").split("+")))))
        for p, c in zip(prompts, completions)
    ]


def _filter_worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    trainer = PPOTrainer(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate())
    scored = trainer.rollout(0)
    torch.save(
        {"stats": scored.stats, "drawn": trainer.state.prompts_drawn, "rows": scored.scores.numel()},
        f"{out_dir}/rank{rank}.pt",
    )
    torch.distributed.destroy_process_group()


def test_dynamic_sampling_keeps_the_ranks_in_step(tmp_path):
    """A rank that is short makes every rank sample again, so the epoch cursors stay equal."""
    fields = {
        **FIELDS,
        "estimator": "grpo",
        "prompts_per_iteration": 2,
        "filter_groups": True,
        "filter_groups_attempts": 3,
        "reward": f"{__name__}:rank_specific_reward",
    }
    spawn(_filter_worker, str(tmp_path), fields)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["stats"]["sampling_attempts"] for r in ranks] == [3.0, 3.0]  # rank 0 never fills up
    assert [r["drawn"] for r in ranks] == [3 * 2 * 2] * 2
    assert ranks[0]["stats"]["groups_informative"] == 0.0 and [r["rows"] for r in ranks] == [8, 8]
