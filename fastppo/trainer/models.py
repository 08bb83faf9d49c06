"""The models of a run: policy and tokenizer, the frozen reference, and the critic.

Without ``--model`` the policy is the tiny Llama shipped in ``default_model/`` (a character
tokenizer, 2 layers, hidden 64; made by ``scripts/make_default_model.py``, which taught it some
of the built-in arithmetic task). ``tiny_policy`` builds the same architecture untrained.
"""

import copy
import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .errors import UsageError


def char_tokenizer():
    """A character-level fast tokenizer: lowercase letters, digits, space and a few symbols."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz0123456789 +-=?."]
    words = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    words.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_policy(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"


def load_policy(path):
    """``(policy, tokenizer)`` from a local Hugging Face model directory, or the shipped default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = DEFAULT_MODEL if path is None else path

    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"--model {path!r} is not a Hugging Face model directory (no config.json)")
    return load_complete(AutoModelForCausalLM, path, "--model", "a causal LM"), AutoTokenizer.from_pretrained(path)


def load_complete(auto_class, path, option: str, kind: str):
    """``auto_class.from_pretrained(path)``, refusing a checkpoint that lacks some of the model's
    weights: transformers would start them random (an LM head on a sequence classifier, a score
    head on a causal LM) and the run would look healthy while it trains noise."""
    try:
        model, info = auto_class.from_pretrained(path, output_loading_info=True)
    except ValueError as error:  # transformers' word for "no such model class for this config"
        raise UsageError(f"{option} {path}: not {kind} transformers can load ({error})") from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        kinds = ", ".join(getattr(model.config, "architectures", None) or ["?"])
        raise UsageError(
            f"{option} {path} has no weights for {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''}, which would start random: it holds a "
            f"{kinds} checkpoint, not {kind}"
        )
    return model


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


def disable_dropout(model: nn.Module) -> None:
    """Dropout off everywhere: PPO's ratio compares two passes that must see the same network."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def enable_checkpointing(model) -> None:
    """Activation checkpointing of every transformer block, non-reentrant (transformers 5 names the
    method ``activation_checkpointing_enable``, 4.x ``gradient_checkpointing_enable``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's parameters in ``dtype``, in place; buffers (rotary frequencies) keep theirs, as
    transformers keeps them fp32 in a bf16 model."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def copy_in_dtype(model: nn.Module, dtype: Optional[torch.dtype]) -> tuple:
    """``(copy, pairs)``: a copy of ``model`` whose parameters are new tensors in ``dtype`` (None:
    each its own), frozen, made without a full-precision intermediate; ``pairs`` lists ``(copy's,
    original)`` parameters. Tied weights stay tied (both names map to one new tensor); buffers keep
    their dtype."""
    new = {
        id(p): nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), requires_grad=False) for p in model.parameters()
    }
    duplicate = copy.deepcopy(model, memo=dict(new)).eval()
    return duplicate, [(new[id(p)], p) for p in model.parameters()]


def frozen_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen, eval-mode copy of ``model`` with its parameters in ``dtype`` (the reference model)."""
    return copy_in_dtype(model, dtype)[0]


def tied_aliases(model) -> set:
    """The names of parameters that are another's (a tied LM head): each after the first of its
    tensor. A state dict gathered from shards or cast to another dtype holds them as separate
    copies, which would be saved twice."""
    seen, aliases = set(), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            aliases.add(name)
        seen.add(id(parameter))
    return aliases


def save_model(model, directory, dtype: torch.dtype, state_dict: dict = None) -> None:
    """``model.save_pretrained(directory)`` with the weights (default: the model's) in ``dtype`` and
    its config.json saying so: transformers records the in-memory dtype, which for fp32 master
    weights is not the one saved."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    aliases = tied_aliases(model)  # a tied LM head is the embedding: saved once, tied again on load
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items() if k not in aliases}
    model.save_pretrained(str(directory), state_dict=state_dict)
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]  # transformers 5, 4
    config.update({k: name for k in keys})
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class Critic(nn.Module):
    """A value model: a transformer backbone and a scalar head on its last hidden states."""

    def __init__(self, backbone: nn.Module, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    @classmethod
    def from_policy(cls, policy) -> "Critic":
        """The policy's backbone (a copy) with a zero-initialised head."""
        head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return cls(copy.deepcopy(policy.base_model), head)

    @classmethod
    def from_reward_model(cls, path, policy) -> "Critic":
        """A reward model's backbone and its scoring row as the head (it must share the policy's vocabulary)."""
        from transformers import AutoModelForSequenceClassification

        model = load_complete(AutoModelForSequenceClassification, path, "--reward-model", "a sequence classifier")
        if model.config.vocab_size != policy.config.vocab_size:
            raise UsageError(
                f"critic_init=reward_model needs the policy's vocabulary: the reward model has "
                f"{model.config.vocab_size} tokens, the policy {policy.config.vocab_size}"
            )
        score = getattr(model, "score", None)  # the scoring layer of HF's *ForSequenceClassification
        if not isinstance(score, nn.Linear):
            raise UsageError(
                f"critic_init=reward_model: {path} has no linear 'score' layer to start the value head from"
            )
        head = nn.Linear(model.config.hidden_size, 1)
        with torch.no_grad():
            head.weight.copy_(score.weight[:1])
            head.bias.copy_(score.bias[:1] if score.bias is not None else torch.zeros(1))
        return cls(model.base_model, head)

    def forward(self, input_ids, attention_mask, position_ids=None):
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # (B, L), a new tensor rather than a view of the head's (B, L, 1) output (FSDP warns of those)
        return hidden @ self.head.weight[0] + self.head.bias[0]

    HEAD_FILE = "value_head.safetensors"

    def save_pretrained(self, path, state_dict: dict = None) -> None:
        """The backbone in Hugging Face format, the scalar head beside it in safetensors; from
        ``state_dict`` (a sharded critic's, gathered) when given."""
        from safetensors.torch import save_file

        state_dict = self.state_dict() if state_dict is None else state_dict
        part = {
            name: {k.removeprefix(f"{name}."): v for k, v in state_dict.items() if k.startswith(f"{name}.")}
            for name in ("backbone", "head")
        }
        self.backbone.save_pretrained(path, state_dict=part["backbone"])
        save_file({k: v.contiguous() for k, v in part["head"].items()}, str(Path(path) / self.HEAD_FILE))

    @classmethod
    def from_pretrained(cls, path) -> "Critic":
        from safetensors.torch import load_file
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path)
        head = nn.Linear(backbone.config.hidden_size, 1)
        head.load_state_dict(load_file(str(Path(path) / cls.HEAD_FILE)))
        return cls(backbone, head)


class RewardModel:
    """A local Hugging Face sequence-classification model as a reward function: the first logit of
    prompt + completion, scored in batches without gradients."""

    def __init__(self, path, device, dtype: torch.dtype = torch.float32, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(path) / "config.json").is_file():
            raise UsageError(f"--reward-model {path!r} is not a Hugging Face model directory (no config.json)")
        self.model = (
            load_complete(AutoModelForSequenceClassification, path, "--reward-model", "a sequence classifier")
            .to(device)
            .eval()
        )
        cast_parameters(self.model, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device, self.batch_size = device, batch_size
        self.__qualname__ = f"RewardModel({path})"

    @torch.no_grad()
    def __call__(self, prompts, completions, **_):
        scores = []
        texts = [p + c for p, c in zip(prompts, completions)]
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores
