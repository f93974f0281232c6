import torch, copy, warnings
from torch import nn
import torch.nn.utils.parametrize as P
import bitsandbytes.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
base = Qwen3MoeForCausalLM(cfg).float().eval()

class NF4Dequant(nn.Module):
    """parametrization: packed [E, R, C/4] bf16 -> dequantized [E, R, C] in `dtype`"""
    def __init__(self, states, dtype):
        super().__init__(); self.states = states; self.dtype = dtype
    def forward(self, packed):
        outs = []
        for e, st in enumerate(self.states):
            s = copy.copy(st); s.dtype = self.dtype
            outs.append(F.dequantize_4bit(packed[e].reshape(-1, 1), s, quant_type="nf4"))
        return torch.stack(outs)
    def right_inverse(self, x):  # called once at registration with unsafe=True: keep the packed tensor as-is
        return x

def quantize_experts(model, dtype=torch.float32):
    for layer in model.model.layers:
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            W = getattr(ex, name).detach().to(torch.bfloat16)
            qs = [F.quantize_4bit(W[e], blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16) for e in range(W.shape[0])]
            packed = torch.stack([q.view(W.shape[1], W.shape[2] // 4) for q, _ in qs])
            ex._parameters[name] = nn.Parameter(packed, requires_grad=False)
            P.register_parametrization(ex, name, NF4Dequant([s for _, s in qs], dtype), unsafe=True)
    return model

qm = quantize_experts(copy.deepcopy(base))
ex = qm.model.layers[0].mlp.experts
print("stored:", {n: (tuple(p.shape), p.dtype) for n, p in ex.named_parameters()})
print("seen:", tuple(ex.gate_up_proj.shape), ex.gate_up_proj.dtype)
# reference: plain params holding the same dequantized weights
rm = copy.deepcopy(base)
for lq, lr in zip(qm.model.layers, rm.model.layers):
    for name in ("gate_up_proj", "down_proj"):
        getattr(lr.mlp.experts, name).data.copy_(getattr(lq.mlp.experts, name).detach())
full = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
lc = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=full)
pq = get_peft_model(qm, lc); pr = get_peft_model(rm, copy.deepcopy(lc))
with torch.no_grad():
    for n, p in pr.named_parameters():
        if "lora_B" in n: p.normal_(0, 0.05)
def swap(k):
    if ".experts.base_layer.lora_" in k: return k.replace(".experts.base_layer.lora_", ".experts.lora_")
    if ".experts.lora_" in k: return k.replace(".experts.lora_", ".experts.base_layer.lora_")
    return k
print("inner wrapper param (quantized model):", pq.base_model.model.model.layers[0].mlp.experts.base_layer.parameter_name, "| plain model:", pr.base_model.model.model.layers[0].mlp.experts.base_layer.parameter_name)
pq.load_state_dict({swap(k): v for k, v in pr.state_dict().items() if "lora" in k}, strict=False)
#, all(torch.equal(a, b) for (n, a), (m, b) in zip(pq.named_parameters(), pr.named_parameters()) if "lora" in n))
x = torch.randint(0, 300, (2, 12))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for i in range(3):
        lq = pq(x).logits
        print(f"fwd{i}: parametrizations on gate_up_proj:", [type(m).__name__ for m in pq.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer.parametrizations.gate_up_proj])
    print("warnings:", sorted({str(x.message)[:90] for x in w}))
lr_ = pr(x).logits
print("max|q-ref| logits:", (lq - lr_).abs().max().item())
# ---- patch peft's removal to also recognise _LoraFactorsProxy, rebuild fresh and compare
import peft.tuners.lora.layer as L
_orig = L.ParamWrapper._remove_parametrizations
def _remove(self):
    plist = self.get_base_layer().parametrizations[self.parameter_name]
    if len(plist) > 1 and isinstance(plist[-1], L._LoraFactorsProxy):
        del plist[-1]; return
    return _orig(self)
L.ParamWrapper._remove_parametrizations = _remove
qm2 = quantize_experts(copy.deepcopy(base)); pq2 = get_peft_model(qm2, copy.deepcopy(lc))
pq2.load_state_dict({swap(k): v for k, v in pr.state_dict().items() if "lora" in k}, strict=False)
for i in range(3): lq2 = pq2(x, labels=x)
print("patched: parametrizations", [type(m).__name__ for m in pq2.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer.parametrizations.gate_up_proj])
outq = pq2(x, labels=x); outr = pr(x, labels=x)
print("patched max|q-ref| logits:", (outq.logits - outr.logits).abs().max().item(), "loss diff", (outq.loss - outr.loss).item())
outq.loss.backward(); outr.loss.backward()
gq = {swap(n): p.grad for n, p in pq2.named_parameters() if p.requires_grad}
gr = {n: p.grad for n, p in pr.named_parameters() if p.requires_grad}
print("None grads in quantized:", [n for n in gr if gq[n] is None][:4])
print("grad max diff:", max((gq[n] - gr[n]).abs().max().item() for n in gr if gq[n] is not None), "packed grad:", pq2.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer.parametrizations.gate_up_proj.original.grad)
# merge on the parametrized model: does peft's merge change anything?
with torch.no_grad():
    before = pq2(x).logits
    mq = pq2.merge_and_unload()
    after = mq(x).logits
print("merge_and_unload on dequant-parametrized: max|after-before|", (after - before).abs().max().item(), " max|after-base(no lora)|", (after - get_peft_model(quantize_experts(copy.deepcopy(base)), copy.deepcopy(lc)).base_model.model(x).logits).abs().max().item())
