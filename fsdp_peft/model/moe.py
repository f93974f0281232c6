"""Mixtures of experts: LoRA on the experts, the router, and the rules that keep both right under FSDP.

transformers 5.x keeps a MoE layer's experts as 3D parameters of one module (``mlp.experts.gate_up_proj``
``[experts, out, in]``, ``mlp.experts.down_proj``), not as ``nn.Linear`` layers, so ``target_modules`` cannot
reach them. peft adapts them through ``LoraConfig(target_parameters=...)``: one A/B pair per expert, stacked,
applied by parametrizing the parameter during the experts' forward. ``lora_target_parameters: [auto]`` finds
every such expert parameter of the model (`expert_parameters`), for the families with an entry and for any
model whose experts follow that layout (the generic path). The router (``mlp.gate``) stays frozen unless
``train_router: true`` trains a full copy of it (peft's ``modules_to_save``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from fsdp_peft.settings.families import AUTO_TARGETS, family_for
from fsdp_peft.settings.fsdp_settings import RuleContext

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE/OLMoE, Mixtral, DeepSeek
EXPERTS_MODULE = "experts"
# peft 0.21's LoRA on parameters (ParamWrapper) refuses these; the initialisations read base_layer.weight
PLAIN_LORA_INITS = ("default", "gaussian", "true", "false")


def expert_count(config) -> int:
    """Experts per MoE layer according to a model config; 0 for a dense model."""
    return next((int(getattr(config, key)) for key in EXPERT_COUNT_KEYS if getattr(config, key, None)), 0)


def expert_width(config) -> int:
    """One expert's MLP width: ``moe_intermediate_size`` where the config has it (Qwen-MoE, OLMoE), else Mixtral's
    ``intermediate_size``."""
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def experts_per_token(config) -> int:
    """How many experts each token is routed to (top-k)."""
    return int(getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None) or 1)


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """peft ``target_parameters`` that reach every expert weight: ``<block>.experts.<name>`` for each 3D parameter
    of a module called ``experts`` (what transformers 5 builds for Qwen3-MoE, Mixtral, OLMoE, gpt-oss, ...)."""
    names = set()
    for module_name, module in model.named_modules():
        parts = module_name.split(".")
        if parts[-1] != EXPERTS_MODULE or len(parts) < 2:
            continue
        for parameter_name, parameter in module.named_parameters(recurse=False):
            if parameter.ndim == 3:
                names.add(f"{parts[-2]}.{EXPERTS_MODULE}.{parameter_name}")
    return sorted(names)


def lora_target_parameters(configured: list[str], model: torch.nn.Module) -> list[str] | None:
    """What peft's ``target_parameters`` gets: every expert parameter for ``[auto]``, else the configured names."""
    names = expert_parameters(model) if list(configured) == [AUTO_TARGETS] else list(configured)
    return names or None


def router_modules(model: torch.nn.Module, router: str) -> list[str]:
    """``router`` (the family's router module name, ``gate``) if the model has modules of that name inside a MoE
    block (next to its ``experts``)."""
    parents = {name.rsplit(".", 1)[0] for name, _ in model.named_modules() if name.endswith(f".{EXPERTS_MODULE}")}
    found = any(name.rsplit(".", 1)[0] in parents for name, _ in model.named_modules() if name.endswith(f".{router}"))
    return [router] if found else []


def router_aux_loss_coefficient(config, coefficient: float | None) -> float:
    """The load-balancing loss weight a run trains with: ``router_aux_loss_coef`` as the recipe sets it, else (unset)
    the model config's when its ``output_router_logits`` is on, else 0."""
    if coefficient is not None:
        return float(coefficient)
    return float(config.router_aux_loss_coef or 0.0) if getattr(config, "output_router_logits", False) else 0.0


def configure_router_aux_loss(model: torch.nn.Module, coefficient: float | None) -> float:
    """Apply ``router_aux_loss_coef`` to a MoE model: unset keeps what its config says (the load-balancing loss is
    added when ``output_router_logits``), 0 turns it off, a number turns it on with that weight. Returns the weight
    the run trains with (0: none)."""
    config = model.config
    if not expert_count(config) or not hasattr(model, "router_aux_loss_coef"):
        return 0.0
    coefficient = router_aux_loss_coefficient(config, coefficient)
    config.output_router_logits = coefficient > 0
    config.router_aux_loss_coef = model.router_aux_loss_coef = coefficient
    return coefficient


def router_aux_loss_weight(causal_lm: torch.nn.Module) -> float:
    """The weight of the router's load-balancing loss in ``causal_lm``'s own loss (0: it adds none)."""
    if not getattr(causal_lm.config, "output_router_logits", False):
        return 0.0
    return float(getattr(causal_lm, "router_aux_loss_coef", 0.0) or 0.0)


