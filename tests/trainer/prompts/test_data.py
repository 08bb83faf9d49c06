"""Prompt datasets: the four file formats, column mapping, chat rendering, length limits, the
epoch order and its resumption, and every bad input named at start-up."""

import csv
import json

import pytest

from fastppo.errors import UsageError
from fastppo.trainer.modeling.default import char_tokenizer
from fastppo.trainer.ppo import PPOTrainer
from fastppo.trainer.prompts import dataset
from fastppo.trainer.prompts.files import read_rows
from fastppo.trainer.prompts.order import EpochOrder
from tests.trainer.runs import config, untrained

ROWS = [
    {"question": "ab", "answer": "x #### 1"},
    {"question": "cd", "answer": "y #### 2"},
    {"question": "ef", "answer": "z #### 3"},
]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}. {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def write(path, rows):
    """``rows`` in the format of ``path``'s suffix."""
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_each_format_reads_the_same_rows_and_names_their_places(tmp_path, suffix):
    path = write(tmp_path / f"gsm{suffix}", ROWS)
    rows, origins = read_rows(str(path))
    assert rows == ROWS
    line = {".jsonl": f"{path}:2", ".csv": f"{path}:3"}.get(suffix, f"{path}, row 2")
    assert origins[1] == line


def test_a_json_file_of_one_object_per_line_reads_as_jsonl(tmp_path):
    """What ``datasets.Dataset.to_json`` writes by default, under a .json name."""
    path = tmp_path / "gsm.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rows, origins = read_rows(str(path))
    assert rows == ROWS and origins[2] == f"{path}:3"


@pytest.mark.parametrize("writer,suffix", [("to_json", ".json"), ("to_parquet", ".parquet"), ("to_csv", ".csv")])
def test_what_the_datasets_library_writes_reads_as_it_is(tmp_path, writer, suffix):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / f"gsm{suffix}"
    getattr(datasets.Dataset.from_list(ROWS), writer)(str(path))
    assert read_rows(str(path))[0] == ROWS


def test_the_prompt_field_and_the_field_map_rename_columns_for_the_rewards(tmp_path):
    path = write(tmp_path / "gsm.parquet", [{"problem": "ab", "solution": "1", "level": "3"}])
    trainer = untrained(
        tmp_path, prompts=str(path), reward=["boxed"], prompt_field="problem", field_map=["solution=answer"]
    )
    assert trainer.prompts.texts == ["ab"]
    assert trainer.prompts.fields == [{"answer": "1", "level": "3"}]
    assert trainer.rollouts.fields == ["answer", "level"]


@pytest.mark.parametrize(
    "fields,match",
    [
        (
            dict(prompt_field="prompt"),
            r"--prompt-field prompt: --prompts .*gsm.parquet has no column 'prompt' "
            r"\(its columns: question, answer\)",
        ),
        (
            dict(prompt_field="question", eval_prompts="EVAL", evaluate=True, field_map=["answer=gold"]),
            r"--field-map answer: --eval-prompts .*eval.csv has no column 'answer' \(its columns: question, solution\)",
        ),
        (dict(prompt_field="question", field_map=["solution=answer"]), r"--field-map solution: .* has no column"),
        (dict(prompt_field="question", field_map=["answer"]), r"--field-map entries are column=name"),
        (
            dict(prompt_field="question", reward=["gsm8k"], field_map=["answer=gold"]),
            r"reward gsm8k needs an 'answer' field in every row, and .*gsm.parquet, row 1 has none",
        ),
    ],
)
def test_unknown_columns_are_errors_naming_the_option_and_the_columns(tmp_path, fields, match):
    path = write(tmp_path / "gsm.parquet", ROWS)
    if fields.get("eval_prompts") == "EVAL":  # held-out rows whose answer column has another name
        rows = [{"question": r["question"], "solution": r["answer"]} for r in ROWS]
        fields["eval_prompts"] = str(write(tmp_path / "eval.csv", rows))
    fields = {"reward": ["fastppo.trainer.prompts.tasks:vowels_reward"], **fields}
    with pytest.raises(UsageError, match=match):
        untrained(tmp_path, prompts=str(path), **fields)


@pytest.mark.parametrize(
    "content,match",
    [
        (b"PAR1 but not really", r"--prompts .*bad.parquet: not a readable Parquet file"),
        (b"[]", r"bad.parquet: not a readable Parquet file"),
    ],
)
def test_a_parquet_file_that_is_not_parquet_is_refused(tmp_path, content, match):
    path = tmp_path / "bad.parquet"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=match):
        read_rows(str(path))


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("p.json", '{"prompt": "ab"}', r"a .json file must hold a list of rows"),
        ("p.json", '[{"prompt": "ab"},\n  {"prompt": ]', r"p.json:2: not JSON"),
        ("p.csv", "prompt\nab,cd\n", r"p.csv:2: more values than the header has columns"),
        ("p.txt", "ab", r"unknown format '.txt'"),
        ("p.jsonl", "\n\n", r"p.jsonl: no rows"),
    ],
)
def test_malformed_files_are_refused_naming_the_place(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(UsageError, match=match):
        read_rows(str(tmp_path / name))


def test_chat_prompts_render_as_apply_chat_template_with_the_generation_prompt(tmp_path):
    tokenizer = chat_tokenizer()
    messages = [{"role": "user", "content": "add one and two"}]
    rows = [{"prompt": messages}, {"prompt": "raw text"}]
    loaded = dataset.load(rows, ["a", "b"], tokenizer, config(tmp_path).data, "rows")
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.texts == [expected, "raw text"]
    assert expected == "user add one and two. assistant "
    assert loaded.ids[0] == tokenizer(expected, add_special_tokens=False).input_ids

    chat = config(tmp_path, chat=True, system_prompt="be brief").data
    loaded = dataset.load(rows, ["a", "b"], tokenizer, chat, "rows")
    system = [{"role": "system", "content": "be brief"}]
    assert loaded.texts == [
        tokenizer.apply_chat_template(system + messages, tokenize=False, add_generation_prompt=True),
        "system be brief. user raw text. assistant ",
    ]


def test_a_chat_template_file_replaces_the_tokenizers(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }} = ")
    fields = config(tmp_path, chat_template=str(tmp_path / "t.jinja")).data
    loaded = dataset.load([{"prompt": [{"role": "user", "content": "ab"}]}], ["a"], chat_tokenizer(), fields, "rows")
    assert loaded.texts == ["ab = "]
    with pytest.raises(UsageError, match=r"--chat-template .*missing.jinja: No such file"):
        dataset.load(
            [{"prompt": "ab"}],
            ["a"],
            chat_tokenizer(),
            config(tmp_path, chat_template=str(tmp_path / "missing.jinja")).data,
            "rows",
        )


