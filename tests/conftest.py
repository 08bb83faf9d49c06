"""Test setup: without a GPU, every Triton kernel runs in the Triton interpreter on CPU tensors;
with one, every test runs on it.

``TRITON_INTERPRET`` is read when triton is imported, so it is set here, before any test module
(or torch.compile) can import triton.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if HAS_CUDA:
    # Tests create tensors without naming a device: on a GPU machine they all run on it, so the
    # Triton backend runs the compiled kernels.
    torch.set_default_device("cuda")
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastppo.ops.dispatch import TRITON_INSTALLED  # noqa: E402  (after the environment is set)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")),
]


# For a test whose kernel run takes the interpreter many seconds: the twin by default, the kernel with -m slow.
BACKENDS_KERNEL_SLOW = ["torch", pytest.param("triton", marks=[*BACKENDS[1].marks, pytest.mark.slow])]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each op runs on both implementations: the PyTorch twin and the Triton kernels."""
    return request.param


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def hand_written_forwards_stay(monkeypatch):
    """``decoder="auto"`` keeps a hand-written forward only where it times faster on the machine at hand
    than the model's own modules (``rollout/decoders.py``); the tests pin it, so that what they check
    does not depend on a timing. ``tests/rollout/test_interface.py`` tests the choice itself."""
    from fastppo.rollout import decoders

    monkeypatch.setattr(decoders, "_faster", lambda *args: ("lean", None))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(autouse=True)
def heap_choices(monkeypatch):
    """What the runs of a test ask glibc's heap to do with freed memory (``host_memory.py``):
    ``"release"`` or ``"keep"``, recorded and not done: it is the process's setting for good, and
    would change every test after it. Each is measured in processes of their own
    (``tests/trainer/modeling/test_host_memory.py``; the peak releasing cuts: ``test_plan.py``)."""
    from fastppo.trainer.modeling import host_memory

    calls = []
    for choice in ("release", "keep"):
        monkeypatch.setattr(host_memory, f"{choice}_freed_memory", lambda choice=choice: calls.append(choice) or True)
    return calls


@pytest.fixture(autouse=True, scope="session")
def _layout_cache(tmp_path_factory):
    """The rollout's per-machine layout choices (``rollout/calibration.py``) kept for this session
    only, never in the user's cache."""
    from fastppo.rollout import calibration

    path = tmp_path_factory.mktemp("layouts") / "layouts.json"
    original = calibration._cache_file
    calibration._cache_file = lambda: path
    yield path
    calibration._cache_file = original
