"""What a user can get wrong, refused at start-up in one line naming the field, file or line:
config values and files, prompt files, reward return values, models, and runs that train nothing."""

import json
import re
import subprocess
import sys

import numpy
import pytest
import torch

from fastppo.cli import main as fastppo_main
from fastppo.errors import TrainingFailed, UsageError
from fastppo.trainer import PPOTrainer
from tests.trainer.runs import config, untrained


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(lr=float("inf")), "config field lr must be a finite number, got inf"),
        (dict(no_stop_penalty=float("nan")), "config field no_stop_penalty must be a finite number, got nan"),
        (dict(vf_coef=float("nan")), "config field vf_coef must be a finite number"),
        (dict(vf_coef=-1.0), "config field vf_coef must be >= 0"),
        (dict(entropy_coef=-0.1), "config field entropy_coef must be >= 0"),
        (dict(max_grad_norm=float("inf")), "config field max_grad_norm must be a finite number"),
        (dict(lr="0.001"), "config field lr must be a number, got str '0.001'"),
        (dict(samples_per_prompt=2.5), "config field samples_per_prompt must be an integer, got float 2.5"),
        (dict(save="no"), "config field save must be true or false, got str 'no'"),
        (dict(iterations=True), "config field iterations must be an integer, got bool True"),
        (dict(kl_target="high"), "config field kl_target must be a number or null"),
        (dict(seed=-1), r"config field seed must be in \[0, 2\*\*32\), got -1"),
        (dict(seed=2**64), r"config field seed must be in \[0, 2\*\*32\), got 18446744073709551616"),
        (
            dict(estimator="rloo", samples_per_prompt=1),
            "config field samples_per_prompt must be >= 2 for estimator=rloo",
        ),
        (dict(device="tpu"), "config field device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (dict(device=""), "config field device must be auto, cpu, cuda or cuda:N, got ''"),
        (dict(lora_rank=0), "config field lora_rank must be >= 1, got 0"),
        (dict(lora_rank=-4), "config field lora_rank must be >= 1, got -4"),
        (dict(lora_alpha=16.0), "config field lora_alpha must be > 0, with lora_rank"),
        (dict(lora_target_modules="q_proj"), "config field lora_target_modules needs lora_rank"),
        (dict(merge_lora=True), "config field merge_lora needs lora_rank"),
        (dict(rollout_is_cap=1.0), "config field rollout_is_cap must be > 1, got 1.0"),
        (dict(rollout_is_cap=0.5), "config field rollout_is_cap must be > 1"),
        (dict(save_dtype="bf32"), "config field save_dtype must be one of .*'bfloat16'.*, got 'bf32'"),
        (dict(rollout_dtype="half"), "config field rollout_dtype must be one of"),
        (dict(autocast="yes"), "config field autocast must be true or false or null"),
        (
            dict(rollout_batch_size=4, samples_per_prompt=8),
            "config field rollout_batch_size must be 0 or hold a prompt's",
        ),
        (
            dict(rollout_batch_size=4, samples_per_prompt=2, evaluate=True, eval_samples=5),
            "config field rollout_batch_size must be 0 or hold a prompt's samples",
        ),
    ],
)
def test_config_values_are_checked_by_type_and_range(tmp_path, fields, match):
    with pytest.raises(UsageError, match=match):
        config(tmp_path, **fields)


