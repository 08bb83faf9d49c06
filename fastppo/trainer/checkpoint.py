"""Run directories that lose nothing: atomic, verified checkpoints, exact resume, one run per directory.

A save is complete or absent, never half there. Everything is written into a hidden temporary
directory beside the target, with a manifest of every file's sha256 (``MANIFEST_FILE``), flushed
to disk (files, then directories), and renamed into place. A kill mid-save leaves the previous
version intact and at worst a ``.NAME.tmp-PID`` directory, which the next start or save of the
run clears; a kill between the two renames of a replacement leaves ``.NAME.old-PID``, which is
put back if ``NAME`` is missing. Resume verifies the manifest before loading, so a checkpoint
whose bytes changed (a bad disk, a partial copy), or whose manifest no longer lists every file
it holds, is skipped like a truncated one, for the previous checkpoint. A filesystem that
refuses a save (full, read-only) is :class:`SaveFailed`, one line, the previous save intact.

A run directory belongs to one run: the live run holds its lock (``run_lock.py``), a new run
refuses a non-empty directory unless told to clear it (``--overwrite``), and ``--resume RUN_DIR``
writes into RUN_DIR, wherever it was first created, reading the inputs the run started with
(``inputs.py``). ``metrics.jsonl`` is append-only; resume keeps its rows before the checkpoint
and drops a line a kill cut short.
"""

import dataclasses
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch

from . import inputs
from .config import RESUMABLE, TrainConfig
from .distributed import rank, world_size
from .errors import UsageError
from .inputs import sha256_of
from .run_lock import LOCK_FILE, RunLock

STATE_FILE = "trainer_state.pt"
WORLD_FILE = "world.json"  # the number of ranks that wrote a checkpoint
SHARDS = "shards"  # a sharded run's models and optimizers, in torch.distributed.checkpoint's format
MANIFEST_FILE = "MANIFEST.sha256"
_LEFTOVER = re.compile(r"\.(.+)\.(tmp|old)-\d+")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class WorldSizeMismatch(UsageError):
    """A checkpoint written by another number of ranks: refused, not skipped."""


# atomic saves -----------------------------------------------------------------------------------


class SaveFailed(UsageError):
    """The filesystem refused a save (full, read-only, a quota); nothing already saved changed."""


