"""Gloo ranks for the multi-rank tests: spawned on this machine, set up as torchrun would set them up,
ended as ``fastppo train`` ends a sharded run, and never outliving their test."""

import faulthandler
import os
import socket

import torch
import torch.multiprocessing as mp

from fastppo.trainer.cli import exit_after_sharding

# A rank that has not finished in this long prints every thread's stack and exits, so a collective that
# never completes fails its test with each rank's stack, under pytest's own timeout, and leaves no rank behind
RANK_WATCHDOG_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank, port, world=2):
    """Rank ``rank`` of ``world``, as torchrun would set it up; its sampler's ``decoder="auto"`` pinned to a
    hand-written forward, as conftest.py pins it in the tests' own process (a rank's rollouts are
    compared with that process's)."""
    from fastppo.rollout import decoders

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_default_device("cpu")
    if world > (os.cpu_count() or 1):  # more ranks than cores: a thread each, not every rank a thread a core
        torch.set_num_threads(1)
    decoders._faster = lambda *args: ("lean", None)


def _watched(rank, target, *args):
    faulthandler.dump_traceback_later(RANK_WATCHDOG_S, exit=True)
    target(rank, *args)
    exit_after_sharding(0)  # a rank that split or sharded a model may otherwise abort in the teardown


def spawn(target, *args, world=2):
    """``target(rank, port, *args)`` on ``world`` ranks, ``port`` a free one for their rendezvous."""
    mp.spawn(_watched, args=(target, free_port(), *args), nprocs=world, join=True)
