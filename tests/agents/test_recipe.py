"""The tools recipe (``recipes/tools_multiply.toml``), run as written but for its model and sizes:
a tiny random Llama with a ChatML character vocabulary, through the command line, from the
repository's root (the recipe names its template by a path from there)."""

import json
from pathlib import Path

from fastppo.cli import main as fastppo_main
from tests.agents.runs import chatml_tokenizer, turn_taking_policy

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tools_multiply.toml"


def test_the_tools_recipe_runs_episodes_and_evaluates_them(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chatml_tokenizer()
    small = turn_taking_policy(tokenizer)
    config = LlamaConfig(**{**small.config.to_dict(), "max_position_embeddings": 2048})
    model = LlamaForCausalLM(config)
    model.load_state_dict(small.state_dict())
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    args = ["--config", str(RECIPE), "--model", str(tmp_path / "model"), "--out", str(out)]
    sizes = dict(prompts_per_iteration=2, samples_per_prompt=2, max_new_tokens=8, iterations=1, eval_samples=2)
    args += [word for name, value in sizes.items() for word in ("--" + name.replace("_", "-"), str(value))]
    args += ["--eval-prompts", str(_held_out(tmp_path))]
    assert fastppo_main(["train", *args]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "tools/calling" in rows[0] and "reward/multiply" in rows[0]
    assert [r["iteration"] for r in rows if "eval/tools/calling" in r] == [0, 1]
    prompt = json.loads((out / "completions.jsonl").read_text().splitlines()[0])["prompt"]
    assert '"name": "calculator"' in prompt and "What is 512 * 34?" in prompt


def _held_out(tmp_path: Path) -> Path:
    from fastppo.trainer.prompts.tasks import multiply_eval_prompts

    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in multiply_eval_prompts(count=2)))
    return path
