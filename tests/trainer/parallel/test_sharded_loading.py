"""Sharded loading (``trainer/parallel/sharded_loading.py``) on two gloo ranks: a model built on the meta
device, sharded and read shard by shard holds exactly ``from_pretrained``'s values (cast to fp32, as
the trainer casts them) and computes its logits bit for bit; each rank's host memory grows by its
half of the model, not the whole; a checkpoint whose names are not the model's is loaded whole,
saying why."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fastppo.trainer.parallel import sharded_loading
from tests.ranks import rank_environment, spawn


def _saved(directory, dtype=torch.bfloat16, **sizes) -> str:
    from fastppo.trainer.modeling.loading import load_policy

    torch.manual_seed(0)
    config = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(**{**config, "num_key_value_heads": 2, **sizes})).to(dtype)
    model.save_pretrained(directory)
    load_policy(None)[1].save_pretrained(directory)
    return str(directory)


def _peak_rss() -> int:
    """This process's resident high-water mark, bytes (``/proc``'s VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _worker(rank, port, out, path, measure, world=2):
    """``measure``: None checks the values; "sharded" or "whole" measures the peak host memory one
    rank's load adds (after the imports either needs), reading its shards or the whole model."""
    import torch.distributed.checkpoint  # noqa: F401 - imported before measuring, as a run has
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fastppo.trainer.parallel import sharding

    rank_environment(rank, port, world)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    policy, _ = sharded_loading.load_meta_policy(path)
    policy.float()
    mesh = init_device_mesh("cpu", (world,))
    sharding.shard(policy, mesh=mesh, compute_dtype=None, reshard_after_forward=True, offload=False, hidden_states=True)
    found = {}
    if measure:
        open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from here on
    before = _peak_rss()
    if measure == "whole":
        AutoModelForCausalLM.from_pretrained(path).float()
    else:
        sharded_loading.materialize(policy, torch.device("cpu"), path, {n: n for n, _ in policy.named_parameters()})
    found["grown"] = _peak_rss() - before
    found["held"] = sum(p.to_local().numel() * 4 for p in policy.parameters() if not p.is_meta)
    if measure is None:
        whole = AutoModelForCausalLM.from_pretrained(path).float()
        expected = dict(whole.named_parameters())
        found["shards_equal"] = all(
            torch.equal(
                p.to_local(), expected[n].detach().chunk(world, dim=0)[rank] if isinstance(p, DTensor) else expected[n]
            )
            for n, p in policy.named_parameters()
        )
        ids = torch.tensor([[1, 5, 9, 3, 60]])
        with torch.no_grad():
            found["logits_equal"] = torch.equal(policy(ids).logits, whole(ids).logits)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(found, f)
    torch.distributed.destroy_process_group()


def test_a_sharded_load_holds_from_pretrained_s_values_bit_for_bit(tmp_path):
    path = _saved(tmp_path / "model")
    spawn(_worker, str(tmp_path), path, None)
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["shards_equal"] and found["logits_equal"]


@pytest.mark.skipif(not sharded_loading.Path("/proc/self/clear_refs").exists(), reason="reads Linux's /proc")
def test_each_rank_s_host_memory_grows_by_its_shards_not_the_model(tmp_path):
    """Four ranks, each holding a quarter: a rank's peak grows by its shards and the pages of the file
    it read (mapped, so counted), a fraction of what loading the whole model costs it."""
    path = _saved(tmp_path / "model", torch.bfloat16, vocab_size=16000, hidden_size=512, intermediate_size=1024)
    model_bytes = sum(t.numel() * 4 for t in AutoModelForCausalLM.from_pretrained(path).parameters())  # 84 MB fp32
    grown = {}
    for measure in ("sharded", "whole"):
        (tmp_path / measure).mkdir()
        spawn(_worker, str(tmp_path / measure), path, measure, 4, world=4)
        grown[measure] = [json.loads((tmp_path / measure / f"rank{r}.json").read_text()) for r in range(4)]
    for sharded, whole in zip(grown["sharded"], grown["whole"]):
        assert sharded["held"] <= model_bytes / 4 + 4096
        assert whole["grown"] >= model_bytes  # the model at least once
        assert sharded["grown"] < 0.45 * whole["grown"], (sharded, whole, model_bytes)  # here ~0.32


def test_a_checkpoint_named_otherwise_is_said_to_load_whole(tmp_path):
    path = _saved(tmp_path / "model")
    policy, _ = sharded_loading.load_meta_policy(path)
    assert sharded_loading.unreadable(policy, path) == ""
    assert all(p.is_meta for p in policy.parameters()) and not any(b.is_meta for b in policy.buffers())
    from safetensors.torch import load_file, save_file

    file = next((tmp_path / "model").glob("*.safetensors"))
    renamed = {k.replace("mlp.gate_proj", "mlp.fused_proj"): v for k, v in load_file(str(file)).items()}
    save_file(renamed, str(file), metadata={"format": "pt"})
    assert "names its tensors otherwise (model.layers.0.mlp.gate_proj.weight" in sharded_loading.unreadable(
        policy, path
    )
