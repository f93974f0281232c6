import torch, copy
from torch import nn
import bitsandbytes.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, MixtralConfig, MixtralForCausalLM
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import ParamWrapper
NAMES = ("gate_up_proj", "down_proj")

def pack(W):  # W [E, R, C] -> packed [E, R, C/4] bf16, absmax [E, R*C/64] uint8, nested absmax [E, n2] fp32, offset [E] fp32
    qs = [F.quantize_4bit(W[e].to(torch.bfloat16), blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16) for e in range(W.shape[0])]
    return (torch.stack([q.view(W.shape[1], W.shape[2] // 4) for q, _ in qs]), torch.stack([s.absmax for _, s in qs]),
            torch.stack([s.state2.absmax for _, s in qs]), torch.stack([s.offset for _, s in qs]), qs[0][1])

def dequant(ex, name, dtype):
    packed, absmax = getattr(ex, name + "_nf4"), getattr(ex, name + "_absmax")
    n2, off, proto = getattr(ex, name + "_nested_absmax"), getattr(ex, name + "_offset"), ex._nf4_proto[name]
    out = []
    for e in range(packed.shape[0]):
        s2 = copy.copy(proto.state2); s2.absmax = n2[e]
        s = copy.copy(proto); s.absmax, s.state2, s.offset, s.dtype = absmax[e], s2, off[e], dtype
        s.shape = torch.Size((packed.shape[1], packed.shape[2] * 4))
        out.append(F.dequantize_4bit(packed[e].reshape(-1, 1), s, quant_type="nf4"))
    return torch.stack(out)

def quantize_experts(model, dtype):
    for layer in model.model.layers:
        ex = layer.mlp.experts; ex._nf4_proto = {}; ex._nf4_dtype = dtype
        for name in NAMES:
            p, a, n2, off, proto = pack(getattr(ex, name).detach())
            del ex._parameters[name]
            ex.register_parameter(name + "_nf4", nn.Parameter(p, requires_grad=False))      # FSDP-sharded, bf16
            ex.register_parameter(name + "_absmax", nn.Parameter(a, requires_grad=False))   # FSDP-sharded, uint8
            ex.register_buffer(name + "_nested_absmax", n2); ex.register_buffer(name + "_offset", off)
            ex._nf4_proto[name] = proto
            # placeholder so peft's target_parameters matches and sizes the adapter (no memory: stride 0)
            ex.register_parameter(name, nn.Parameter(torch.zeros((), dtype=dtype).expand(p.shape[0], p.shape[1], p.shape[2] * 4), requires_grad=False))
    return model

def experts_of(mlp):
    ex = mlp.experts
    while isinstance(ex, ParamWrapper): ex = ex.base_layer
    return ex

def install_hooks(model):
    for layer in model.model.layers:
        mlp = layer.mlp; ex = experts_of(mlp)
        for name in NAMES: del ex._parameters[name]   # drop placeholders after peft injection
        def pre(mod, args, ex=ex):
            for name in NAMES: ex._buffers[name] = dequant(ex, name, ex._nf4_dtype)   # non-persistent in effect (removed below)
        def post(mod, args, out, ex=ex):
            for name in NAMES: ex._buffers.pop(name, None)
        mlp.register_forward_pre_hook(pre); mlp.register_forward_hook(post)

def run(arch):
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01)
        base = Qwen3MoeForCausalLM(cfg).float()
    else:
        cfg = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
        base = MixtralForCausalLM(cfg).float()
    lc = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    qm = quantize_experts(copy.deepcopy(base), torch.float32)
    pq = get_peft_model(qm, lc); install_hooks(pq.base_model.model)
    # reference: same dequantized weights as plain fp32 params
    rm = copy.deepcopy(base)
    for lq, lr in zip(pq.base_model.model.model.layers, rm.model.layers):
        for name in NAMES: getattr(lr.mlp.experts, name).data.copy_(dequant(experts_of(lq.mlp), name, torch.float32))
    pr = get_peft_model(rm, copy.deepcopy(lc))
    with torch.no_grad():
        for n, p in pr.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.05)
    missing = pq.load_state_dict({k: v for k, v in pr.state_dict().items() if "lora" in k}, strict=False)
    print(arch, "unexpected keys:", missing.unexpected_keys, "| trainable names equal:",
          [n for n, p in pq.named_parameters() if p.requires_grad] == [n for n, p in pr.named_parameters() if p.requires_grad])
    x = torch.randint(0, 300, (2, 12)); pq.train(); pr.train()
    for _ in range(2): oq = pq(x, labels=x)
    orr = pr(x, labels=x)
    print("  loss q/ref", oq.loss.item(), orr.loss.item(), "aux", oq.aux_loss.item(), "max|dlogits|", (oq.logits - orr.logits).abs().max().item())
    oq.loss.backward(); orr.loss.backward()
    gq = {n: p.grad for n, p in pq.named_parameters() if p.requires_grad}; gr = {n: p.grad for n, p in pr.named_parameters() if p.requires_grad}
    print("  grads None:", [n for n in gq if gq[n] is None], "max|dgrad|", max((gq[n] - gr[n]).abs().max().item() for n in gr))
    ex = experts_of(pq.base_model.model.model.layers[0].mlp)
    print("  stored:", {n: (tuple(p.shape), str(p.dtype)) for n, p in ex.named_parameters()}, "buffers:", {n: tuple(b.shape) for n, b in ex.named_buffers()})
    # merged export: dequantize (plain params) then peft's own merge
    pq.eval(); pr.eval()
    for layer in pq.base_model.model.model.layers:
        e = experts_of(layer.mlp); layer.mlp._forward_pre_hooks.clear(); layer.mlp._forward_hooks.clear()
        for name in NAMES:
            e.register_parameter(name, nn.Parameter(dequant(e, name, torch.float32), requires_grad=False))
            for suf in ("_nf4", "_absmax"): del e._parameters[name + suf]
            for suf in ("_nested_absmax", "_offset"): del e._buffers[name + suf]
    mq = pq.merge_and_unload(); mr = pr.merge_and_unload()
    sq, sr = mq.state_dict(), mr.state_dict()
    print("  merged keys equal:", sorted(sq) == sorted(sr), "| bitwise equal:", all(torch.equal(sq[k], sr[k]) for k in sr))
    with torch.no_grad(): print("  merged logits max diff:", (mq(x).logits - mr(x).logits).abs().max().item())
for a in ("qwen3_moe", "mixtral"): run(a)