@pytest.mark.parametrize(
    "prompt,fields,match",
    [
        ([{"role": "user", "content": "ab"}], {}, r"p.jsonl:2: a chat prompt, and the tokenizer has no chat template"),
        ("ab", {"system_prompt": "be brief"}, r"p.jsonl:1: a string prompt cannot take --system-prompt; add --chat"),
        ([{"role": "user"}], {}, r"p.jsonl:2: message 0 must be an object with string 'role' and 'content'"),
        ([], {}, r"p.jsonl:2: a prompt must be a non-empty string or a non-empty list"),
    ],
)
def test_chat_prompts_that_cannot_render_name_the_file_and_line(tmp_path, prompt, fields, match):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "cd"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    with pytest.raises(UsageError, match=match):
        untrained(tmp_path, prompts=str(path), reward=["fastppo.trainer.prompts.tasks:vowels_reward"], **fields)


def test_max_prompt_tokens_drops_longer_prompts_with_a_count(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "ab"}, {"prompt": "abcdef"}, {"prompt": "abc"}])
    with pytest.warns(UserWarning, match="dropped 1 of 3 prompts longer than max_prompt_tokens=3"):
        trainer = untrained(
            tmp_path, prompts=str(path), reward=["fastppo.trainer.prompts.tasks:vowels_reward"], max_prompt_tokens=3
        )
    assert trainer.prompts.texts == ["ab", "abc"]
    with pytest.raises(UsageError, match="no prompt fits"), pytest.warns(UserWarning):
        untrained(
            tmp_path, prompts=str(path), reward=["fastppo.trainer.prompts.tasks:vowels_reward"], max_prompt_tokens=1
        )


