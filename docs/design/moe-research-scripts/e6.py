import torch, copy
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
m = Qwen3MoeForCausalLM(cfg)
try:
    get_peft_model(copy.deepcopy(m), LoraConfig(r=4, lora_dropout=0.05, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))
    print("dropout 0.05: ok")
except Exception as e: print("dropout 0.05:", type(e).__name__, str(e)[:100])
pm = get_peft_model(copy.deepcopy(m), LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"], modules_to_save=["gate"]))
print("trainable non-lora:", [(n, tuple(p.shape)) for n, p in pm.named_parameters() if p.requires_grad and "lora" not in n])
x = torch.randint(0, 300, (2, 12)); out = pm(x, labels=x)
print("router logits captured:", len(out.router_logits), "aux", out.aux_loss.item())
out.loss.backward()
print("router grad nonzero:", pm.base_model.model.model.layers[0].mlp.gate.modules_to_save["default"].weight.grad.abs().sum().item() > 0)
# aux-loss gradient reaches attention LoRA even with the router frozen?
pm2 = get_peft_model(copy.deepcopy(m), LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"], init_lora_weights=False))
o = pm2(x); o.aux_loss.backward()
print("aux-only grad on q_proj lora_A (router frozen):", pm2.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight.grad.abs().sum().item())
print("config keys:", cfg.output_router_logits, cfg.router_aux_loss_coef)
print("default output_router_logits:", Qwen3MoeConfig().output_router_logits)
