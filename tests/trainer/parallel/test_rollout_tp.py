"""``--rollout-tp``: the rollout copy split over groups of ranks and filled from the FSDP shards
(``trainer/modeling/rollout_tp.py``), on gloo ranks: each rank's part is exactly its share of the trained
weights (LoRA merged), through one group and through groups of fewer ranks than the world; no rank
holds more than its share; and a run trains, resumes bitwise and refuses what it cannot do in one
line."""

import json

import pytest
import torch

from fastppo.errors import UsageError
from fastppo.trainer import PPOTrainer, TrainConfig
from fastppo.trainer.modeling.rollout_tp import RolloutGroup, check_rollout_tp, check_splittable
from tests.ranks import rank_environment, spawn

from .test_distributed import FIELDS, straight_and_resumed


def _expected_part(whole: torch.Tensor, target, group: RolloutGroup) -> torch.Tensor:
    """``target``'s share of ``whole``, by its placement (torch.chunk's split, as DTensor's)."""
    from torch.distributed.tensor import DTensor, Shard

    placement = target.placements[0] if isinstance(target, DTensor) else None
    if isinstance(placement, Shard):
        return whole.chunk(group.size, dim=placement.dim)[group.member]
    return whole


def _copy_worker(rank, port, out, world, fields):
    from torch.distributed.tensor import DTensor

    from fastppo.bench.measure import storage_bytes

    rank_environment(rank, port, world)
    torch.set_num_threads(1)
    trainer = PPOTrainer(TrainConfig.from_flat({**fields, "out": f"{out}/run", "device": "cpu"}).validate())
    trainer.train()  # an update moves the weights (and LoRA's B from zero) away from the copy's
    weights, models = trainer.rollouts.weights, trainer.models
    weights.refresh()
    whole = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in trainer.policy.named_parameters()}
    if models.lora is not None:
        whole = models.lora.merged_state_dict(torch.float32, whole)
    worst, expected_bytes = 0.0, 0
    for name, target in weights.model.named_parameters():
        local = target.to_local() if isinstance(target, DTensor) else target
        expected = _expected_part(whole[name], target, models.rollout_group)
        assert local.shape == expected.shape, name
        worst = max(worst, float((local.float() - expected.float()).abs().max()))
        expected_bytes += expected.numel() * local.element_size()
    copy = list(weights.model.parameters())
    largest = max(storage_bytes([p]) for p in copy)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "worst": worst,
                "copy_bytes": storage_bytes(copy),
                "expected_bytes": expected_bytes,
                "largest": largest,
                "model_bytes": sum(t.numel() * t.element_size() for t in whole.values()),
                "largest_whole": max(t.numel() * t.element_size() for t in whole.values()),
                "group": list(models.rollout_group.__dict__.values()),
            },
            f,
        )
    torch.distributed.destroy_process_group()


def _copy_checked(tmp_path, world: int, split: int = 2, whole_share: float = 0.02, **options) -> list:
    """Each rank's copy after a trained iteration on ``world`` ranks split ``split`` ways: its parts and
    nothing more; ``whole_share``: what the parts every rank holds whole (norms; key and value
    projections where the KV heads are fewer than the ranks) add to its 1/``split`` of the model."""
    fields = {**FIELDS, "estimator": "grpo", "prompts_per_iteration": 2, "fsdp": True, "rollout_tp": split, **options}
    spawn(_copy_worker, str(tmp_path), world, fields, world=world)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for result in found:
        assert result["worst"] <= 1e-6  # fp32 on the CPU: the shares exactly (LoRA merged in fp32)
        assert result["copy_bytes"] == result["expected_bytes"]
        assert result["copy_bytes"] <= result["model_bytes"] / split * (1 + whole_share)
        assert result["largest"] <= result["largest_whole"] / split
    return found


def test_a_group_of_all_ranks_holds_exactly_its_share_of_the_trained_weights(tmp_path):
    found = _copy_checked(tmp_path, 2, lora_rank=4)
    assert [r["group"] for r in found] == [[2, 0, 0, 1], [2, 0, 1, 1]]


