"""``max_eval_samples``: the rows every evaluation reads, cut before the trainer prepares them."""

from __future__ import annotations

import dataclasses

import torch

from conftest import REPO
from fsdp_peft.data.cache import load_data
from fsdp_peft.data.packing import data_collator
from fsdp_peft.data.vision_rows import RowsDataset
from fsdp_peft.model.modeling import attach_lora, load_base_model, load_tokenizer
from fsdp_peft.procedures.trainer import PeftFsdpTrainer, first_rows
from fsdp_peft.recipe import parse_recipe_config


def test_the_trainer_evaluates_the_first_max_eval_samples_rows(tmp_path):
    config = REPO / "configs" / "llama_lora" / "tiny.yaml"
    argv = ["--config", str(config), "--output_dir", str(tmp_path), "--max_eval_samples", "8"]
    recipe, training = parse_recipe_config(argv, config, str(tmp_path))
    tokenizer = load_tokenizer(recipe)
    train_rows, eval_rows, _ = load_data(recipe, tokenizer, training)
    trainer = PeftFsdpTrainer(
        model=attach_lora(load_base_model(recipe, training), recipe, training),
        args=training,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        data_collator=data_collator(recipe, tokenizer),
        processing_class=tokenizer,
        recipe_config=dataclasses.asdict(recipe),
    )
    assert len(eval_rows) == 200 and len(trainer.eval_dataset) == 8
    assert [row["input_ids"] for row in trainer.eval_dataset] == [eval_rows[i]["input_ids"] for i in range(8)]
    assert len(trainer.get_eval_dataloader()) == -(-8 // training.per_device_eval_batch_size)


def test_first_rows_of_a_torch_dataset_and_past_its_end():
    rows = RowsDataset(list("abcde"))
    assert [first_rows(rows, 3)[i] for i in range(3)] == ["a", "b", "c"] and len(first_rows(rows, 9)) == 5
    assert isinstance(first_rows(rows, 3), torch.utils.data.Dataset)
