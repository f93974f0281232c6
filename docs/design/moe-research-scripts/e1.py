import torch, copy
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.01)
m = Qwen3MoeForCausalLM(cfg).float().eval()
print("experts impl:", m.config._experts_implementation, type(m.model.layers[0].mlp.experts).__mro__[0])
for n,p in m.model.layers[0].mlp.named_parameters(): print(" base", n, tuple(p.shape), p.dtype)
x = torch.randint(0,300,(2,12))
ref = m(x).logits
lc = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj","k_proj","v_proj","o_proj"],
    target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"], init_lora_weights=True)
pm = get_peft_model(copy.deepcopy(m), lc)
# perturb lora_B so adapters are non-zero
with torch.no_grad():
    for n,p in pm.named_parameters():
        if "lora_B" in n: p.normal_(0, 0.05)
for n,p in pm.named_parameters():
    if p.requires_grad and "layers.0." in n: print(" trainable", n, tuple(p.shape), p.dtype)
print("modules around experts:", type(pm.base_model.model.model.layers[0].mlp.experts).__name__,
      type(pm.base_model.model.model.layers[0].mlp.experts.base_layer).__name__,
      type(pm.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer).__name__)
pm.train()
out = pm(x, labels=x)
print("loss", out.loss.item(), "aux", out.aux_loss.item(), "n router logits", len(out.router_logits))
out.loss.backward()
g = {n: p.grad is not None and p.grad.abs().sum().item()>0 for n,p in pm.named_parameters() if p.requires_grad}
print("all trainable have grad:", all(g.values()), sum(g.values()), len(g))
ex = pm.base_model.model.model.layers[0].mlp.experts.get_base_layer()
print("parametrized after fwd?", hasattr(ex, "parametrizations"), type(ex).__name__)
pm.eval()
with torch.no_grad():
    lo = pm(x).logits
    merged = copy.deepcopy(pm).merge_and_unload()
    lm = merged(x).logits
print("merged type", type(merged.model.layers[0].mlp.experts).__name__, "max|peft-merged|", (lo-lm).abs().max().item(), "max|peft-base|", (lo-ref).abs().max().item())
print("merged param names", [n for n,_ in merged.model.layers[0].mlp.named_parameters()])
# eager vs grouped_mm
m2 = copy.deepcopy(m); m2.set_experts_implementation("eager")
print("eager vs grouped_mm base", (m2(x).logits - ref).abs().max().item())
