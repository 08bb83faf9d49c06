"""FSDP2 sharding on two gloo ranks: the update, the resume, the saved model and the memory of one
unsharded rank that sees the whole batch."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastppo.bench.sharding import live_tensor_bytes, resident_bytes
from fastppo.errors import UsageError
from fastppo.trainer import PPOTrainer, TrainConfig
from fastppo.trainer.modeling.critic import Critic
from tests.oracles import relative_error
from tests.ranks import rank_environment, spawn

from .test_distributed import FIELDS, _train_worker, one_update, prompt_by_prompt


def _update_worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    config = TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu", "fsdp": True}).validate()
    result = one_update(config)
    if rank == 0:
        torch.save(result, f"{out_dir}/sharded.pt")
    leave()


def completion_length(prompts, completions, **_):
    """A reward that any model earns unevenly: a random one's samples differ in length."""
    return [len(c) / 8 for c in completions]


def tied_model(directory: Path) -> str:
    """A random tiny Llama whose LM head is its embedding table, with the shipped tokenizer."""
    from fastppo.trainer.modeling.default import tiny_policy
    from fastppo.trainer.modeling.loading import load_policy

    _, tokenizer = load_policy(None)
    model = tiny_policy(tokenizer, seed=0)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize(
    "options",
    [  # two in the default run; the others (about 9 s each on 2 cores) with -m slow
        pytest.param({"estimator": "grpo"}, marks=pytest.mark.slow),
        pytest.param({"estimator": "gae"}, marks=pytest.mark.slow),
        {"estimator": "grpo", "lora_rank": 4},
        pytest.param({"estimator": "gae", "gradient_checkpointing": True}, marks=pytest.mark.slow),
        pytest.param({"estimator": "grpo", "tied": True}, marks=pytest.mark.slow),
        {"estimator": "gae", "kl_coef": 0.05, "max_tokens_per_microbatch": 40},  # ranks agree on the parts
        {"estimator": "grpo", "rollout_tp": 2},  # the two ranks decode their prompts together, split
        pytest.param({"estimator": "gae", "lora_rank": 4, "rollout_tp": 2}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_two_sharded_ranks_make_the_update_of_one_unsharded_rank(tmp_path, options):
    options = dict(options)
    if options.pop("tied", False):  # the head's gradient and the embedding's are one
        options.update(model=tied_model(tmp_path / "tied"), reward=f"{__name__}:completion_length")
    fields = {**FIELDS, "kl_coef": 0.02, **options}
    spawn(_update_worker, str(tmp_path), {**fields, "prompts_per_iteration": 2})
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=False)
    fields.pop("rollout_tp", None)  # one rank decodes whole
    single = one_update(
        TrainConfig.from_flat(
            {**fields, "prompts_per_iteration": 4, "out": str(tmp_path / "one"), "device": "cpu"}
        ).validate()
    )
    assert any(g.abs().sum() > 0 for g in single["grads"]["policy"].values())  # a step that moves the policy
    for part, expected in single["grads"].items():  # the step's summed gradient, within the numerics policy's 1e-5
        for name, value in (expected or {}).items():
            assert relative_error(sharded["grads"][part][name], value) <= 1e-5, name
    for part, expected in single["weights"].items():  # then the weights it made
        if expected is not None:
            assert_same_weights(sharded["weights"][part], expected, single["grads"][part])
    assert sharded["metrics"]["reward_mean"] == pytest.approx(single["metrics"]["reward_mean"])


@pytest.mark.slow
def test_two_sharded_ranks_resumed_after_two_iterations_equal_four_straight(tmp_path):
    """Bitwise: the same world size reduces in the same order, and every rank's random states, the
    shards of the weights and of both AdamW states come back."""
    fields = {**FIELDS, "estimator": "gae", "kl_coef": 0.02, "prompts_per_iteration": 2, "save": True, "fsdp": True}
    spawn(_train_worker, str(tmp_path / "straight"), {**fields, "iterations": 4}, 0)
    spawn(_train_worker, str(tmp_path / "split"), {**fields, "iterations": 2}, 0)
    assert (tmp_path / "split" / "run" / "checkpoint-2" / "shards" / ".metadata").is_file()
    spawn(_train_worker, str(tmp_path / "split"), None, 4)
    rows = [
        [
            {k: v for k, v in json.loads(line).items() if not k.startswith(("time_", "tokens_per_s"))}
            for line in (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()
        ]
        for d in ("straight", "split")
    ]
    assert len(rows[0]) == 4 and rows[0] == rows[1]
    for part, name in (("policy", "model.safetensors"), ("critic", "model.safetensors"), ("critic", Critic.HEAD_FILE)):
        weights = [load_file(str(tmp_path / d / "run" / part / name)) for d in ("straight", "split")]
        assert weights[0].keys() == weights[1].keys()
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), (part, name)


def _save_worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    trained(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu", "fsdp": True}).validate())
    leave()


def trained(config: TrainConfig) -> None:
    """``config``'s run, its rollouts identical however rows are split."""
    trainer = PPOTrainer(config)
    trainer.rollouts.sampler.generate = prompt_by_prompt(trainer.rollouts.sampler.generate)
    trainer.train()


def leave() -> None:
    """End a sharded worker: the process group destroyed, then an exit without the interpreter's
    teardown (see ``fastppo.trainer.cli.exit_after_sharding``)."""
    from fastppo.trainer.cli import exit_after_sharding

    torch.distributed.destroy_process_group()
    exit_after_sharding(0)


def assert_same_weights(got: dict, expected: dict, grads: dict = None) -> None:
    """Equal within 1e-5: a wrong step would differ by about lr (5e-4). AdamW's first step is about
    lr x g / (|g| + eps), so an entry whose gradient is within a few hundred eps (1e-8) of 0 moves by
    a share of lr that a rounding of g changes (each rank sums its tokens in another order, and
    lays out other rows, whose attention may be split or dense): given the step's gradients
    (``grads``, held to 1e-5 of their norm by the caller), such entries are held to a step."""
    assert got.keys() == expected.keys()
    for name, value in got.items():
        want = expected[name]
        if grads is not None and name in grads:
            rounding = grads[name].abs() < 3e-6
            assert bool(((value - want)[rounding].abs() <= 5e-4).all()), name
            value, want = value[~rounding], want[~rounding]
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow  # two end-to-end runs, ~15 s
def test_the_consolidated_models_load_with_from_pretrained_and_equal_the_unsharded_run(tmp_path):
    from transformers import AutoModelForCausalLM

    fields = {**FIELDS, "estimator": "gae", "kl_coef": 0.02, "iterations": 2, "save": True, "save_dtype": "float32"}
    spawn(_save_worker, str(tmp_path / "sharded"), {**fields, "prompts_per_iteration": 2})
    trained(
        TrainConfig.from_flat(
            {**fields, "prompts_per_iteration": 4, "out": str(tmp_path / "one" / "run"), "device": "cpu"}
        ).validate()
    )
    policies = [AutoModelForCausalLM.from_pretrained(tmp_path / d / "run" / "policy") for d in ("sharded", "one")]
    assert type(policies[0]).__name__ == "LlamaForCausalLM"  # not FSDP's subclass of it
    critics = [Critic.from_pretrained(tmp_path / d / "run" / "critic") for d in ("sharded", "one")]
    for sharded, single in (policies, critics):
        assert_same_weights(sharded.state_dict(), single.state_dict())


@pytest.mark.slow  # two end-to-end runs, ~15 s
def test_a_sharded_lora_run_saves_the_adapter_and_the_merged_model_of_the_unsharded_run(tmp_path):
    from transformers import AutoModelForCausalLM

    fields = {**FIELDS, "lora_rank": 4, "merge_lora": True, "iterations": 2, "save": True, "save_dtype": "float32"}
    spawn(_save_worker, str(tmp_path / "sharded"), {**fields, "prompts_per_iteration": 2})
    trained(
        TrainConfig.from_flat(
            {**fields, "prompts_per_iteration": 4, "out": str(tmp_path / "one" / "run"), "device": "cpu"}
        ).validate()
    )
    adapters = [
        load_file(str(tmp_path / d / "run" / "policy" / "adapter_model.safetensors")) for d in ("sharded", "one")
    ]
    assert adapters[0] and all("lora_" in name for name in adapters[0])
    assert_same_weights(*adapters)
    merged = [
        AutoModelForCausalLM.from_pretrained(tmp_path / d / "run" / "policy-merged").state_dict()
        for d in ("sharded", "one")
    ]
    assert_same_weights(*merged)


def _killed_worker(rank, port, out_dir, fields):
    """Trains with a checkpoint each iteration; rank 0 dies while checkpoint-2 is being made whole."""
    from fastppo.trainer.run import directory as run_directory

    rank_environment(rank, port)
    commit = run_directory._commit

    def dying_commit(tmp, old, target):
        if target.name == "checkpoint-2":
            os._exit(9)  # every shard is written, the manifest and the rename are not
        commit(tmp, old, target)

    run_directory._commit = dying_commit
    PPOTrainer(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate()).train()


@pytest.mark.slow
def test_a_kill_during_a_sharded_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    import torch.multiprocessing as mp

    fields = {
        **FIELDS,
        "prompts_per_iteration": 2,
        "fsdp": True,
        "iterations": 3,
        "save_every": 1,
        "keep_checkpoints": 0,
    }
    with pytest.raises(mp.ProcessExitedException):
        spawn(_killed_worker, str(tmp_path), fields)
    run = tmp_path / "run"
    assert (run / "checkpoint-1").is_dir() and not (run / "checkpoint-2").exists()
    assert any(p.name.startswith(".checkpoint-2.tmp-") for p in run.iterdir())  # the shards of the kill
    spawn(_train_worker, str(tmp_path), None, 3)
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".", "checkpoint"))) == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
    ]
    with pytest.raises(UsageError, match=r"written by 2 rank\(s\); resume with as many, not 1"):
        PPOTrainer.resume(run)