def _failed_write(error: BaseException) -> bool:
    """Whether ``error`` is the filesystem refusing a write, however the writer reports it: an
    ``OSError``, safetensors' error, or torch.save's stream writer failing."""
    from safetensors import SafetensorError

    return isinstance(error, (OSError, SafetensorError)) or (
        isinstance(error, RuntimeError) and "PytorchStreamWriter failed" in str(error)
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_entries(manifest: Path) -> dict:
    """``{relative/path: sha256}`` of a manifest."""
    entries = {}
    for line in manifest.read_text().splitlines():
        digest, _, name = line.partition("  ")
        entries[name] = digest
    return entries


def write_manifest(directory: Path) -> None:
    """``MANIFEST_FILE`` in ``directory``: ``sha256  relative/path`` for every file below it.

    A subdirectory saved atomically inside this save (a checkpoint's ``policy/``) has just written
    its own manifest: its sums are taken from there, so no file is hashed twice.
    """
    known = {}
    for inner in directory.rglob(MANIFEST_FILE):
        prefix = inner.parent.relative_to(directory)
        known.update({(prefix / name).as_posix(): digest for name, digest in _manifest_entries(inner).items()})
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    names = [p.relative_to(directory).as_posix() for p in files]
    lines = [f"{known.get(name) or sha256_of(p)}  {name}\n" for p, name in zip(files, names)]
    (directory / MANIFEST_FILE).write_text("".join(lines))


def verify_manifest(directory: Path, required: tuple = ()) -> None:
    """Raise ``ValueError`` unless the manifest lists every file below ``directory`` (and the
    ``required`` names), and each is there with its sha256: an emptied or edited manifest, a file
    added or removed, fails as surely as changed bytes do."""
    manifest = Path(directory) / MANIFEST_FILE
    if not manifest.is_file():
        raise ValueError(f"no {MANIFEST_FILE}")
    entries = _manifest_entries(manifest)
    present = {
        p.relative_to(directory).as_posix()
        for p in Path(directory).rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE
    }
    unlisted = sorted(present.difference(entries)) + [name for name in required if name not in entries]
    if unlisted:
        raise ValueError(
            f"{MANIFEST_FILE} does not list {', '.join(unlisted[:3])}"
            + (f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else "")
        )
    for name, expected in entries.items():
        path = Path(directory) / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if sha256_of(path) != expected:
            raise ValueError(f"{name} does not match its sha256 in {MANIFEST_FILE}")


def clear_leftovers(directory: Path) -> None:
    """Remove what interrupted saves left in ``directory``; put back a replaced save that a kill
    between the two renames left only as ``.NAME.old-PID``."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = _LEFTOVER.fullmatch(path.name)
        if not match:
            continue
        if not path.is_dir():  # a file written by write_text_atomically
            path.unlink(missing_ok=True)
            continue
        target = directory / match.group(1)
        if match.group(2) == "old" and not target.exists():
            os.replace(path, target)
        else:
            shutil.rmtree(path, ignore_errors=True)


def save_atomically(target: Path, write: Callable[[Path], None], ranks=None) -> Path:
    """Call ``write(directory)`` on a temporary directory, add the manifest, make it ``target`` in
    one rename. With ``ranks`` (a sharded save) every rank calls this and writes its part into
    rank 0's temporary directory; rank 0 alone makes it ``target``."""
    target = Path(target)
    main = ranks is None or ranks.main
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if main:
        target.parent.mkdir(parents=True, exist_ok=True)
        clear_leftovers(target.parent)
        tmp.mkdir()
    if ranks is not None:  # rank 0's names
        tmp, old = ranks.gather((tmp, old) if main else None)[0]
    try:
        write(tmp)
        if ranks is not None:
            ranks.barrier()  # every part is written
        if main:
            _commit(tmp, old, target)
    except BaseException as error:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = error.__cause__ if isinstance(error, SaveFailed) else error  # a save inside this one failed
        if _failed_write(cause):
            raise SaveFailed(
                f"could not write {target} ({type(cause).__name__}: {cause}); what was saved before "
                "is intact: free some space (or fix the directory's permissions) and resume"
            ) from cause
        raise
    if ranks is not None:
        ranks.barrier()  # no rank goes on before target is in place
    return target


def _commit(tmp: Path, old: Path, target: Path) -> None:
    """The written ``tmp`` with its manifest, flushed to disk and renamed to ``target``."""
    write_manifest(tmp)
    for path in sorted(tmp.rglob("*"), reverse=True):  # files before the directories holding them
        _fsync(path)
    _fsync(tmp)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_text_atomically(path: Path, text: str) -> None:
    """``path`` holds the old text or the new one, never a part: a temporary file, then a rename."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def numbered_checkpoints(run_dir: Path) -> list:
    """``[(N, path)]`` of the ``checkpoint-N`` directories, oldest first."""
    found = [
        (int(m.group(1)), p) for p in Path(run_dir).iterdir() if p.is_dir() and (m := _CHECKPOINT.fullmatch(p.name))
    ]
    return sorted(found)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Remove ``checkpoint-N`` directories but the ``keep`` newest (``keep`` 0 keeps all)."""
    if keep <= 0:
        return
    for _, path in numbered_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path)


# the run directory ------------------------------------------------------------------------------


