"""The peers' released code, fetched from the package registry into a cache, and how to run it.

Each release is its wheel from the registry (``pip download --no-deps``), unpacked under
``$FASTPPO_PEER_CACHE`` (default ``~/.cache/fastppo/peers``) and kept there between runs. Its
dependencies are not installed with it: verl and OpenRLHF require Ray, vLLM and CUDA builds that
a CPU machine cannot install. The light ones the compared functions and the peers' own CPU tests
import are installed, pinned, into a directory per set (``pip install --no-deps --target``), and
Ray, vLLM and flash-attn (and verl's TransferQueue) are stood in for by ``inside/peer_stubs.py``.
Everything runs in a child interpreter whose path puts the release first, so the release is what
``importlib.metadata`` reports and what the drop-ins follow. A registry that cannot be reached
raises :class:`Unreachable`, which the tests turn into a skip that says so.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

CACHE = Path(os.environ.get("FASTPPO_PEER_CACHE", Path.home() / ".cache" / "fastppo" / "peers"))
INSIDE = Path(__file__).resolve().parent / "inside"

_AIOHTTP = [
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "attrs==26.1.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
]
_REQUESTS = [
    "requests==2.34.2",
    "urllib3==2.8.0",
    "charset-normalizer==3.5.3",
    "certifi==2026.10.19.post1",
    "idna==3.20",
]
# What each peer's compared modules and own CPU tests import, beyond this project's own dependencies.
DEPENDENCIES = {
    "verl": [
        "omegaconf==2.3.1",
        "antlr4-python3-runtime==4.9.3",
        "hydra-core==1.3.8",
        "tensordict==0.10.0",
        "cloudpickle==3.1.3",
        "orjson==3.13.0",
        "pyvers==0.2.3",
        "codetiming==1.4.0",
        "cachetools==8.0.2",
        "uvicorn==0.54.0",
        "fastapi==0.165.0",
        "starlette==1.10.0",
        "torchdata==0.11.0",
        "opentelemetry-api==1.45.2",
        "opentelemetry-sdk==1.45.2",
        "opentelemetry-semantic-conventions==0.66b2",
        "importlib-metadata==10.2.0",
        "zipp==4.1.2",
        "tyro==1.0.17",
        "docstring-parser==0.18.0",
        *_AIOHTTP,
    ],
    # verl before 0.7.1 imports names transformers 5 removed (AutoModelForVision2Seq)
    "verl-transformers-4": ["transformers==4.57.6", "tokenizers==0.22.1", "huggingface-hub==0.36.2", *_REQUESTS],
    "openrlhf": ["hjson==3.1.0", "einops==0.8.2", "msgpack==1.2.4", "pylatexenc==2.11", "torchdata==0.11.0", *_AIOHTTP],
    "trl": _REQUESTS,  # TRL before 1.15 imports requests for its vLLM client
}
# Built from its source distribution against the installed torch (DS_BUILD_OPS=0: no compiled ops).
SOURCE_BUILDS = {"openrlhf": ["deepspeed==0.19.8"]}


class Unreachable(RuntimeError):
    """The package registry could not provide a release or a dependency."""


def _pip(*args, env=None) -> None:
    command = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise Unreachable(
            f"pip {' '.join(args[:1])} {' '.join(a for a in args if '==' in a)} failed: "
            f"{lines[-1] if lines else 'no output'}"
        )


@contextmanager
def _cached(target: Path):
    """Build ``target`` in a staging directory: yields None if ``target`` is already complete, else the
    staging path; on success it is marked complete and renamed into place (a crash leaves no half
    copy to be trusted), on failure removed."""
    if (target / ".complete").exists():
        yield None
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (staging / ".complete").touch()
    try:
        staging.rename(target)
    except OSError:  # another run published it first
        shutil.rmtree(staging, ignore_errors=True)


def release(distribution: str, version: str) -> Path:
    """The unpacked wheel of ``distribution==version``: its packages and ``.dist-info`` at the top."""
    target = CACHE / "releases" / f"{distribution}-{version}"
    with _cached(target) as staging:
        if staging is not None:
            download = staging / ".download"
            _pip("download", "--no-deps", "--only-binary=:all:", "--dest", str(download), f"{distribution}=={version}")
            wheels = list(download.glob("*.whl"))
            if len(wheels) != 1:
                raise Unreachable(f"{distribution}=={version}: expected one wheel, got {[w.name for w in wheels]}")
            with zipfile.ZipFile(wheels[0]) as archive:
                archive.extractall(staging)
            shutil.rmtree(download)
    return target


def source(root: Path) -> Path:
    """Where a release's packages are: the wheel's top, or its ``.data/purelib`` (OpenRLHF's layout)."""
    purelib = [path for path in root.glob("*.data/purelib") if path.is_dir()]
    return purelib[0] if purelib else root


def dependencies(name: str) -> Path:
    """The pinned dependency set ``name`` (a key of ``DEPENDENCIES``), installed into its own directory."""
    requirements = DEPENDENCIES.get(name, []) + SOURCE_BUILDS.get(name, [])
    tag = f"{sys.version_info.major}{sys.version_info.minor}"
    digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:10]
    target = CACHE / "dependencies" / f"{name}-py{tag}-{digest}"
    with _cached(target) as staging:
        if staging is not None:
            if DEPENDENCIES.get(name):
                _pip("install", "--no-deps", "--target", str(staging), *DEPENDENCIES[name])
            build = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
            for requirement in SOURCE_BUILDS.get(name, []):
                _pip("install", "--no-deps", "--no-build-isolation", "--target", str(staging), requirement, env=build)
    return target


def environment(paths: list, **extra) -> dict:
    """The child interpreter's environment: ``paths`` first on its path, then the stand-ins."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(
        PYTHONPATH=os.pathsep.join(str(p) for p in [INSIDE, *paths]),
        PYTHONNOUSERSITE="1",
        TORCHDYNAMO_DISABLE="1",  # OpenRLHF compiles a helper; the compared values are the same eager
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        DS_ACCELERATOR="cpu",
        **extra,
    )
    return env
