"""Data is tokenized once: by one rank per node, into a cache keyed by content, reused by later runs."""

from __future__ import annotations

import json
import sys

import pytest
from transformers import AutoTokenizer

from conftest import REPO, free_port, run_launch
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.data import cache, sources
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.settings.config import RecipeArguments

ROWS = [{"prompt": f"reverse: {w}", "completion": w[::-1]} for w in ("abcde", "fghij", "klmno")]
LORA_TINY = REPO / "configs" / "llama_lora" / "tiny.yaml"

RANK_SCRIPT = """
import json, os, sys
from transformers import AutoTokenizer, TrainingArguments
from fsdp_peft.settings.config import RecipeArguments
from fsdp_peft.data import cache
from fsdp_peft.core.distributed import start_process_group
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.paths import tiny_model_path

start_process_group()  # as the recipes do: the group is torn down at exit while the interpreter is whole
built = []
original = cache.build
cache.build = lambda *args, **kwargs: (built.append(1), original(*args, **kwargs))[1]
args = TrainingArguments(output_dir=sys.argv[3], use_cpu=True, report_to="none")
tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
try:
    cache.load_data(RecipeArguments(train_file=sys.argv[2]), tokenizer, args)
    bad = None
except ConfigError as error:
    bad = str(error)
train, held_out, examples = cache.load_data(RecipeArguments(train_file=sys.argv[1], eval_split=0.34), tokenizer, args)
report = {"rank": args.process_index, "world": args.world_size, "built": len(built), "bad": bad,
          "train": [r["input_ids"] for r in train], "held_out": [e.completion for e in examples]}
# one file a rank: two ranks printing to one pipe can interleave their lines
os.makedirs(sys.argv[3], exist_ok=True)
with open(os.path.join(sys.argv[3], f"rank{args.process_index}.json"), "w") as handle:
    json.dump(report, handle)
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_second_load_reuses_the_tokenized_cache_until_the_file_changes(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FSDP_PEFT_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    first = cache.load_data(RecipeArguments(train_file=str(path)), tokenizer)[0].to_list()
    built = []
    original = cache.build
    monkeypatch.setattr(cache, "build", lambda *a, **k: (built.append(1), original(*a, **k))[1])
    again = cache.load_data(RecipeArguments(train_file=str(path)), tokenizer)[0].to_list()
    assert again == first and built == []
    assert "tokenized once, reused from" in capsys.readouterr().out
    cache.load_data(RecipeArguments(train_file=str(path), max_seq_length=20), tokenizer)  # another setting
    write_jsonl(path, ROWS[:2])  # same name, other content
    assert len(cache.load_data(RecipeArguments(train_file=str(path)), tokenizer)[0]) == 2
    assert built == [1, 1]
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 3


def test_two_ranks_tokenize_on_rank_0_only_and_share_errors(tmp_path, tiny_model_dir):
    good = write_jsonl(tmp_path / "train.jsonl", ROWS)
    bad = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"prompt": "x"}])
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(script),
        str(good),
        str(bad),
        str(tmp_path / "out"),
    ]
    result = run_launch(command, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["rank"], r["world"], r["built"]) for r in ranks] == [(0, 2, 2), (1, 2, 0)]
    assert (
        ranks[0]["bad"]
        == ranks[1]["bad"]
        == f"{bad}: row 2: missing field 'completion'; fix the row or set skip_invalid_rows: true"
    )
    assert ranks[0]["train"] == ranks[1]["train"] and len(ranks[0]["train"]) == 2
    assert ranks[0]["held_out"] == ranks[1]["held_out"] and len(ranks[0]["held_out"]) == 1
    assert result.stdout.count("[fsdp-peft] data: train 2 rows") == 1  # reported by rank 0 only


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data_format", "alpaca"], "data_format: 'alpaca' is not one of auto, prompt_completion, instruction"),
        (["--truncation", "middle"], "truncation: 'middle' is not one of right, left, drop"),
        (["--eval_split", "1.5"], "eval_split: 1.5 is not a fraction in [0, 1)"),
        (
            ["--dataset", "./no/such/dir"],
            "dataset: './no/such/dir' is neither 'tiny-reverse' nor a directory or data file",
        ),
        (["--dataset", "{empty}"], "dataset: directory '{empty}' holds no .jsonl, .json, .parquet, .csv files"),
        (["--train_file", "{text}"], "train_file: '{text}' is not a data file (.jsonl, .json, .parquet, .csv)"),
    ],
)
def test_bad_data_settings_are_config_errors(tmp_path, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    names = {"{empty}": str(tmp_path / "empty"), "{text}": str(tmp_path / "notes.txt")}
    argv = [names.get(a, a) for a in argv]
    for name, value in names.items():
        message = message.replace(name, value)
    with pytest.raises(ConfigError) as error:
        parse_recipe_config(argv, LORA_TINY, str(tmp_path / "out"))
    assert message in str(error.value)


def test_a_hub_dataset_id_passes_validation(tmp_path):
    recipe, _ = parse_recipe_config(
        ["--dataset", "org/chats", "--dataset_eval_split", "test"], LORA_TINY, str(tmp_path)
    )
    assert sources.data_sources(recipe)[1] == sources.Source(hub=("org/chats", None, "test"))