def test_each_epoch_visits_every_prompt_once_in_an_order_fixed_by_the_seed():
    order = EpochOrder(5, seed=3)
    stream = order.take(0, 15)
    epochs = [stream[i : i + 5] for i in range(0, 15, 5)]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled each epoch
    assert EpochOrder(5, seed=3).take(7, 6) == stream[7:13]  # any position, in any order of calls
    assert EpochOrder(5, seed=4).take(0, 15) != stream


def test_the_trainer_draws_prompts_in_epochs_and_a_resumed_run_draws_the_same(tmp_path):
    rows = [{"prompt": p} for p in ("ab", "cd", "ef", "gh", "ij", "kl")]
    path = write(tmp_path / "p.jsonl", rows)
    fields = dict(
        prompts=str(path),
        reward=["fastppo.trainer.prompts.tasks:vowels_reward"],
        prompts_per_iteration=4,
        samples_per_prompt=2,
        iterations=3,
        save_every=1,
    )
    drawn = []

    def record(prompts, completions, **_):
        drawn.extend(prompts[::2])
        return [0.5] * len(completions)

    from fastppo.rewards.scoring import Rewards

    straight = untrained(tmp_path / "a", **fields)
    straight.rollouts.rewards = Rewards([("record", record)])
    straight.train()
    assert sorted(drawn[:6]) == sorted(r["prompt"] for r in rows) and len(drawn) == 12
    whole, drawn[:] = list(drawn), []

    interrupted = untrained(tmp_path / "b", **{**fields, "iterations": 1})
    interrupted.rollouts.rewards = Rewards([("record", record)])
    interrupted.train()
    resumed, start = PPOTrainer.resume(tmp_path / "b" / "run", {"iterations": 3})
    resumed.rollouts.rewards = Rewards([("record", record)])
    resumed.train(start)
    assert drawn == whole


def test_eval_prompts_bad_input_is_named_at_start_up(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UsageError, match=r"--eval-prompts .*empty.jsonl: no rows"):
        untrained(tmp_path, eval_prompts=str(tmp_path / "empty.jsonl"), evaluate=True)
    with pytest.raises(UsageError, match="config field eval_samples must be >= 1, got 0"):
        config(tmp_path, eval_samples=0)
    with pytest.raises(UsageError, match=r"config field reward_weights must hold one weight per reward \(2: "):
        config(tmp_path, reward=["gsm8k", "format"], reward_weights=[1.0])
    with pytest.raises(UsageError, match=r"--eval-prompts .*none.jsonl: no such file"):
        untrained(tmp_path, eval_prompts=str(tmp_path / "none.jsonl"), evaluate=True)


def test_string_lists_come_from_repeated_or_spread_options_and_config_files(tmp_path):
    import argparse

    from fastppo.trainer.configuration.arguments import add_arguments, from_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--reward", "gsm8k", "format", "--reward", "m:f", "--reward-weights", "1", "0.2", "3", "--out", str(tmp_path)]
    )
    c = from_arguments(args)
    assert c.reward.reward == ["gsm8k", "format", "m:f"] and c.reward.reward_weights == [1.0, 0.2, 3.0]
    assert config(tmp_path, reward="gsm8k").reward.reward == ["gsm8k"]  # one item alone is a list of one
    with pytest.raises(UsageError, match="config field reward_weights must be a non-empty list of numbers"):
        config(tmp_path, reward_weights=["x"])
