"""Build the model `fastppo train` starts from by default, and ship it in the package.

A tiny Llama (2 layers, hidden 64, a character tokenizer) is trained with plain next-token
supervision on the built-in arithmetic task ("17+25=" -> "42<eos>") for a fixed, small number of
steps: enough that it answers some sums right, few enough that PPO has plenty left to learn.
Deterministic for a given torch version. Run from the repository root:

    python scripts/make_default_model.py        # writes fastppo/trainer/modeling/default_model/
"""

import argparse
import random
from pathlib import Path

import torch

from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy
from fastppo.trainer.prompts.tasks import arithmetic_example, arithmetic_reward

OUT = Path(__file__).resolve().parents[1] / "fastppo" / "trainer" / "modeling" / "default_model"


def batch(tokenizer, rng, size):
    """Inputs and labels (-100 on the prompt) for ``size`` random sums, right-padded."""
    rows = []
    for _ in range(size):
        prompt, answer = arithmetic_example(rng)
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        answer_ids = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt_ids + answer_ids, len(prompt_ids)))
    length = max(len(ids) for ids, _ in rows)
    inputs = torch.full((size, length), tokenizer.pad_token_id)
    labels = torch.full((size, length), -100)
    for i, (ids, prompt_len) in enumerate(rows):
        inputs[i, : len(ids)] = torch.tensor(ids)
        labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return inputs, labels


@torch.no_grad()
def sampled_accuracy(model, tokenizer, count=512, seed=1):
    from fastppo import Sampler

    rng = random.Random(seed)
    examples = [arithmetic_example(rng) for _ in range(count)]
    rollout = Sampler(model, max_batch_size=count, max_seq_len=16).generate(
        [tokenizer(p, add_special_tokens=False).input_ids for p, _ in examples],
        max_new_tokens=4,
        stop_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
    )
    completions = [
        tokenizer.decode(rollout.response_ids[i, : int(n)].tolist(), skip_special_tokens=True)
        for i, n in enumerate(rollout.response_lens)
    ]
    return sum(arithmetic_reward([p for p, _ in examples], completions)) / count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    tokenizer = char_tokenizer()
    model = tiny_policy(tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(args.steps):
        inputs, labels = batch(tokenizer, rng, 64)
        loss = model(input_ids=inputs, attention_mask=(inputs != tokenizer.pad_token_id).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    print(f"{args.steps} steps, loss {loss.item():.3f}, sampled accuracy {sampled_accuracy(model, tokenizer):.3f}")
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