def check_run_directory(out: Path, overwrite: bool) -> None:
    """Refuse ``out`` for a new run if it holds anything, unless ``overwrite`` and it is a fastppo
    run directory (has a config.json): :func:`clear_run_directory` then empties it when the run
    starts, so a run that fails to start deletes nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if not out.exists() or not any(p.name != LOCK_FILE for p in out.iterdir()):
        return
    if not overwrite:
        raise UsageError(
            f"--out {out} is not empty; continue that run with --resume {out}, clear it with "
            "--overwrite, or choose another --out"
        )
    if not (out / "config.json").is_file():
        raise UsageError(
            f"--out {out} is not empty and not a fastppo run directory (no config.json); "
            "--overwrite clears only run directories"
        )


def claim_run_directory(run, resuming: bool) -> RunLock:
    """Hold ``run.out`` for this run (``run_lock.py``), check that a new run may start there (see
    :func:`check_run_directory`), and clear what interrupted saves left."""
    out = Path(run.out)
    lock = RunLock.acquire(out)
    try:
        if not resuming:
            check_run_directory(out, run.overwrite)
        clear_leftovers(out)
    except BaseException:
        lock.release()
        raise
    return lock


def clear_run_directory(out: Path) -> None:
    """Empty the run directory ``out`` (checked by :func:`check_run_directory`) but for the lock
    this run holds."""
    for path in Path(out).iterdir():
        if path.name == LOCK_FILE:
            continue
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def read_metrics(path: Path) -> list:
    """``[(line, row)]`` of a ``metrics.jsonl``, dropping (with a warning naming it) any line that is
    not a complete JSON row, such as the last one of a run killed mid-write."""
    rows = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), start=1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
                raise ValueError
        except ValueError:
            warnings.warn(f"{path}:{number}: dropping a line that is not a complete metrics row")
            continue
        rows.append((line, row))
    return rows


def metrics_before(path: Path, start: int) -> list:
    """The lines of ``metrics.jsonl`` for iterations before ``start`` (see :func:`read_metrics`)."""
    if not path.is_file():
        warnings.warn(f"{path} is missing; the resumed run logs from iteration {start} only")
        return []
    return [line for line, row in read_metrics(path) if row["iteration"] < start]


# what a checkpoint holds -------------------------------------------------------------------------

# The layout of STATE_FILE: 2 holds the trainer state as one table (state.py) and requires WORLD_FILE.
CHECKPOINT_FORMAT = 2


class CheckpointFormat(UsageError):
    """A checkpoint in another format than this fastppo writes: refused, not skipped."""


def save_models(out: Path, models, ranks, dtype: torch.dtype, merge_lora: bool = False) -> None:
    """The policy (and tokenizer) in Hugging Face format under ``out/policy`` in ``dtype``, the critic
    beside it; each written atomically. With LoRA ``policy/`` is the adapter in PEFT format, and with
    ``merge_lora`` ``policy-merged/`` the model with the adapter merged in. Every rank calls it: a
    sharded model is gathered whole to rank 0, which alone writes."""
    from .models import save_model
    from .sharding import full_state_dict

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


def save_state(directory: Path, next_iteration: int, models, optimizers, state, ranks, rng: list) -> None:
    """The models (fp32 masters), the optimizers and ``state`` (:class:`~fastppo.trainer.state.TrainerState`)
    into ``directory``, so a resumed run is the same run; ``rng`` holds every rank's random states. A
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
        },
        directory / STATE_FILE,
    )


def read_state(directory: Path) -> dict:
    """The saved ``STATE_FILE`` of a checkpoint of this format, else :class:`CheckpointFormat`."""
    saved = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False)
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


def load_state(directory: Path, models, optimizers, ranks) -> tuple:
    """Load what :func:`save_state` wrote into the models and optimizers, in place (the optimizer
    and the sampler keep their tensors); put back this rank's random states; return ``(trainer
    state, the iteration to continue at)``."""
    from transformers import AutoModelForCausalLM

    from .models import Critic
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
    return TrainerState(**saved["trainer_state"]), saved["iteration"]


def resumable(run_dir, overrides: dict = None) -> tuple:
    """``(config, [(N, checkpoint-N)] newest first)`` of the run in ``run_dir`` to resume, checked
    before any model loads, with its lock held while it reads.

    The saved config is used, with ``out`` set to ``run_dir`` (a copied or moved run resumes
    where it now is); ``overrides`` may change only :data:`RESUMABLE` fields. The newest
    checkpoint verifies and is of this format, from as many ranks as this run has.
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
    if "rollout_batch_size" in overrides and overrides["rollout_batch_size"] != saved.get("rollout_batch_size"):
        warnings.warn(
            "a changed rollout_batch_size decodes the rows in other slots, so the resumed run samples "
            "other tokens than the uninterrupted run would: it continues the run, not exactly"
        )
    config = TrainConfig.from_flat({**saved, **overrides, "out": str(run_dir)}, source=str(config_path)).validate()
    inputs.check(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and not metrics.is_file():
        raise UsageError(f"--resume {run_dir}: {metrics} is not a file")
    for path in run_dir.glob("checkpoint-*"):
        if _CHECKPOINT.fullmatch(path.name) and not path.is_dir():
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
    read_state(checkpoints[0][1])  # its format
    check_world_size(checkpoints[0][1], world_size())  # every checkpoint of a run has its world size
    if config.run.iterations <= checkpoints[0][0]:
        raise UsageError(
            f"--resume {run_dir}: the run has trained {checkpoints[0][0]} iterations "
            f"({checkpoints[0][1].name}); give --iterations above {checkpoints[0][0]} to train on, "
            f"not {config.run.iterations}"
        )
    return config, checkpoints


def _verified(checkpoint: Path) -> None:
    """Raise ``ValueError`` unless ``checkpoint`` matches its manifest and its world file parses."""
    verify_manifest(checkpoint, required=(STATE_FILE, WORLD_FILE))
    try:
        written = json.loads((checkpoint / WORLD_FILE).read_text())["world_size"]
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{WORLD_FILE} does not parse ({type(error).__name__}: {error})") from None
    if not isinstance(written, int) or isinstance(written, bool) or written < 1:
        raise ValueError(f"{WORLD_FILE} holds no world size")
