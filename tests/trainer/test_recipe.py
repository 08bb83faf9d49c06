"""The GSM8K recipe (``recipes/gsm8k.toml``), run as written but for its paths and sizes, which the
command line overrides: a tiny random Llama with a byte-level vocabulary and a ChatML
(Qwen2.5-style) chat template, on small GSM8K-format parquet files written here."""

import json
import random
import re
from pathlib import Path

import pytest

from fastppo.cli import main as fastppo_main

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k.toml"
CHATML = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def recipe(**changes) -> list:
    """``fastppo train`` arguments: the recipe, then ``changes`` over its fields."""
    return [
        "--config",
        str(RECIPE),
        *[word for name, value in changes.items() for word in ("--" + name.replace("_", "-"), str(value))],
    ]


def instruct_model(directory: Path) -> str:
    """A random tiny Llama whose tokenizer knows printable ASCII and ChatML's markers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    symbols = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "\n"] + [chr(c) for c in range(32, 127)]
    words = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex("<\\|im_start\\|>|<\\|im_end\\|>|."), behavior="isolated")
    words.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def gsm8k_rows(count: int, seed: int) -> list:
    """GSM8K-format rows: a word problem, and a worked answer ending in ``#### <number>``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
                "answer": f"Tom has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }
        )
    return rows


def test_the_recipe_trains_and_reports_held_out_accuracy(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    import pyarrow
    import pyarrow.parquet

    model = instruct_model(tmp_path / "model")
    for name, rows in (("train", gsm8k_rows(12, 0)), ("test", gsm8k_rows(6, 1))):
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    out = tmp_path / "run"
    args = recipe(
        model=model,
        prompts=tmp_path / "train.parquet",
        eval_prompts=tmp_path / "test.parquet",
        out=out,
        prompts_per_iteration=4,
        samples_per_prompt=4,
        max_new_tokens=12,
        iterations=3,
        eval_every=2,
        eval_samples=2,
    )

    from transformers import AutoTokenizer

    from fastppo.trainer import PPOTrainer
    from fastppo.trainer.configuration.arguments import from_arguments

    parsed = _parse(args)  # the prompts as the trainer renders them: the chat template's
    config = from_arguments(parsed)
    assert (
        config.data.system_prompt,
        config.data.max_prompt_tokens,
        config.algo.clip_eps_high,
        config.algo.mask_truncated,
    ) == ("Solve the problem step by step. End with the final answer after ####.", 256, 0.28, True)  # the file's
    trainer = PPOTrainer(config)
    tokenizer, train_rows = AutoTokenizer.from_pretrained(model), gsm8k_rows(12, 0)
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": config.data.system_prompt}, {"role": "user", "content": row["question"]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for row in train_rows
    ]
    assert trainer.prompts.texts == rendered
    assert rendered[0].startswith("<|im_start|>system\nSolve the problem")
    assert trainer.prompts.fields[0] == {"answer": train_rows[0]["answer"]}
    del trainer

    assert fastppo_main(["train", *args]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert all("reward/gsm8k" in r for r in rows[:3])
    assert [r["iteration"] for r in rows if "eval/greedy" in r] == [0, 2, 3]
    printed = capsys.readouterr().out
    assert re.search(
        r"held-out \(6 prompts\): greedy \d\.\d{3} -> \d\.\d{3}, pass@2 \d\.\d{3} -> \d\.\d{3} "
        r"\(iteration 0 -> 3\)",
        printed,
    ), printed
    assert (out / "policy" / "model.safetensors").is_file()


def _parse(args: list):
    import argparse

    from fastppo.trainer.configuration.arguments import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args)
