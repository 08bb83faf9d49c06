"""fastppo's device code: Triton kernels and the thin launchers that run them.

One module per kernel family, named by its op (``token_logprobs``, ``ppo_policy_loss``, ``gae``,
``sample_tokens``, ``decode_attention``), as its PyTorch twin is (``fastppo/ops/<family>_torch.py``);
each launcher takes tensors already shaped the way its kernel expects and writes into output
tensors it is given. Nothing here validates arguments, chooses dtypes or knows about autograd: that is the job
of ``fastppo.ops``. ``contract`` declares what the kernels and their PyTorch twins agree on (the
launchers' signatures, the types they take, the layouts they write) and imports no triton, so the
families are imported on first use, not with the package; ``vectors`` is what the vocabulary
kernels share to read rows that start between 16-byte vectors.
"""

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

FAMILIES = ("token_logprobs", "ppo_policy_loss", "gae", "sample_tokens", "decode_attention")
__all__ = [*FAMILIES, "contract"]


def __getattr__(name):
    if name in FAMILIES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hand_over_to_the_distribution():
    """This folder installs as ``fastppo.kernels``. Imported as a top-level ``kernels``, it is only
    because the repository root is on ``sys.path`` (pytest, ``python -m`` from the root) ahead of
    the ``kernels`` distribution (Hugging Face's, which transformers 5.25 on imports): put that
    in its place, so the import gets what it asked for. The importer returns what
    ``sys.modules`` holds once this runs. Without the distribution this module stays, as
    transformers before 5.25 expects: it imports whatever ``kernels`` is found and, finding no
    version of it installed, leaves it alone."""
    root = Path(__file__).resolve().parents[1]
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_to_the_distribution()
