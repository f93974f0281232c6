"""Model families: what the recipes need to know about Llama, Qwen, Mistral and their MoE kin, one entry each.

An entry is found by the model config's ``model_type``. It names the decoder layer class (one FSDP
unit each), the modules LoRA adapts by default (``lora_target_modules: [auto]``), the token padding
uses when the tokenizer has none, what to do when a checkpoint has no chat template, and the embedded
tiny model of the same architecture (``tiny-<name>``) that stands in for it on a CPU.

A causal LM with no entry takes the generic path: its ``_no_split_modules`` are the units and LoRA
adapts every linear layer except the output head (peft's ``all-linear``). Add an entry only when a
family needs something else; everything else in fsdp_peft reads these fields and nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION_AND_MLP = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
AUTO_TARGETS = "auto"


@dataclass(frozen=True)
class VisionLayout:
    """Where a vision-language model keeps its parts (module paths from the ``...ForConditionalGeneration``)."""

    tower: str  # the vision encoder: frozen and 16-bit unless adapted (`fsdp_peft.model.vision`)
    projector: str  # vision features -> text embeddings; trained as a full copy with ``train_projector``
    language_model: str  # the decoder that LoRA adapts by default
    block: str  # the vision encoder's layer class: one FSDP unit each
    # Its forward takes input_ids or inputs_embeds, not both (Qwen3-VL): a text-only forward that runs the tower on a
    # blank image (`fsdp_peft.model.vision`) passes embeddings, with the 3D rotary positions the model would give its
    # ids
    positions_from_ids: bool = False


@dataclass(frozen=True)
class Family:
    """How one model family is fine-tuned; see the module docstring for each field's use."""

    name: str
    model_types: tuple[str, ...]
    decoder_layer: str | None  # None: the model's own _no_split_modules
    lora_target_modules: tuple[str, ...]
    pad_tokens: tuple[str, ...]  # tried in order when the tokenizer has no pad token; then EOS
    chat_template_hint: str  # the fix when use_chat_template is on and the checkpoint has no template
    tiny_model: str | None  # embedded stand-in, built by fsdp_peft.model.tiny
    tiny_architecture: str | None  # its transformers class
    router_module: str | None = None  # mixture of experts: the router's module name (``train_router``)
    vision: VisionLayout | None = None  # a vision-language model: its parts


