"""Named harness tasks checked before any weights: how ``fsdp-peft validate`` reads their data."""

from __future__ import annotations

import datasets.config
import huggingface_hub.constants
import pytest

from fsdp_peft.core.errors import ConfigError
from fsdp_peft.core.unreachable_hub import hub_data_out_of_reach_noted
from fsdp_peft.tools.eval_tasks import _load_one


class _HubTaskManager:
    """A harness task manager whose one task's data is on the hub: it records the offline modes it was loaded under."""

    task_index: dict = {}

    def __init__(self):
        self.offline_during_load = None

    def load(self, specs):
        self.offline_during_load = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")


def test_validate_reads_a_tasks_hub_data_from_the_cache_only_and_notes_it_at_once():
    """No retries against an unreachable hub (half a minute offline): the load runs in offline mode, and the modes
    are restored after it."""
    before = huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    manager = _HubTaskManager()
    with hub_data_out_of_reach_noted():
        assert _load_one(manager, "gsm8k", "eval_tasks") is None
    assert manager.offline_during_load == (True, True)
    assert (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == before


def test_a_launch_loads_a_tasks_data_as_configured_and_refuses_what_it_cannot_load():
    before = huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    manager = _HubTaskManager()
    with pytest.raises(ConfigError, match="^eval_tasks: gsm8k: its data could not be loaded"):
        _load_one(manager, "gsm8k", "eval_tasks")
    assert manager.offline_during_load == before


def test_a_harness_task_is_found_in_the_directories_that_name_it_as_the_whole_index_finds_it():
    """validate indexes only the harness directories whose YAML text names the task (the whole ~15k-task index takes
    seconds): each name below, a task, a group and a tag, points at the same definition and children either way."""
    from lm_eval.tasks import TaskManager

    from fsdp_peft.tools.eval_tasks import EVAL_TASKS_DIR, _harness_task_manager

    whole = TaskManager(include_path=[str(EVAL_TASKS_DIR)], include_defaults=True)
    for name in ("gsm8k", "mmlu", "hellaswag", "tiny_reverse_em"):
        narrowed, is_narrowed = _harness_task_manager((EVAL_TASKS_DIR,), (name,))
        assert is_narrowed and len(narrowed.all_tasks) < len(whole.all_tasks) / 10, name
        mine, theirs = narrowed.task_index[name], whole.task_index[name]
        assert (mine.kind, mine.yaml_path, mine.cfg) == (theirs.kind, theirs.yaml_path, theirs.cfg), name
    _, is_narrowed = _harness_task_manager((EVAL_TASKS_DIR,), ("no_such_task_anywhere",))
    assert not is_narrowed  # a name no YAML mentions: the whole index says it is unknown (and suggests one)