def test_fsdp_needs_ranks_to_shard_over_and_offload_needs_cuda(tmp_path, capsys):
    from fastppo.cli import main

    assert main(["train", "--fsdp", "--iterations", "1", "--device", "cpu", "--out", str(tmp_path / "a")]) == 2
    assert "--fsdp shards over the ranks torchrun starts" in capsys.readouterr().err
    assert main(["train", "--fsdp", "--fsdp-offload", "--device", "cpu", "--out", str(tmp_path / "b")]) == 2
    assert "fsdp_offload needs --fsdp and a CUDA device" in capsys.readouterr().err


def _memory_worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    trainer = PPOTrainer(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate())
    trainer.iteration(0)
    measured = {**resident_bytes(trainer), "process": live_tensor_bytes()}
    torch.save(measured, f"{out_dir}/rank{rank}.pt")
    leave()


@pytest.mark.parametrize("reshard_after_forward", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_each_sharded_rank_holds_half_the_weights_and_optimizer_state_and_no_rollout_copy(
    tmp_path, reshard_after_forward
):
    """Also when blocks are kept gathered from their forward to their backward: the no-grad passes
    (the reference's has no backward at all) free them."""
    fields = {
        **FIELDS,
        "estimator": "gae",
        "kl_coef": 0.02,
        "prompts_per_iteration": 2,
        "rollout_dtype": "bfloat16",
        "fsdp_reshard_after_forward": reshard_after_forward,
    }
    measured = {}
    for mode, fsdp in (("replicated", False), ("sharded", True)):
        (tmp_path / mode).mkdir()
        spawn(_memory_worker, str(tmp_path / mode), {**fields, "fsdp": fsdp})
        measured[mode] = [torch.load(tmp_path / mode / f"rank{rank}.pt") for rank in range(2)]
    for whole, held in zip(measured["replicated"], measured["sharded"]):
        # half, give or take FSDP's padding of rows to a multiple of the world size and the AdamW
        # step counters every rank keeps whole
        assert held["trained"] == pytest.approx(whole["trained"] / 2, rel=0.02), (held, whole)
        assert whole["rollout"] > 0 and held["rollout"] == 0  # gathered for the rollout, freed for the update
        # every tensor the process holds: nothing else keeps the models whole
        assert held["process"] < 0.55 * whole["process"], (held, whole)


def _gradient_worker(rank, port, out_dir, fields):
    rank_environment(rank, port)
    result = one_update(TrainConfig.from_flat({**fields, "out": f"{out_dir}/run", "device": "cpu"}).validate())
    if rank == 0:
        torch.save(result["grads"], f"{out_dir}/grads.pt")
    leave()


@pytest.mark.slow
def test_under_bf16_autocast_sharded_ranks_compute_what_replicated_ranks_do(tmp_path):
    """Mixed precision as on one device: the blocks' linear weights gathered in bf16 (what autocast
    casts), their norms and the embeddings in fp32. Gathering everything in bf16 would make the
    residual stream bf16 too, 7% off this gradient, 25 times bf16 autocast's own 0.3% from
    reordering the batch."""
    fields = {
        **FIELDS,
        "estimator": "gae",
        "kl_coef": 0.02,
        "prompts_per_iteration": 2,
        "autocast": True,
        "rollout_dtype": "bfloat16",
    }
    grads = {}
    for mode, fsdp in (("replicated", False), ("sharded", True)):
        (tmp_path / mode).mkdir()
        spawn(_gradient_worker, str(tmp_path / mode), {**fields, "fsdp": fsdp})
        grads[mode] = torch.load(tmp_path / mode / "grads.pt")
    for part in ("policy", "critic"):
        expected, got = grads["replicated"][part], grads["sharded"][part]
        assert got.keys() == expected.keys()
        error = sum((got[k] - expected[k]).double().square().sum() for k in expected).sqrt()
        assert error <= 1e-5 * sum(v.double().square().sum() for v in expected.values()).sqrt(), part


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_is_saved_once_even_from_separate_copies(tmp_path, dtype):
    """FSDP's gathered state dict holds the tied head and the embedding as two tensors (and a cast
    makes two of one): the saved model holds the table once, and loads tied."""
    from transformers import AutoModelForCausalLM

    from fastppo.trainer.modeling.weights import save_model

    model = AutoModelForCausalLM.from_pretrained(tied_model(tmp_path / "tied"))
    gathered = {k: v.clone() for k, v in model.state_dict().items()}  # separate copies, as gathered
    save_model(model, tmp_path / "saved", dtype, gathered)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