@pytest.mark.parametrize(
    "name,text,match",
    [
        ("c.toml", 'lr = "0.001"\n', r"config field lr must be a number, got str '0.001' \(in .*c.toml\)"),
        ("c.toml", 'save = "no"\n', r"config field save must be true or false.*c.toml"),
        ("c.toml", "lr = = 1\n", r"--config .*c.toml: does not parse"),
        ("c.json", "[1, 2]", r"a config must be a table of fields, got list \(in .*c.json\)"),
        ("c.json", '{"lr": 0.1,', r"--config .*c.json: does not parse"),
        (
            "c.json",
            '{"iterations": true}',
            r"config field iterations must be an integer, got bool True \(in .*c.json\)",
        ),
        ("c.json", '{"learning_rate": 1}', r"unknown config field\(s\): learning_rate \(in .*c.json\)"),
    ],
)
def test_config_files_name_themselves_in_errors(tmp_path, capsys, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    assert fastppo_main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastppo train: error: "), err
    assert __import__("re").search(match, err), err


def test_a_cli_error_is_one_line_and_exit_2_and_debug_shows_the_traceback(tmp_path):
    command = [sys.executable, "-m", "fastppo", "train", "--lr", "inf", "--out", str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr == "fastppo train: error: config field lr must be a finite number, got inf\n"
    with pytest.raises(UsageError):
        fastppo_main(["train", "--lr", "inf", "--debug"])


def test_bad_lora_and_precision_options_are_one_line_errors_at_start_up(tmp_path, capsys):
    for argv in (["--lora-rank", "0"], ["--rollout-is-cap", "1"], ["--save-dtype", "bfloat"]):
        assert fastppo_main(["train", "--out", str(tmp_path / "run"), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("fastppo train: error: config field") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_a_bool_option_alone_means_true():
    import argparse

    from fastppo.trainer.configuration.arguments import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = vars(parser.parse_args(["--overwrite", "--save", "false", "--critic", "yes"]))
    assert args["overwrite"] is True and args["save"] is False and args["critic"] is True


def test_toml_is_read_with_tomli_where_tomllib_is_missing(tmp_path):
    """Python 3.10 has no tomllib: the config file's reader falls back to tomli, the same parser."""
    pytest.importorskip("tomli")
    path = tmp_path / "c.toml"
    path.write_text("lr = 0.25\n")
    script = (
        "import sys; sys.modules['tomllib'] = None\n"  # import tomllib now fails, as on 3.10
        "from fastppo.trainer.configuration import arguments\n"
        f"assert arguments.tomllib.__name__ == 'tomli'\nprint(arguments.read_config_file({str(path)!r}))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "{'lr': 0.25}"


def test_every_step_skipped_fails_the_run_loudly(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda *_, **__: torch.tensor(float("nan")))
    with pytest.warns(UserWarning, match="optimizer step 1 skipped"), pytest.raises(TrainingFailed, match="all 2"):
        untrained(tmp_path, iterations=2, save=False).train()
    out = tmp_path / "cli"
    with pytest.warns(UserWarning):
        code = fastppo_main(["train", "--iterations", "2", "--out", str(out), "--device", "cpu"])
    assert code == 1 and "fastppo train: failed: all 2 optimizer steps were skipped" in capsys.readouterr().err


# prompts and rewards -------------------------------------------------------------------------


def write_prompts(tmp_path, rows):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows))
    return str(path)


VOWELS = "fastppo.trainer.prompts.tasks:vowels_reward"


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"prompt": "ab"}, {"prompt": ""}], r"p.jsonl:2: the prompt is empty"),
        ([{"prompt": "ab"}, b'{"prompt": "\xff\xfe"}'], r"p.jsonl:2: not UTF-8 text"),
        (
            [{"prompt": "ab"}, {"prompt": 3}],
            r"p.jsonl:2: a prompt must be a non-empty string or a non-empty list of chat "
            r"messages, got int",
        ),
        ([{"prompt": "ab"}, [1, 2]], r"p.jsonl:2: each row must be an object of named fields, got list"),
    ],
)
def test_bad_prompt_rows_are_refused_naming_file_and_line(tmp_path, rows, match):
    with pytest.raises(UsageError, match=match):
        PPOTrainer(config(tmp_path, prompts=write_prompts(tmp_path, rows), reward=VOWELS))


def test_prompts_need_a_reward(tmp_path):
    with pytest.raises(UsageError, match="--prompts needs --reward"):
        PPOTrainer(config(tmp_path, prompts=write_prompts(tmp_path, [{"prompt": "ab"}])))


def test_every_field_any_row_has_reaches_the_reward(tmp_path):
    rows = [{"prompt": "ab", "answer": "1"}, {"prompt": "cd", "topic": "x"}, {"prompt": "ef"}]
    calls = []

    def reward(prompts, completions, **fields):
        calls.append({k: list(v) for k, v in fields.items()})
        return [0.0] * len(completions)

    trainer = PPOTrainer(
        config(
            tmp_path,
            prompts=write_prompts(tmp_path, rows),
            reward=VOWELS,
            prompts_per_iteration=1,
            samples_per_prompt=2,
            save=False,
        ),
        reward_fn=reward,
    )
    for i in range(6):
        trainer.rollout(i)
    assert all(set(call) == {"answer", "topic"} for call in calls)
    seen = {(call["answer"][0], call["topic"][0]) for call in calls}
    assert seen <= {("1", None), (None, "x"), (None, None)} and len(seen) > 1


@pytest.mark.parametrize("value", [numpy.float32(0.5), numpy.int64(1), torch.tensor(0.25), True, 2])
def test_rewards_may_be_any_real_number(tmp_path, value):
    trainer = PPOTrainer(config(tmp_path, save=False), reward_fn=lambda p, c, **_: [value] * len(c))
    scores = trainer.rollout(0).scores
    assert torch.all(scores == float(value))