FAMILIES = (
    Family(
        name="llama",
        model_types=("llama",),
        decoder_layer="LlamaDecoderLayer",
        lora_target_modules=ATTENTION_AND_MLP,
        pad_tokens=("<|finetune_right_pad_id|>",),  # Llama 3.1+ reserves it for padding
        chat_template_hint="use the -Instruct checkpoint, whose tokenizer has the Llama 3 chat template",
        tiny_model="tiny-llama",
        tiny_architecture="LlamaForCausalLM",
    ),
    Family(
        name="qwen2",
        model_types=("qwen2",),
        decoder_layer="Qwen2DecoderLayer",
        lora_target_modules=ATTENTION_AND_MLP,
        pad_tokens=("<|endoftext|>",),  # what Qwen's own tokenizers pad with
        chat_template_hint="use a Qwen2.5 -Instruct checkpoint (ChatML template)",
        tiny_model="tiny-qwen2",
        tiny_architecture="Qwen2ForCausalLM",
    ),
    Family(
        name="qwen3",
        model_types=("qwen3",),
        decoder_layer="Qwen3DecoderLayer",
        lora_target_modules=ATTENTION_AND_MLP,
        pad_tokens=("<|endoftext|>",),
        chat_template_hint="Qwen3 checkpoints ship a ChatML template; check the tokenizer files of your copy",
        tiny_model="tiny-qwen3",
        tiny_architecture="Qwen3ForCausalLM",
    ),
    Family(
        name="mistral",
        model_types=("mistral",),
        decoder_layer="MistralDecoderLayer",
        lora_target_modules=ATTENTION_AND_MLP,
        pad_tokens=("<unk>",),  # Mistral defines no pad token; <unk> never occurs in real text
        chat_template_hint="use the -Instruct checkpoint ([INST] template)",
        tiny_model="tiny-mistral",
        tiny_architecture="MistralForCausalLM",
    ),
    # Mixtures of experts: LoRA on attention here, on the experts through `fsdp_peft.model.moe` (3D parameters, not
    # Linear
    # layers; peft would turn MLP or router names here into expert and router targets of its own choosing)
    Family(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        decoder_layer="Qwen3MoeDecoderLayer",
        lora_target_modules=ATTENTION,
        pad_tokens=("<|endoftext|>",),
        chat_template_hint="Qwen3 checkpoints ship a ChatML template; check the tokenizer files of your copy",
        tiny_model="tiny-qwen3-moe",
        tiny_architecture="Qwen3MoeForCausalLM",
        router_module="gate",
    ),
    Family(
        name="mixtral",
        model_types=("mixtral",),
        decoder_layer="MixtralDecoderLayer",
        lora_target_modules=ATTENTION,
        pad_tokens=("<unk>",),
        chat_template_hint="use the -Instruct checkpoint ([INST] template)",
        tiny_model="tiny-mixtral",
        tiny_architecture="MixtralForCausalLM",
        router_module="gate",
    ),
    # Vision-language models: LoRA on the language model's layers by default (`fsdp_peft.model.vision`)
    Family(
        name="qwen2_5_vl",
        model_types=("qwen2_5_vl",),
        decoder_layer="Qwen2_5_VLDecoderLayer",
        lora_target_modules=ATTENTION_AND_MLP,
        pad_tokens=("<|endoftext|>",),
        chat_template_hint="use a Qwen2.5-VL -Instruct checkpoint (ChatML template with image parts)",
        tiny_model="tiny-qwen2.5-vl",
        tiny_architecture="Qwen2_5_VLForConditionalGeneration",
        vision=VisionLayout(
            tower="model.visual",
            projector="model.visual.merger",
            language_model="model.language_model",
            block="Qwen2_5_VLVisionBlock",
        ),
    ),
    Family(
        name="qwen3_vl",
        model_types=("qwen3_vl",),
        decoder_layer="Qwen3VLTextDecoderLayer",
        lora_target_modules=ATTENTION_AND_MLP,
        pad_tokens=("<|endoftext|>",),
        chat_template_hint="use a Qwen3-VL -Instruct checkpoint (ChatML template with image parts)",
        tiny_model="tiny-qwen3-vl",
        tiny_architecture="Qwen3VLForConditionalGeneration",
        vision=VisionLayout(
            tower="model.visual",
            projector="model.visual.merger",  # the deepstack mergers (model.visual.deepstack_merger_list) stay frozen
            language_model="model.language_model",
            block="Qwen3VLVisionBlock",
            positions_from_ids=True,
        ),
    ),
    Family(
        name="gemma3",
        model_types=("gemma3",),
        decoder_layer="Gemma3DecoderLayer",
        lora_target_modules=ATTENTION_AND_MLP,
        pad_tokens=("<pad>",),
        chat_template_hint="use a Gemma 3 -it checkpoint (its template has image parts)",
        tiny_model="tiny-gemma3-vl",
        tiny_architecture="Gemma3ForConditionalGeneration",
        vision=VisionLayout(
            tower="model.vision_tower",
            projector="model.multi_modal_projector",
            language_model="model.language_model",
            block="SiglipEncoderLayer",
        ),
    ),
)

GENERIC = Family(
    name="generic",
    model_types=(),
    decoder_layer=None,
    lora_target_modules=("all-linear",),
    pad_tokens=(),
    chat_template_hint="set use_chat_template: false, or use a checkpoint whose tokenizer has a chat template",
    tiny_model=None,
    tiny_architecture=None,
)


def family_for(model_type: str | None) -> Family:
    """The entry for a config's ``model_type``; the generic family when none matches."""
    return next((family for family in FAMILIES if model_type in family.model_types), GENERIC)


def family_of_model(model) -> Family:
    """The entry for a (possibly PEFT-wrapped) model, from its config's ``model_type``."""
    return family_for(getattr(getattr(model, "config", None), "model_type", None))


def tiny_family(name: str) -> Family | None:
    """The family whose embedded tiny model is called ``name`` (``tiny-qwen2``), if any."""
    return next((family for family in FAMILIES if family.tiny_model == name), None)


def lora_targets(configured: list[str], family: Family) -> str | list[str]:
    """What peft's ``target_modules`` gets: the family's default for ``[auto]``, else the configured names."""
    targets = list(family.lora_target_modules) if configured == [AUTO_TARGETS] else configured
    return targets[0] if targets == ["all-linear"] else targets


def pad_token_for(tokenizer, family: Family) -> str:
    """The pad token to set on a tokenizer that has none: the family's choice when in the vocabulary, else EOS."""
    vocabulary = tokenizer.get_vocab()
    return next((token for token in family.pad_tokens if token in vocabulary), tokenizer.eos_token)
