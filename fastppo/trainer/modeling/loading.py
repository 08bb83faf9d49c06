"""The policy and its tokenizer loaded from a local Hugging Face directory (or the shipped default),
and checked: causal, and the context it was built for.
"""

from pathlib import Path

import torch

from ...errors import UsageError
from ...hf import load_complete
from .default import DEFAULT_MODEL


def load_policy(path):
    """``(policy, tokenizer)`` from a local Hugging Face model directory, or the shipped default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = DEFAULT_MODEL if path is None else path

    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"--model {path!r} is not a Hugging Face model directory (no config.json)")
    return load_complete(AutoModelForCausalLM, path, "--model", "a causal LM"), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def check_causal(model, name) -> None:
    """Refuse a model whose first position sees later tokens (BERT loaded as an LM, say): two inputs
    that differ only at position 1 must give the same logits at position 0."""
    vocab = model.config.vocab_size
    if vocab < 3:
        return
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2], [1, vocab - 1]], device=device)
    was_training = model.training
    model.eval()
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0].float()  # (2, V)
    model.train(was_training)
    if not torch.allclose(logits[0], logits[1], rtol=1e-3, atol=1e-4):
        raise UsageError(
            f"--model {name} ({type(model).__name__}) is not causal: its first position sees the "
            "tokens after it, so it cannot generate (an encoder such as BERT?)"
        )


def context_length(model):
    """The most positions the model was built for, or None when its config does not say."""
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