class RouterAuxLoss:
    """The router's load-balancing loss in a Trainer's step: counted once per optimizer step, and logged.

    The model adds ``weight x aux`` to the loss of every forward. Trainer divides a loss by the gradient accumulation
    only when the model does not normalise by the batch's token count itself, which causal LMs do: the cross-entropy
    parts of the micro-batches add up to one mean, but their aux terms would add up to accumulation x the model's
    figure. `corrected` removes the excess, so a step weighs the aux loss as one forward of the model would; the
    mean aux loss since the last log is reported as ``aux_loss`` (averaged over ranks).
    """

    def __init__(self, weight: float):
        self.weight = weight
        self.total, self.count = 0.0, 0  # a tensor once counted: read back (a device sync) only when logged

    def corrected(self, loss: torch.Tensor, aux: torch.Tensor | None, loss_scale: float, accumulation: int):
        """``loss`` (as Trainer scaled it by ``loss_scale``, its token-count normalisation on) with the aux term
        weighed once per optimizer step of ``accumulation`` micro-batches."""
        if aux is None or not self.weight:
            return loss
        self.total = self.total + aux.detach().float()
        self.count += 1
        return loss - loss_scale * self.weight * aux.to(loss.dtype) * (1 - 1 / accumulation)

    def without_aux(self, loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The cross-entropy part of one forward's ``loss``, as the model computed it (no Trainer scaling)."""
        return loss if aux is None or not self.weight else loss - self.weight * aux.to(loss.dtype)

    def pop_mean(self) -> float | None:
        """The mean aux loss of this rank's forwards since the last call; ``None`` when there were none."""
        if not self.count:
            return None
        mean, self.total, self.count = float(self.total) / self.count, 0.0, 0
        return mean


def moe_config(recipe):
    """The model config when ``recipe``'s model is a mixture of experts (on this machine, or a shipped config's hub
    model); else ``None``."""
    from fsdp_peft.model.paths import known_model_config  # lazy: paths builds tiny models through transformers

    try:
        config = known_model_config(recipe.model_name_or_path, recipe.trust_remote_code)
    except (OSError, ValueError):
        return None  # not here yet, or not loadable: other rules say so
    return config if expert_count(config) else None


def experts_adapted(recipe) -> bool:
    """Whether the recipe puts LoRA on a mixture of experts' expert parameters."""
    return bool(recipe.lora_target_parameters) and moe_config(recipe) is not None


def expert_adapters_have_no_dropout(context: RuleContext) -> str | None:
    recipe = context.recipe
    if recipe.lora_dropout and experts_adapted(recipe):
        return (
            f"lora_dropout: {recipe.lora_dropout}: LoRA on expert parameters (lora_target_parameters, peft's "
            "target_parameters) has no dropout in peft 0.21; set lora_dropout: 0, or lora_target_parameters: [] "
            "to leave the experts frozen"
        )
    return None


def expert_adapters_are_plain_lora(context: RuleContext) -> str | None:
    recipe = context.recipe
    variant = "use_dora: true" if recipe.use_dora else None
    if str(recipe.init_lora_weights).lower() not in PLAIN_LORA_INITS:
        variant = f"init_lora_weights: {recipe.init_lora_weights}"
    if variant and experts_adapted(recipe):
        return (
            f"{variant}: peft 0.21 has neither DoRA nor initialisations from the base weights for expert parameters; "
            "use plain LoRA, or lora_target_parameters: [] to adapt attention only"
        )
    return None


def expert_adapters_run_under_fsdp2(context: RuleContext) -> str | None:
    recipe = context.recipe

    settings = context.fsdp
    if settings is not None and settings.version == 1 and experts_adapted(recipe):
        return (
            "fsdp: FSDP1 cannot run LoRA on expert parameters: peft reads their adapter weights without calling the "
            "module that holds them, so FSDP1 hands it the empty shard; use FSDP2 "
            "(configs/accelerate/cpu_fsdp2.yaml, fsdp2.yaml), or lora_target_parameters: [] to adapt attention only"
        )
    return None


def moe_keys_need_a_mixture_of_experts(context: RuleContext) -> str | None:
    recipe = context.recipe
    explicit = recipe.lora_target_parameters not in ([], [AUTO_TARGETS])
    asked = [key for key, on in (("train_router", recipe.train_router), ("lora_target_parameters", explicit)) if on]
    if asked and moe_config(recipe) is None:
        from fsdp_peft.model.paths import resolve_model_path  # lazy: as in moe_config

        if (Path(resolve_model_path(recipe.model_name_or_path)).expanduser() / "config.json").is_file():
            return (
                f"{asked[0]}: {recipe.model_name_or_path} is not a mixture of experts (its config names no experts); "
                f"remove {asked[0]}"
            )
    coefficient = recipe.router_aux_loss_coef
    if coefficient is not None and not (math.isfinite(coefficient) and coefficient >= 0):
        return f"router_aux_loss_coef: {recipe.router_aux_loss_coef} must be 0 (off) or more; unset: the model's own"
    return None


def moe_targets_reach_the_experts(context: RuleContext) -> str | None:
    """Experts through ``lora_target_parameters`` only (peft would turn ``all-linear`` or the router's name into
    targets of its own choosing, the router among them), and names there that reach expert parameters; read from a
    weightless copy of the model."""
    recipe = context.recipe
    config = moe_config(recipe)
    if config is None:
        return None
    from transformers import AutoModelForCausalLM  # lazy: only a mixture of experts is built, on meta

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.trust_remote_code)
    experts, name = expert_parameters(model), recipe.model_name_or_path
    router = family_for(config.model_type).router_module or "gate"
    odd = [target for target in recipe.lora_target_modules if target in ("all-linear", router)]
    if experts and odd:
        return (
            f"lora_target_modules: {odd[0]} on the mixture of experts {name}: peft would also put LoRA on the router "
            "and choose the experts' ranks itself; use auto (attention), lora_target_parameters for the experts "
            "and train_router: true for the router"
        )
    wanted = [] if recipe.lora_target_parameters == [AUTO_TARGETS] else recipe.lora_target_parameters
    unknown = [t for t in wanted if not any(e == t or e.endswith(f".{t}") for e in experts)]
    if unknown:
        return f"lora_target_parameters: {unknown} name no expert parameter of {name}; it has {experts} (auto: all)"
    return None