@pytest.mark.parametrize(
    "value,match",
    [
        ("1.0", "returned str '1.0' for completion 0: scores must be real numbers"),
        (1e300, "returned 1e\\+300 for completion 0: scores must be finite and within float32's range"),
        (torch.ones(2), "scores must be real numbers"),
        (complex(1, 1), "scores must be real numbers"),
    ],
)
def test_rewards_that_are_not_real_fp32_numbers_are_refused(tmp_path, value, match):
    trainer = PPOTrainer(config(tmp_path, save=False), reward_fn=lambda p, c, **_: [value] * len(c))
    with pytest.raises(UsageError, match=match):
        trainer.rollout(0)


# models -------------------------------------------------------------------------------------


def test_a_prompt_longer_than_the_context_is_refused_or_dropped(tmp_path):
    rows = [{"prompt": "ab"}, {"prompt": "c" * 125}, {"prompt": "de"}]  # the default model has 128 positions
    path = write_prompts(tmp_path, rows)
    with pytest.raises(
        UsageError,
        match=r"p.jsonl:2: the prompt is 125 tokens, and with max_new_tokens=8 that "
        r"exceeds the model's context of 128 positions",
    ):
        PPOTrainer(config(tmp_path, prompts=path, reward=VOWELS))
    with pytest.warns(UserWarning, match="dropped 1 of 3 prompts"):
        trainer = PPOTrainer(config(tmp_path, prompts=path, reward=VOWELS, drop_long_prompts=True))
    assert trainer.prompts.texts == ["ab", "de"]


def test_models_that_are_no_causal_lm_are_refused(tmp_path):
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForSequenceClassification

    from fastppo.trainer.modeling.default import char_tokenizer

    tokenizer = char_tokenizer()
    small = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    BertForMaskedLM(BertConfig(**small)).save_pretrained(tmp_path / "bert")
    LlamaForSequenceClassification(
        LlamaConfig(**small, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    ).save_pretrained(tmp_path / "classifier")
    for name in ("bert", "classifier"):
        tokenizer.save_pretrained(tmp_path / name)
    with pytest.raises(UsageError, match=r"--model .*bert \(BertLMHeadModel\) is not causal"):
        PPOTrainer(config(tmp_path, model=str(tmp_path / "bert")))
    with pytest.raises(UsageError, match=r"has no weights for lm_head.weight.*LlamaForSequenceClassification"):
        PPOTrainer(config(tmp_path, model=str(tmp_path / "classifier")))


def test_a_reward_model_without_its_score_head_is_refused(tmp_path):
    """A causal LM given as --reward-model would score with a random head."""
    from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy

    tokenizer = char_tokenizer()
    tiny_policy(tokenizer, seed=0).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(UsageError, match=r"--reward-model .*lm has no weights for score.weight.*LlamaForCausalLM"):
        untrained(tmp_path, reward_model=str(tmp_path / "lm"))


def test_plot_errors_are_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert fastppo_main(["plot", str(tmp_path / "nothing")]) == 2
    assert (
        capsys.readouterr().err
        == f"fastppo plot: error: {tmp_path / 'nothing'} has no metrics.jsonl: not a fastppo run directory\n"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"iteration": 0, "reward_mean": 0.5, "entropy": 1, "response_length": 3}\n{"iter'
    )
    with pytest.warns(UserWarning, match="metrics.jsonl:2: dropping a line"):
        assert fastppo_main(["plot", str(run)]) == 0


def test_the_help_shows_no_markup_and_no_default_of_none(capsys):
    with pytest.raises(SystemExit):
        fastppo_main(["train", "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "(default: None)" not in text
    assert "default: only for gae" in text and "(default: 0.0005)" in text


def test_the_docs_name_every_field_a_resume_may_change_and_no_other():
    from pathlib import Path

    from fastppo.trainer.configuration.config import RESUMABLE, TrainConfig

    docs = (Path(__file__).parents[3] / "docs" / "distributed.md").read_text()
    paragraph = docs[docs.index("A resume may change only") : docs.index("Anything\n  else is refused")]
    named = set(re.findall(r"`([a-z_]+)`", paragraph))
    assert named - {"iterations"} <= set(TrainConfig().flat()), named  # every name a field
    assert named == RESUMABLE, (sorted(named - RESUMABLE), sorted(RESUMABLE - named))
