import torch, time
import bitsandbytes as bnb, bitsandbytes.functional as F
torch.manual_seed(0)
E, I2, H = 8, 96, 64
W = (torch.randn(E, I2, H) * 0.02).to(torch.bfloat16)
t=time.time()
packed, states = [], []
for e in range(E):
    q, st = F.quantize_4bit(W[e], blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16)
    packed.append(q); states.append(st)
print("quant time", round(time.time()-t,3))
q, st = packed[0], states[0]
print("packed", tuple(q.shape), q.dtype, q.is_contiguous())
print("state:", {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k,v in vars(st).items() if k!="state2"})
print("state2:", {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k,v in vars(st.state2).items()})
print("as_dict keys:", {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k,v in st.as_dict(packed=False).items()})
t=time.time()
deq = torch.stack([F.dequantize_4bit(p, s, quant_type="nf4") for p,s in zip(packed, states)])
print("dequant time", round(time.time()-t,3), deq.shape, deq.dtype, "max err", (deq.float()-W.float()).abs().max().item(), "rel", ((deq.float()-W.float()).norm()/W.float().norm()).item())
# stacked storage: [E, 2I, H/4] bf16
stack = torch.stack([p.view(I2, H//4) for p in packed])
print("stack", tuple(stack.shape), stack.dtype)
deq2 = F.dequantize_4bit(stack[3].reshape(-1,1), states[3], quant_type="nf4")
print("slice of stack dequant == per-expert:", torch.equal(deq2, deq[3]))
# dequant to fp32 directly
s32 = states[3]; 
import copy; s32b = copy.copy(s32); s32b.dtype = torch.float32
d32 = F.dequantize_4bit(packed[3], s32b, quant_type="nf4")
print("fp32 dequant == bf16 dequant upcast:", torch.equal(d32.to(torch.bfloat16), deq[3]), (d32 - deq[3].float()).abs().max().item())
# whole-tensor quantization vs per-expert
qa, sa = F.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16)
print("whole-tensor packed", tuple(qa.shape), "absmax", tuple(sa.absmax.shape), "equal packing:", torch.equal(qa.view(-1), stack.view(-1)))
# bytes
bf16 = W.numel()*2
pk = stack.numel()*stack.element_size()
qs = sum(s.absmax.numel()*s.absmax.element_size() + s.state2.absmax.numel()*4 + 4 for s in states)  # + offset fp32
code = states[0].code.numel()*4 + states[0].state2.code.numel()*4
print(f"bf16 {bf16}  packed {pk} ({pk/bf16:.4f})  qstate {qs} ({qs/bf16:.4f})  codes(shared) {code}  total/bf16 {(pk+qs)/bf16:.4f}")
for (E_,I2_,H_) in [(128, 2*768, 2048), (8, 2*14336, 4096)]:
    n=E_*I2_*H_; absm=n/64; nested=E_*-(-(I2_*H_//64)//256)*4
    print(f"real E={E_} [{I2_},{H_}]: packed/bf16 0.25, absmax(u8)/bf16 {absm/(2*n):.5f}, nested/bf16 {nested/(2*n):.6f}; per-rank (2 ranks, qstate replicated) vs per-rank bf16: {(n*0.5/2 + absm + nested)/(n*2/2):.4f}; no double-quant replicated: {(n*0.5/2 + absm*4)/(n):.4f}")
