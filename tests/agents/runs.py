"""What the agents' tests share: a character tokenizer whose turns end at ``<eos>``, a short chat
template that shows tool calls and results, tools, environments, reward functions, and trainers
of a tiny model that ends its turns often (``conftest.py`` reads each of its turns as a call: a
random tiny model never writes one itself)."""

import torch

from fastppo.trainer import PPOTrainer, TrainConfig
from fastppo.trainer.modeling.default import tiny_policy

TEMPLATE = (
    "{%- for m in messages -%}{{ m.role[0] }}:{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>'
    "{%- endfor %}<eos>\n{% endfor -%}{%- if add_generation_prompt %}a:{% endif -%}"
)
# a template that drops the tool calls (as many base templates do)
NO_CALLS = "{%- for m in messages -%}{{ m.role }}:{{ m.content }}<eos>{% endfor -%}a:"


def char_tokenizer():
    """Printable ASCII and a newline, one token each; ``<pad>``, ``<eos>``, ``<unk>`` special."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = ["<pad>", "<eos>", "<unk>", "\n", *map(chr, range(32, 127))]
    words = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    words.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def letters(text: str) -> int:
    """Count the letters of a text.

    Args:
        text: The text.
    """
    return sum(c.isalpha() for c in text)


class Counter:
    """An environment: counts the calls of its episode; its reward is that count."""

    def reset(self, **fields):
        self.count = 0

    def step(self, word: str) -> str:
        """Take a step.

        Args:
            word: Any word.
        """
        self.count += 1
        return f"step {self.count}"

    def get_reward(self):
        return float(self.count)


def reward_calls(prompts, completions, **_):
    """The tool messages of each episode (its completion is its messages)."""
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


def turn_taking_policy(tokenizer, seed: int = 0):
    """A tiny random Llama that ends a turn (draws ``<eos>``) about once in five tokens."""
    return end_turns_often(tiny_policy(tokenizer, seed=seed), tokenizer)


def end_turns_often(policy, tokenizer):
    """``policy`` with its head's ``<eos>`` row along the mean of its final hidden states on a
    sample text, so that it ends its turns often."""
    ids = tokenizer("u:abcdefgh ijk lmnop<eos>\na:qrstu vwxyz", return_tensors="pt").input_ids
    with torch.no_grad():
        mean = policy.model(ids).last_hidden_state[0].mean(dim=0)
        policy.lm_head.weight[tokenizer.eos_token_id] = 2.0 * mean / mean.dot(mean)
    return policy


def agent_trainer(tmp_path, rows=None, **fields):
    """A trainer on string prompts (``rows``, else eight short ones) rendered as chat, a tiny Llama,
    tools on."""
    tokenizer = char_tokenizer()
    rows = rows or [{"prompt": p} for p in ("ab", "cde", "f", "ghij", "kl", "mno", "pq", "r")]
    fields = {
        "out": str(tmp_path / "run"),
        "iterations": 2,
        "evaluate": False,
        "save": False,
        "chat": True,
        "tools": ["tests.agents.runs:letters"],
        "max_tool_calls": 2,
        "max_tool_tokens": 40,
        "max_new_tokens": 6,
        "temperature": 0.7,
        "prompts_per_iteration": 4,
        "samples_per_prompt": 2,
        "lr": 1e-3,
        "reward": ["tests.agents.runs:reward_calls"],
        **fields,
    }
    config = TrainConfig.from_flat(fields).validate()
    return PPOTrainer(config, policy=turn_taking_policy(tokenizer), tokenizer=tokenizer, prompts=rows)


class Observed(Counter):
    """An environment whose reset shows the row's ``hint`` field in the prompt."""

    def reset(self, **fields):
        super().reset(**fields)
        self.hint = fields["hint"]
        return f" ({fields['hint']})"


SEEN = []


def remember(prompts, completions, environments=None, **fields):
    """Records what a reward call gets; scores 0."""
    SEEN.append({"prompts": prompts, "completions": completions, "environments": environments, **fields})
    return [0.0] * len(completions)


def never_returns(text: str) -> str:
    """Hang.

    Args:
        text: anything
    """
    import threading

    threading.Event().wait()


def chatml_tokenizer():
    """A character tokenizer with ChatML's ``<|im_start|>`` and ``<|im_end|>`` (its end of turn)."""
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = None
    return tokenizer
