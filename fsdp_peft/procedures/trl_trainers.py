"""TRL's trainers with the recipes' FSDP behaviour: the trainers of the DPO/KTO (`fsdp_peft.procedures.preference`) and
GRPO (`fsdp_peft.procedures.rl`) procedures, in a module of their own so that only a run of those procedures imports
TRL (the procedures' values, keys and rules, which every recipe and ``fsdp-peft validate`` read, do not need it; the
TPU environment has no TRL).
"""

from __future__ import annotations

from trl import DPOTrainer, GRPOTrainer, KTOTrainer

from fsdp_peft.core._compat.trl_patches import trl_without_the_checkpointing_warning
from fsdp_peft.procedures.trainer import PeftFsdpMixin, ReferenceWithoutCopy
from fsdp_peft.tools.generation import parameters_gathered, parse_gather_budget


class PreferenceTrainer(ReferenceWithoutCopy, PeftFsdpMixin, DPOTrainer):
    """TRL's `DPOTrainer` with the recipes' FSDP behaviour; the reference is the adapter-disabled policy."""


class UnpairedPreferenceTrainer(ReferenceWithoutCopy, PeftFsdpMixin, KTOTrainer):
    """TRL's `KTOTrainer` (``loss_type: kto``) with the recipes' FSDP behaviour, the same reference."""


class RolloutTrainer(ReferenceWithoutCopy, PeftFsdpMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` with the recipes' FSDP behaviour: rollouts with every FSDP2 unit gathered once per call,
    prompts tokenized as the recipes' own generation tokenizes them, the adapter-disabled policy as reference."""

    def __init__(self, *args, gather_budget: str = "auto", **kwargs):
        self.gather_budget = gather_budget
        super().__init__(*args, **kwargs)

    def _tokenize_prompts(self, prompts: list):
        """Rendered prompts (chat template applied by `fsdp_peft.data`) tokenized without added special tokens, as
        SFT data and held-out generation tokenize them; chat prompts as TRL does."""
        if prompts and isinstance(prompts[0], str):
            return self.processing_class(text=prompts, add_special_tokens=False)["input_ids"], None, {}
        return super()._tokenize_prompts(prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's sampling, unchanged, with the FSDP2 units kept gathered for the call (up to the gather budget)."""
        arguments = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*arguments)
        with parameters_gathered(self.model_wrapped, parse_gather_budget(self.gather_budget)):
            return super()._generate_single_turn(*arguments)

    def _generate_and_score_completions(self, inputs):
        """TRL's rollouts and scores, without the FutureWarning its checkpointing switches raise (in `_compat`)."""
        with trl_without_the_checkpointing_warning():
            return super()._generate_and_score_completions(inputs)
