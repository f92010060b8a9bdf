# session 22: which DeepGEMM call crashes, and where (run with faulthandler; each step flushed before it runs)
import faulthandler, sys, torch
faulthandler.enable()
import deep_gemm as dg
from baselines import fp8_gemm as fg
from contract.fp8 import quantize_blocks
step = sys.argv[1] if len(sys.argv) > 1 else "all"
torch.manual_seed(0)
def say(*a): print(*a, flush=True)
say("arch", torch.cuda.get_device_capability(), "num_sms", dg.get_num_sms(), "align", dg.get_mk_alignment_for_contiguous_layout())
if step in ("bf16", "all"):
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16); b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16)
    say("bf16_gemm_nt ..."); dg.bf16_gemm_nt(a, b, d); torch.cuda.synchronize()
    say("bf16 rel err", ((d.float() - a.float() @ b.float().t()).norm() / (a.float() @ b.float().t()).norm()).item())
if step in ("fp8", "all"):
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16); b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    aq = quantize_blocks(a, 1, 128); bq = quantize_blocks(b, 128, 128)
    say("a sf", aq[1].shape, aq[1].stride(), "b sf", bq[1].shape)
    d = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16)
    say("fp8_gemm_nt ..."); dg.fp8_gemm_nt(aq, bq, d); torch.cuda.synchronize()
    ref = a.float() @ b.float().t(); say("fp8 rel err", ((d.float() - ref).norm() / ref.norm()).item())
if step in ("mg", "all"):
    counts = torch.tensor([100, 0, 300, 7], device="cuda")
    lay = fg.GroupLayout(counts, 407, fg.blockwise_align(True), host_counts=counts.tolist())
    x = lay.pad(torch.randn(407, 512, device="cuda", dtype=torch.bfloat16))
    w = fg.BlockwiseWeight(torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16))
    xq = quantize_blocks(x, 1, 128)
    say("m_indices", lay.m_indices.dtype, lay.m_indices.shape, "x", xq[0].shape, xq[1].shape, "w", w.q.shape, w.s.shape, w.s.stride())
    got = torch.zeros(lay.rows, 256, dtype=torch.bfloat16, device="cuda")
    say("m_grouped_fp8_gemm_nt_contiguous ..."); dg.m_grouped_fp8_gemm_nt_contiguous(xq, (w.q, w.s), got, lay.m_indices); torch.cuda.synchronize()
    ref = torch.zeros_like(got); fg.reference_m_grouped_nt(xq, (w.q, w.s), ref, lay.m_indices)
    say("m_grouped rel err", ((got.float() - ref.float()).norm() / ref.float().norm()).item())
say("probe done")
