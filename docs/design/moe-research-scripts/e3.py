import torch, bitsandbytes.functional as F
torch.manual_seed(0)
E, I2, H = 8, 96, 64
W = (torch.randn(E, I2, H) * 0.02).to(torch.bfloat16)
kw = dict(blocksize=64, compress_statistics=False, quant_type="nf4", quant_storage=torch.uint8)
qa, sa = F.quantize_4bit(W, **kw)
qe = [F.quantize_4bit(W[e], **kw) for e in range(E)]
qs = torch.cat([q.view(-1) for q,_ in qe]); ab = torch.cat([s.absmax for _,s in qe])
print("shapes", qa.shape, qs.shape, "absmax equal", torch.equal(ab, sa.absmax), "packed equal", torch.equal(qa.view(-1), qs), "n diff bytes", (qa.view(-1)!=qs).sum().item())
q2 = F.quantize_4bit(W[0], **kw)[0]; print("repeat same", torch.equal(q2, qe[0][0]))
da = F.dequantize_4bit(qa, sa); de = torch.stack([F.dequantize_4bit(q,s) for q,s in qe])
print("dequant equal", torch.equal(da, de), (da.float()-de.float()).abs().max().item())
import bitsandbytes.backends.cpu.ops as cops, inspect
