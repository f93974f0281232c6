import torch, sys
sys.argv=["x"]; exec(open("/tmp/moe_research/e5.py").read().split("def run(arch)")[0])
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
qm = quantize_experts(Qwen3MoeForCausalLM(cfg).float(), torch.float32)
pq = get_peft_model(qm, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"])); install_hooks(pq.base_model.model)
saved = []
def pack_hook(t):
    if t.dim() == 3 and t.shape[0] == 8: saved.append((tuple(t.shape), t.data_ptr()))
    return t
x = torch.randint(0, 300, (2, 12))
with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
    out = pq(x, labels=x)
print("3D expert-sized tensors saved for backward (shape, distinct storages):", sorted(set(s for s, _ in saved)), len({p for _, p in saved}))
