"""Checkpoints and exact resume: what a checkpoint holds (the models, the optimizers, the trainer
state and every rank's random states, in format ``CHECKPOINT_FORMAT``) and how a run continues
from the newest one that verifies.

Each checkpoint is saved atomically with a manifest (``directory.py``). Resume verifies the
manifest before loading, so a checkpoint whose bytes changed, or whose manifest no longer lists
every file it holds, is skipped like a truncated one, for the previous checkpoint; one of another
format or another number of ranks is refused, never half-loaded. ``--resume RUN_DIR`` writes
into RUN_DIR, wherever it was first created, reading the inputs the run started with
(``inputs.py``).
"""

import dataclasses
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ...errors import UsageError
from ..configuration.config import RESUMABLE, TrainConfig
from ..parallel.distributed import rank, world_size
from . import inputs
from .directory import CHECKPOINT_NAME, numbered_checkpoints, save_atomically, verify_manifest
from .lock import RunLock

if TYPE_CHECKING:  # for the annotations only
    from ..parallel.distributed import Ranks

STATE_FILE = "trainer_state.pt"
WORLD_FILE = "world.json"  # the number of ranks that wrote a checkpoint
SHARDS = "shards"  # a sharded run's models and optimizers, in torch.distributed.checkpoint's format


class WorldSizeMismatch(UsageError):
    """A checkpoint written by another number of ranks: refused, not skipped."""


# what a checkpoint holds -------------------------------------------------------------------------

# The layout of STATE_FILE: 2 holds the trainer state as one table (state.py) and requires WORLD_FILE.
CHECKPOINT_FORMAT = 2


class CheckpointFormat(UsageError):
    """A checkpoint in another format than this fastppo writes: refused, not skipped."""


def save_models(out: Path, models, ranks: "Ranks", dtype: torch.dtype, merge_lora: bool = False) -> None:
    """The policy (and tokenizer) in Hugging Face format under ``out/policy`` in ``dtype``, the critic
    beside it; each written atomically. With LoRA ``policy/`` is the adapter in PEFT format, and with
    ``merge_lora`` ``policy-merged/`` the model with the adapter merged in. Every rank calls it: a
    sharded model is gathered whole to rank 0, which alone writes."""
    from ..modeling.weights import save_model
    from ..parallel.sharding import full_state_dict

    gathered = {
        name: full_state_dict(model) if models.sharded else None
        for name, model in (("policy", models.policy), ("critic", models.critic))
        if model is not None
    }
    if not ranks.main:
        return

    def with_tokenizer(save):
        def write(directory):
            save(directory)
            models.tokenizer.save_pretrained(directory)

        return write

    policy, lora = gathered["policy"], models.lora
    if lora is None:
        save_atomically(out / "policy", with_tokenizer(lambda d: save_model(models.policy, d, dtype, policy)))
    else:
        save_atomically(out / "policy", with_tokenizer(lambda d: lora.save_adapter(d, policy)))
        if merge_lora:
            save_atomically(out / "policy-merged", with_tokenizer(lambda d: lora.save_merged(d, dtype, policy)))
    if models.critic is not None:
        save_atomically(out / "critic", lambda d: models.critic.save_pretrained(d, gathered["critic"]))


def _sharded_state(models, optimizers) -> dict:
    """The sharded models' and optimizers' state dicts (each rank's shards), keyed for DCP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = {}
    for name, model, optimizer in (
        ("policy", models.policy, optimizers.policy),
        ("critic", models.critic, optimizers.critic),
    ):
        if model is not None:
            state[name], state[f"{name}_optimizer"] = get_state_dict(model, optimizer)
    return state


def save_state(
    directory: Path, next_iteration: int, models, optimizers, state, ranks: "Ranks", rng: list, in_flight: list = None
) -> None:
    """The models (fp32 masters), the optimizers and ``state`` (:class:`~fastppo.trainer.run.state.TrainerState`)
    into ``directory``, so a resumed run is the same run; ``rng`` holds every rank's random states and
    ``in_flight`` every rank's rollout batches in flight (``streaming.py``; None: rollouts drain). A
    sharded run's models and optimizers go to ``SHARDS``, each rank writing its own (every rank calls this)."""
    directory = Path(directory)
    if models.sharded:
        import torch.distributed.checkpoint as dcp

        dcp.save(_sharded_state(models, optimizers), checkpoint_id=str(directory / SHARDS))
        if not ranks.main:
            return
    else:
        save_models(directory, models, ranks, torch.float32)
    (directory / WORLD_FILE).write_text(json.dumps({"world_size": ranks.world}))
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "iteration": next_iteration,
            "trainer_state": dataclasses.asdict(state),
            "optimizers": None if models.sharded else [opt.state_dict() for opt in optimizers.each()],
            "schedules": [s.state_dict() for s in optimizers.schedules],
            "rng": rng,
            "in_flight": in_flight,
        },
        directory / STATE_FILE,
    )


