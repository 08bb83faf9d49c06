"""Sharded against replicated data parallelism: one PPO iteration on two ranks, replicated, with
``--fsdp`` and with ``--fsdp --rollout-tp 2``.

A random Llama of the given shape (the shipped tokenizer's vocabulary, so no download) is trained
with GAE, a critic and a KL reference, the heaviest set of models, and a bf16 rollout copy (as on
CUDA), on two gloo ranks of this machine; each mode runs one warm-up iteration and then the timed
ones. Per rank: seconds per iteration (median), the storage held for the weights of every model and
the AdamW states (measured from the live tensors, DTensor shards by their local part), the rollout
copy's storage between rollouts, the refresh that fills it before a rollout (median seconds: the
replicated copy's cast, ``--fsdp``'s all-gather of every tensor whole, ``--rollout-tp``'s
redistribute of each FSDP shard into the rank's part), and the peak of tensor memory during one more
iteration: every tensor alive before it plus the peak of those it creates (``LiveBytes``), gathered
weights and activations included. Not the process's resident memory: on a CPU that says more about glibc, which
keeps what FSDP's gathers free, than about the run. The collectives go through gloo here; on GPUs
NCCL runs the same code.
"""

import gc
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .measure import LiveBytes, storage_bytes


def resident_bytes(trainer) -> dict:
    """The storage this rank holds, from the live tensors: the models' weights with the AdamW
    states (``trained``), and the rollout copy's weights with the sampler's packed projections
    (``rollout``)."""
    models = [trainer.policy, trainer.critic, trainer.models.reference]
    tensors = [p for model in models if model is not None for p in model.parameters()]
    for optimizer in trainer.optimizers.each():
        tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    rollout = [] if trainer.models.rollout_weights.shared else list(trainer.models.rollout_weights.model.parameters())
    packed = trainer.rollouts.sampler.weights
    return {"trained": storage_bytes(tensors), "rollout": storage_bytes(rollout) + (packed.bytes if packed else 0)}


def random_llama(directory: Path, *, hidden: int, layers: int) -> Path:
    """A random Llama of ``hidden`` x ``layers`` with the shipped tokenizer, saved in ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..trainer.modeling.loading import load_policy

    _, tokenizer = load_policy(None)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 256, min(hidden // 64, 2)),  # two at least, to split over two ranks
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in the process (``storage_bytes``)."""
    gc.collect()
    return storage_bytes(obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


#: The modes compared, each a set of config fields.
MODES = {"replicated": {}, "--fsdp": {"fsdp": True}, "--fsdp --rollout-tp 2": {"fsdp": True, "rollout_tp": 2}}
REFRESHES = 5  # timed refreshes of the rollout copy, after one untimed


def _rank(rank: int, port: int, model: str, fields: dict, iterations: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)  # two ranks on a shared CPU
    from ..trainer import PPOTrainer, TrainConfig

    config = TrainConfig.from_flat(
        {
            "model": model,
            "out": f"{out}/run",
            "save": False,
            "device": "cpu",
            **fields,
            "estimator": "gae",
            "kl_coef": 0.02,
            "prompts_per_iteration": 4,
            "samples_per_prompt": 4,
            "max_new_tokens": 16,
            "rollout_dtype": "bfloat16",
            "iterations": iterations + 2,
        }
    ).validate()
    trainer = PPOTrainer(config)
    seconds = []
    for i in range(iterations + 1):
        start = time.perf_counter()
        trainer.iteration(i)
        seconds.append(time.perf_counter() - start)
    weights, refreshes = trainer.models.rollout_weights, []
    for _ in range(REFRESHES + 1):
        start = time.perf_counter()
        weights.refresh()
        refreshes.append(time.perf_counter() - start)
        weights.release()
    before = live_tensor_bytes()
    with LiveBytes() as during:  # one more iteration, untimed: the mode sees every op
        trainer.iteration(iterations + 1)
    result = {
        **resident_bytes(trainer),
        "seconds": statistics.median(seconds[1:]),
        "refresh": statistics.median(refreshes[1:]),
        "peak": before + during.peak,
        "params": sum(p.numel() for p in trainer.models.rollout_weights.model.parameters()),
    }
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(result))
    trainer.ranks.close()


def compare(*, hidden: int = 512, layers: int = 8, iterations: int = 3) -> dict:
    """Every mode on two ranks; per mode, each rank's measurements."""
    import torch.multiprocessing as mp

    work = Path(tempfile.mkdtemp(prefix="fastppo-bench-sharding-"))
    model = str(random_llama(work / "model", hidden=hidden, layers=layers))
    modes = {}
    for name, fields in MODES.items():
        out = work / name.strip("-").replace(" --", "-").replace(" ", "-")
        out.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(port, model, fields, iterations, str(out)), nprocs=2, join=True)
        modes[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"hidden": hidden, "layers": layers, "iterations": iterations, "modes": modes}


def markdown(result: dict, machine: str) -> str:
    MiB = 1 << 20
    params = result["modes"]["replicated"][0]["params"]
    lines = [
        f"# Sharded vs replicated data parallelism, {machine}",
        "",
        "One PPO iteration (GAE, critic, KL reference, bf16 rollout copy; 16 rows per rank, 16 new tokens) of a "
        f"random Llama with hidden {result['hidden']}, {result['layers']} layers ({params:,} parameters), on 2 "
        f"gloo ranks; median of {result['iterations']} after a warm-up.",
        "",
        "| mode | rank | s / iteration | refresh of the rollout copy, ms | weights + AdamW state held | "
        "rollout copy between rollouts | peak tensor memory |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, ranks in result["modes"].items():
        for rank, r in enumerate(ranks):
            lines.append(
                f"| {mode} | {rank} | {r['seconds']:.3f} | {1000 * r['refresh']:.1f} | {r['trained'] / MiB:.1f} MiB | "
                f"{r['rollout'] / MiB:.1f} MiB | {r['peak'] / MiB:.0f} MiB |"
            )
    return "\n".join(lines) + "\n"