@pytest.mark.slow
def test_groups_of_fewer_ranks_than_the_world_gather_their_share_across_groups(tmp_path):
    found = _copy_checked(tmp_path, 4)
    assert [r["group"][1:3] for r in found] == [[0, 0], [0, 1], [1, 0], [1, 1]]


@pytest.mark.slow
def test_kv_heads_fewer_than_the_ranks_keep_their_projections_whole_on_each(tmp_path):
    # the default model's 2 KV heads over 4 ranks: k and v whole on each (32 KB of its 312 KB: a tiny model's
    # heads are a large part of it) beside a quarter of the rest
    found = _copy_checked(tmp_path, 4, split=4, whole_share=0.35, lora_rank=4)
    assert [r["group"] for r in found] == [[4, 0, m, 1] for m in range(4)]


@pytest.mark.slow
def test_a_split_rollout_run_resumes_exactly(tmp_path):
    fields = {**FIELDS, "estimator": "grpo", "prompts_per_iteration": 2, "save": True, "fsdp": True, "rollout_tp": 2}
    rows = straight_and_resumed(tmp_path, fields)
    assert len(rows[0]) == 3 and rows[0] == rows[1]


def test_rollout_tp_the_ranks_cannot_take_is_one_line():
    with pytest.raises(UsageError, match="this is one process: launch with torchrun"):
        check_rollout_tp(2, 1)
    with pytest.raises(UsageError, match="--rollout-tp 4 does not divide the 6 ranks"):
        check_rollout_tp(4, 6)
    check_rollout_tp(2, 4)
    check_rollout_tp(1, 1)


@pytest.mark.parametrize(
    "options, says",
    [
        ({}, "needs --fsdp"),
        ({"fsdp": True, "rollout_decoder": "lean"}, "needs --fsdp"),
        ({"fsdp": True, "max_staleness": 1}, "not for max_staleness"),
    ],
)
def test_rollout_tp_without_what_it_needs_is_refused(options, says):
    with pytest.raises(UsageError, match=f"rollout_tp above 1 {says}".replace("above 1 not", "above 1 .*not")):
        TrainConfig.from_flat({**FIELDS, "rollout_tp": 2, **options}).validate()


def test_a_model_the_sampler_cannot_split_is_one_line():
    from tests.rollout.models import FAMILIES

    with pytest.raises(UsageError, match="--rollout-tp 2: gpt2 declares no tensor-parallel layout"):
        check_splittable(FAMILIES["gpt2"](), 2)
    with pytest.raises(UsageError, match="--rollout-tp 3: llama has 4 attention heads, which do not divide over 3"):
        check_splittable(FAMILIES["llama"](), 3)
    check_splittable(FAMILIES["llama"](), 4)  # its 2 KV heads each on 2 of the 4 ranks


def _start_up_worker(rank, port, out, fields):
    from fastppo.bench.sharding import live_tensor_bytes
    from fastppo.trainer.memory.plan import STARTUP, memory_plan, phases

    rank_environment(rank, port)
    torch.set_num_threads(1)
    config = TrainConfig.from_flat({**fields, "out": f"{out}/run", "device": "cpu"}).validate()
    before = live_tensor_bytes()
    trainer = PPOTrainer(config)
    held = live_tensor_bytes() - before
    longest = max(len(ids) for ids in trainer.prompts.ids)
    lines = memory_plan(config, trainer.policy.config, prompt_tokens=longest, device_type="cpu", world_size=2)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"held": held, "planned": phases(lines)[STARTUP]}, f)
    torch.distributed.destroy_process_group()


def test_each_rank_holds_at_start_up_what_the_plan_s_start_up_line_says(tmp_path):
    """Policy, reference and critic read shard by shard, the split copy and the KV cache without
    storage until the first rollout: every tensor alive on a rank is its shards, as planned."""
    fields = {**FIELDS, "estimator": "gae", "kl_coef": 0.02, "prompts_per_iteration": 2, "fsdp": True, "rollout_tp": 2}
    spawn(_start_up_worker, str(tmp_path), fields)
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # beyond the plan: the buffers (rotary frequencies) and the sampler's small tables, under 1%
        assert found["planned"] <= found["held"] <= 1.01 * found["planned"], found