def read_state(directory: Path, lazily: bool = False) -> dict:
    """The saved ``STATE_FILE`` of a checkpoint of this format, else :class:`CheckpointFormat`.
    ``lazily``: its tensors (the AdamW moments, as large as the fp32 weights twice over) are
    mapped from the file, not read, for a check that needs only the table."""
    saved = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False, mmap=lazily)
    written = saved.get("format", 1) if isinstance(saved, dict) else None
    if written != CHECKPOINT_FORMAT:
        raise CheckpointFormat(
            f"{directory} is a checkpoint of format {written} (fastppo 0.1); this fastppo "
            f"reads format {CHECKPOINT_FORMAT} only: finish that run with the fastppo that "
            "started it, or start afresh from its saved policy (--model)"
        )
    return saved


def check_world_size(directory: Path, world: int) -> None:
    """Refuse a checkpoint written by another number of ranks than ``world``: its random states
    are per rank, and a sharded one's shards are cut for that many."""
    written = json.loads((Path(directory) / WORLD_FILE).read_text())["world_size"]
    if written != world:
        raise WorldSizeMismatch(f"{directory} was written by {written} rank(s); resume with as many, not {world}")


def load_state(directory: Path, models, optimizers, ranks: "Ranks") -> tuple:
    """Load what :func:`save_state` wrote into the models and optimizers, in place (the optimizer
    and the sampler keep their tensors); put back this rank's random states; return ``(trainer
    state, the iteration to continue at, this rank's rollout batches in flight or None)``."""
    from transformers import AutoModelForCausalLM

    from ..modeling.critic import Critic
    from .state import TrainerState, restore_random_states

    directory = Path(directory)
    saved = read_state(directory)
    check_world_size(directory, ranks.world)
    if models.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        shards = _sharded_state(models, optimizers)
        dcp.load(shards, checkpoint_id=str(directory / SHARDS))
        for name, model, optimizer in (
            ("policy", models.policy, optimizers.policy),
            ("critic", models.critic, optimizers.critic),
        ):
            if model is not None:
                set_state_dict(
                    model, optimizer, model_state_dict=shards[name], optim_state_dict=shards[f"{name}_optimizer"]
                )
    else:
        if models.lora is not None:
            models.lora.load_adapter(directory / "policy")
        else:
            models.policy.load_state_dict(AutoModelForCausalLM.from_pretrained(directory / "policy").state_dict())
        if models.critic is not None:
            models.critic.load_state_dict(Critic.from_pretrained(directory / "critic").state_dict())
        for optimizer, optimizer_state in zip(optimizers.each(), saved["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
    optimizers.restore_schedules(saved["schedules"])
    restore_random_states(saved["rng"][ranks.rank], models.device)
    in_flight = saved.get("in_flight")
    return TrainerState(**saved["trainer_state"]), saved["iteration"], in_flight and in_flight[ranks.rank]


def resumable(run_dir, overrides: dict = None) -> tuple:
    """``(config, [(N, checkpoint-N)] newest first, inexact)`` of the run in ``run_dir`` to resume,
    checked before any model loads, with its lock held while it reads.

    The saved config is used, with ``out`` set to ``run_dir`` (a copied or moved run resumes
    where it now is); ``overrides`` may change only :data:`RESUMABLE` fields. The newest
    checkpoint verifies and is of this format, from as many ranks as this run has. ``inexact``
    says how the changed fields make the resumed run differ from the uninterrupted one: to warn
    of once the run is built with them (a value that cannot run is refused, not warned of).
    """
    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise UsageError(f"--resume {run_dir}: no config.json, not a fastppo run directory")
    # rank 0 holds the directory before reading it: a live run there is refused, not read mid-save
    lock = RunLock.acquire(run_dir) if rank() == 0 else None
    try:
        return _resumable(run_dir, config_path, dict(overrides or {}))
    finally:
        if lock is not None:
            lock.release()  # the trainer takes its own


def load_newest(checkpoints: list, load: Callable[[Path], int]) -> int:
    """``load`` of the newest of ``checkpoints`` that loads (the first was verified by :func:`resumable`);
    a checkpoint that fails its manifest or does not load is skipped with a warning, for the one
    before it. Returns what ``load`` returned: the iteration to continue at."""
    for number, path in checkpoints:
        try:
            if number != checkpoints[0][0]:
                _verified(path)
            return load(path)
        except (WorldSizeMismatch, CheckpointFormat):
            raise
        except Exception as error:  # never load a damaged checkpoint: fall back to an older one
            warnings.warn(f"skipping {path}: it does not load ({type(error).__name__}: {error})")
    raise UsageError(f"--resume {checkpoints[0][1].parent}: no complete checkpoint to resume from")


def _resumable(run_dir: Path, config_path: Path, overrides: dict) -> tuple:
    """``(config, [(N, checkpoint-N)] newest first)`` of a run to resume, checked before any model
    loads: the saved config with ``overrides``, and the newest checkpoint that verifies, from as
    many ranks as this run has, before an ``iterations`` it leaves to train."""
    try:
        saved = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"--resume {run_dir}: config.json does not parse ({error})") from None
    if not isinstance(saved, dict):
        raise UsageError(f"--resume {run_dir}: config.json holds a {type(saved).__name__}, not a table of fields")
    out = overrides.pop("out", None)
    if out is not None and Path(out).resolve() != run_dir.resolve():
        raise UsageError(f"--resume {run_dir} writes into {run_dir}; drop --out {out}")
    if overrides.pop("overwrite", False):
        raise UsageError("--resume continues a run and --overwrite starts one afresh: give one of them")
    overrides = inputs.resolved(overrides)  # as the saved paths are: the same file given again is no change
    changed = sorted(k for k, v in overrides.items() if saved.get(k) != v and k not in RESUMABLE)
    if changed:
        raise UsageError(
            f"cannot resume {run_dir} with changed {', '.join(changed)}; only {', '.join(sorted(RESUMABLE))} may change"
        )
    config = TrainConfig.from_flat({**saved, **overrides, "out": str(run_dir)}, source=str(config_path)).validate()
    inexact = [
        f"a changed {field} {effect}, so the resumed run samples other tokens than the uninterrupted run "
        "would: it continues the run, not exactly"
        for field, effect in (
            ("rollout_batch_size", "decodes the rows in other slots"),
            ("rollout_kv_memory", "may make rows wait for KV memory at other steps, in other slots"),
            ("rollout_kv_block_size", "may make rows wait for KV memory at other steps, in other slots"),
            ("tool_schedule", "resumes rows after their tools at other steps"),
            ("tool_window", "resumes rows after their tools at other steps"),
            ("max_staleness", "samples the batches in flight again and draws tokens with other weights"),
        )
        if field in overrides and overrides[field] != saved.get(field)
    ]
    was, now = TrainConfig.from_flat(saved).rollout_is_cap, config.rollout_is_cap
    if was != now:
        inexact.append(
            f"the changed max_staleness {'drops' if now is None else 'sets'} the importance weights' cap "
            f"({was} -> {now}; give rollout_is_cap to keep one), so the update weighs tokens otherwise than the "
            "uninterrupted run would"
        )

    inputs.check(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and not metrics.is_file():
        raise UsageError(f"--resume {run_dir}: {metrics} is not a file")
    for path in run_dir.glob("checkpoint-*"):
        if CHECKPOINT_NAME.fullmatch(path.name) and not path.is_dir():
            warnings.warn(f"{path} is not a directory; it is no checkpoint and is ignored")
    checkpoints = numbered_checkpoints(run_dir)[::-1]
    while checkpoints:
        try:
            _verified(checkpoints[0][1])
            break
        except ValueError as error:
            warnings.warn(f"skipping {checkpoints.pop(0)[1]}: it does not load ({error})")
    if not checkpoints:
        raise UsageError(f"--resume {run_dir}: no complete checkpoint to resume from")
    read_state(checkpoints[0][1], lazily=True)  # its format
    check_world_size(checkpoints[0][1], world_size())  # every checkpoint of a run has its world size
    if config.run.iterations <= checkpoints[0][0]:
        raise UsageError(
            f"--resume {run_dir}: the run has trained {checkpoints[0][0]} iterations "
            f"({checkpoints[0][1].name}); give --iterations above {checkpoints[0][0]} to train on, "
            f"not {config.run.iterations}"
        )
    if saved.get("max_staleness") and checkpoints[0][0] == saved.get("iterations") != config.run.iterations:
        inexact.append(
            f"{checkpoints[0][1].name} is the run's last: its rollouts drained there (a longer run's would have "
            "run ahead, max_staleness >= 1), so the run continues, not exactly as one run of the new length would"
        )
    return config, checkpoints, inexact


def _verified(checkpoint: Path) -> None:
    """Raise ``ValueError`` unless ``checkpoint`` matches its manifest and its world file parses."""
    verify_manifest(checkpoint, required=(STATE_FILE, WORLD_FILE))
    try:
        written = json.loads((checkpoint / WORLD_FILE).read_text())["world_size"]
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{WORLD_FILE} does not parse ({type(error).__name__}: {error})") from None
    if not isinstance(written, int) or isinstance(written, bool) or written < 1:
        raise ValueError(f"{WORLD_FILE} holds no world size")
