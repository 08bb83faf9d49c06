"""Signals counted where they are delivered: two signals inside one long C call (a backward, a
reward stuck in C) stop the process at once, exit 130, with the names in the order received; in
Python code the stop at once is an exception a caller sees."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")

# sends FIRST, then SECOND, once the long call has begun; prints "returned" if it ever returns
SCRIPT = """
import hashlib, os, signal, sys, threading, time
import torch
from fastppo.trainer.run.signals import Signals, StoppedAtOnce, stop_on_signals

FIRST, SECOND, CALL = sys.argv[1:4]
started = threading.Event()


def send():
    started.wait()
    time.sleep(0.2)
    os.kill(os.getpid(), getattr(signal, FIRST))
    time.sleep(0.2)
    os.kill(os.getpid(), getattr(signal, SECOND))


class LongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        started.set()
        big = torch.ones(8192, 8192)
        return grad * (big @ big)[0, 0]  # one matmul of seconds: no bytecode runs in it


def long_call():
    if CALL == "backward":
        LongBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    elif CALL == "reward in C":
        started.set()
        hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 300_000_000)
    else:  # Python bytecode
        started.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pass


threading.Thread(target=send, daemon=True).start()
stop = Signals()
try:
    with stop_on_signals(stop):
        long_call()
        print("returned", flush=True)
except StoppedAtOnce as error:
    print(f"raised: {error}", flush=True)
"""


def run(first: str, second: str, call: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), first, second, call],
        capture_output=True,
        text=True,
        timeout=300,
    )


def said(first: str, second: str) -> str:
    return (
        f"stopped at once by a second signal ({first} then {second}), without a checkpoint; "
        "the newest checkpoint is intact"
    )


@pytest.mark.parametrize("call", ["backward", "reward in C"])
@pytest.mark.parametrize("first,second", [("SIGTERM", "SIGTERM"), ("SIGTERM", "SIGINT"), ("SIGINT", "SIGINT")])
def test_a_second_signal_inside_one_long_c_call_stops_the_process_there(call, first, second):
    ended = run(first, second, call)
    assert "returned" not in ended.stdout, "the second signal waited for the call to return"
    assert ended.returncode == 130, ended.stderr
    assert ended.stderr.strip().splitlines()[-1] == f"fastppo train: {said(first, second)}"


def test_a_second_signal_in_python_code_raises_where_a_caller_can_catch_it():
    ended = run("SIGTERM", "SIGINT", "python")
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.strip() == f"raised: {said('SIGTERM', 'SIGINT')}"
