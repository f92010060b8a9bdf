"""Real fp8 grouped GEMMs for the PyTorch-expert baselines (nccl, deepep, hybridep) at ``precision=fp8``.

Their option ``fp8_gemm`` (``nccl.fp8_gemm=``, or ``fp8_gemm=`` for all three; baselines/options.py) picks the
path, recorded in each row's ``scaling``:

* ``rowwise``: ``torch._scaled_grouped_mm`` (the only grouped fp8 layout torch takes on SM90; torchao's MoE training
  uses it). Forward: per-row activation scales x per-output-channel weight scales. dgrad (dX = dY W): per-row scales
  of dY x a second copy of the weight quantized per input channel (W^T rows). wgrad (dW_e = dY_e^T X_e, a sum over
  expert e's tokens): the 2d x 2d grouped form with per-expert, per-channel scales taken along the tokens. Each
  expert's rows are padded to a multiple of 16 (fp8 TMA alignment of the token-grouped wgrad operands).
* ``blockwise``: the harness's own format (e4m3, 1x128 activation / 128x128 weight blocks) in DeepGEMM (the
  ``sgl-deep-gemm`` package): m-grouped contiguous GEMMs for the forward and dgrad (the 128x128 weight blocks of W^T
  are those of W, transposed), k-grouped contiguous for the wgrad with 1x128 blocks along the tokens. Each expert's
  rows are padded to DeepGEMM's alignment (``get_mk_alignment_for_contiguous_layout``, 128). Before it is used, the
  build is checked once per process (``deep_gemm_build_check``): its k-grouped GEMM must give bitwise-equal results
  over repeated calls on one input, close to the reference product; a build with the race of DeepGEMM #365 makes the
  path ``unsupported``. The rows name the build (version, commit where known, ``MOKBENCH_DEEPGEMM_REF``).
* ``blockwise_loop``: the same format and operands through torch's block-scaled ``scaled_mm`` (v2), one GEMM per expert
  (``baselines/fp8_loop.py``): the fallback where DeepGEMM does not load.
* ``emulated``: bf16 GEMMs on e4m3-rounded operands (``baselines.common.fake_quant``): measures accuracy, never fp8
  speed.
* ``auto``: the fastest real path (``FP8_GEMM_PATHS``, baselines/options.py) that this machine has, timed at setup on
  the case's shape (``fastest_experts``, outside the timed region); the row's ``scaling`` and ``notes`` record the
  pick and every path's time. On a CPU ``emulated`` (labelled so).

Weights are quantized once in setup (outside the timed region, as published); activations and gradients are
quantized inside the timed call. Every function here also runs on a CPU through pure-torch references of the same GEMM
semantics (``reference_*``), which the tests use to check the operand bookkeeping; the GPU test checks the real GEMMs
against the same references.

Legend: M rows (sorted by expert), P padded rows, G experts, N output features, K input features.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional, Sequence

import torch

from baselines.fp8_groups import (  # noqa: F401 (GroupLayout and the operand are part of this module's API)
    BLOCK, E4M3, GroupLayout, k_grouped_operand, reference_k_grouped_operand)
from contract import Case
from baselines.options import FP8_GEMM_PATHS
from contract.fp8 import FP8_MAX, dequantize_blocks, quantize_blocks

ROWWISE_ALIGN = 16  # rows per expert, rowwise path (16-byte TMA alignment of the token-grouped wgrad operands)
WGRAD_SCRATCH_ELEMS = 1 << 28  # fp32 elements of DeepGEMM wgrad accumulator per step (1 GiB)
AUTO_ITERS = 3  # auto: timed iterations per path at setup (after one untimed), eager forward + backward
DEEPGEMM_HINT = ("install DeepGEMM: pip install sgl-deep-gemm where it matches your torch, else build it from source "
                 "(docs/backends.md, 'DeepGEMM (for fp8_gemm=blockwise)'), or use fp8_gemm=blockwise_loop (the same "
                 "format through torch's scaled_mm v2, one GEMM per expert) or rowwise")
DEEPGEMM_REF_ENV = "MOKBENCH_DEEPGEMM_REF"  # the DeepGEMM ref (commit, pull-request head) the user names for the rows
DEEPGEMM_FIX = ("build DeepGEMM at or after DeepGEMM PR #343 (42c240d, v2.6.1 with the fix; or 1f6f3f3), or use "
                "fp8_gemm=blockwise_loop or rowwise")
BUILD_CHECK_CALLS = 8  # repeats of DeepGEMM's k-grouped GEMM on one input at setup (deep_gemm_build_check)
BUILD_CHECK_KS = (128, 384, 256, 512, 128, 640)  # its expert groups: tokens each, multiples of 128
BUILD_CHECK_MN = (256, 512)  # its output [groups, M, N]
_BUILD_CHECK: dict[str, Any] = {}  # deep_gemm_build_check's result, once per process


# ---- which path ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def load_deep_gemm() -> tuple[Optional[Any], Optional[str]]:
    """(the deep_gemm module, None) or (None, why it does not load)."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 (an ABI mismatch raises OSError / RuntimeError, not ImportError)
        return None, f"DeepGEMM does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    for name in ("m_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_nt_contiguous",
                 "get_mk_alignment_for_contiguous_layout"):
        if not hasattr(deep_gemm, name):
            return None, f"this DeepGEMM has no {name}"
    why = enable_determinism(deep_gemm)
    return (None, why) if why else (deep_gemm, None)


_DETERMINISM: dict[int, str] = {}  # id(module) -> the mode line (determinism_mode)


def enable_determinism(dg: Any) -> Optional[str]:
    """Turn on DeepGEMM's deterministic algorithms where the build has the opt-in (``use_deterministic_algorithms``,
    off by default since DeepGEMM's release of 2026-09, PR #432), and note the mode for the rows; why the module
    cannot be used if the opt-in fails (None: it can)."""
    fn = getattr(dg, "use_deterministic_algorithms", None)
    if fn is None:
        _DETERMINISM[id(dg)] = "no determinism opt-in in this build (the setup check tests repeatability)"
        return None
    try:
        try:
            fn(True)
        except TypeError:  # an opt-in that takes no argument
            fn()
    except Exception as e:  # noqa: BLE001 (a build whose opt-in fails must not run non-deterministic rows)
        return f"DeepGEMM's use_deterministic_algorithms failed ({type(e).__name__}: {e})"
    _DETERMINISM[id(dg)] = "deterministic mode on (deep_gemm.use_deterministic_algorithms)"
    return None


def determinism_mode(dg: Any) -> str:
    """The determinism line of a DeepGEMM module loaded through :func:`load_deep_gemm` ("" if it was not)."""
    return _DETERMINISM.get(id(dg), "")


def deep_gemm_version() -> str:
    """Which DeepGEMM ran: the ``sgl-deep-gemm`` package where the module loaded from it, else the module's own
    version (a build from source, e.g. DeepGEMM's ``develop.sh`` on ``PYTHONPATH``)."""
    dg = load_deep_gemm()[0]
    if dg is None:
        return "deep_gemm"
    try:
        from importlib.metadata import distribution
        from pathlib import Path

        dist = distribution("sgl-deep-gemm")
        if Path(dg.__file__).resolve().parent == Path(dist.locate_file("deep_gemm")).resolve():
            mode = determinism_mode(dg)
            return f"sgl-deep-gemm {dist.version}{' (' + mode + ')' if mode else ''}"
    except Exception:  # noqa: BLE001 (not installed, or installed elsewhere than the module that loaded)
        pass
    ref = deep_gemm_ref(dg)
    mode = determinism_mode(dg)
    return (f"deep_gemm {getattr(dg, '__version__', '?')} (built from source{', ' + ref if ref else ''}"
            f"{'; ' + mode if mode else ''})")


def deep_gemm_ref(dg: Any) -> str:
    """What is known of the commit a DeepGEMM module was built from: the ``+<sha>`` of its distribution's version
    (DeepGEMM's setup.py appends the short commit), and the ref the user names in MOKBENCH_DEEPGEMM_REF; "" if none."""
    import re
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    parts = []
    top = getattr(dg, "__name__", "deep_gemm").split(".")[0]
    for dist in packages_distributions().get(top, []):
        try:
            local = version(dist).partition("+")[2]
        except PackageNotFoundError:
            continue
        if re.fullmatch(r"[0-9a-f]{7,40}", local):
            parts.append(f"commit {local}")
            break
    if os.environ.get(DEEPGEMM_REF_ENV):
        parts.append(f"{DEEPGEMM_REF_ENV}={os.environ[DEEPGEMM_REF_ENV]}")
    return ", ".join(parts)


def check_k_grouped(dg: Any, device: torch.device, calls: int = BUILD_CHECK_CALLS) -> tuple[Optional[str], str]:
    """DeepGEMM's ``k_grouped_fp8_gemm_nt_contiguous`` ``calls`` times on one fixed input (the wgrad operands of six
    expert groups, ``BUILD_CHECK_KS``): the results must be bitwise equal and within fp8 GEMM rounding (relative L1 <
    1%) of ``reference_k_grouped_nt`` on the same e4m3 operands. At v2.6.1 (54e2261) the SM90 kernel updates its
    tensormaps while TMA loads are in flight and its results are not repeatable (DeepGEMM #365). Returns (why this
    build cannot be used, or None; a line for the rows)."""
    import time

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    (M, N), ks = BUILD_CHECK_MN, list(BUILD_CHECK_KS)
    a = reference_k_grouped_operand(torch.randn(sum(ks), M, generator=g).to(device), ks)
    b = reference_k_grouped_operand(torch.randn(sum(ks), N, generator=g).to(device), ks)
    ks_t = torch.tensor(ks, dtype=torch.int32, device=device)
    a, b = (a[0], a[1].t()), (b[0], b[1].t())
    outs = []
    try:
        for _ in range(calls):
            d = torch.zeros(len(ks), M, N, dtype=torch.float32, device=device)
            dg.k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks, ks_t, d)
            outs.append(d)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 (a JIT or launch failure of this build)
        first = str(e).splitlines()[0] if str(e) else ""
        return f"DeepGEMM's k_grouped_fp8_gemm_nt_contiguous failed its setup check ({type(e).__name__}: {first})", ""
    ref = torch.zeros(len(ks), M, N, dtype=torch.float32, device=device)
    reference_k_grouped_nt(a, b, ref, ks, ks_t, None)
    differ = sum(not torch.equal(o, outs[0]) for o in outs[1:])
    err = max(float((o - ref).abs().sum() / ref.abs().sum()) for o in outs)
    what = f"DeepGEMM's k_grouped_fp8_gemm_nt_contiguous ({calls} calls on one input, {len(ks)} expert groups)"
    if differ:
        return (f"{what}: {differ} of {calls - 1} results differ from the first, bitwise (not repeatable: the race "
                f"of DeepGEMM #365, tensormaps updated while TMA loads are in flight)"), ""
    if not err < 0.01:
        return f"{what}: repeatable, but {err:.3g} off the reference product (relative L1; fp8 rounding is < 0.01)", ""
    return None, (f"setup check: k-grouped wgrad GEMM bitwise equal over {calls} calls, relative L1 {err:.1e} to the "
                  f"reference ({time.perf_counter() - t0:.1f} s)")


def deep_gemm_build_check() -> Optional[str]:
    """Why the loaded DeepGEMM cannot be used for the blockwise path (None: it can): ``check_k_grouped`` on this
    process's GPU, run once per process (JIT compiles included), the same verdict on every rank
    (``agree_across_ranks``); its line goes to the rows' ``scaling``."""
    if "why" not in _BUILD_CHECK:
        dg, why = load_deep_gemm()
        line = ""
        if dg is not None:
            why, line = check_k_grouped(dg, torch.device("cuda", torch.cuda.current_device()))
            ref = deep_gemm_ref(dg)
            why = agree_across_ranks(why and f"{why} [deep_gemm {getattr(dg, '__version__', '?')}"
                                             f"{', ' + ref if ref else ''}]")
        _BUILD_CHECK.update(why=why, line=line)
    return _BUILD_CHECK["why"]


def agree_across_ranks(why: Optional[str]) -> Optional[str]:
    """The first failing rank's reason on every rank, or None if none failed: a race need not show on every GPU, and
    ranks that chose different fp8 paths would not pair their collectives. Collective over the default group where
    it is initialised: the check runs in the same step on every rank (the backends' ``unsupported_reason``)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return why
    whys: list = [None] * dist.get_world_size()
    dist.all_gather_object(whys, why)
    rank = dist.get_rank()
    return next((w if r == rank else f"on rank {r}: {w}" for r, w in enumerate(whys) if w), None)


def _capability(device: str) -> tuple[int, int]:
    if device != "cuda" or not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability()


def path_unavailable(path: str, device: str) -> Optional[str]:
    """Why ``path`` (one of ``FP8_GEMM_PATHS``) cannot run here (None: it can)."""
    if device != "cuda":
        return (f"fp8_gemm={path} runs real fp8 GEMMs on a Hopper GPU; this run is on {device}: use "
                "fp8_gemm=emulated (accuracy only) or run on a GPU")
    cap = _capability(device)
    if path == "rowwise":
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"torch {torch.__version__} has no torch._scaled_grouped_mm; use fp8_gemm=blockwise or emulated"
        if cap < (9, 0):
            return f"torch._scaled_grouped_mm needs SM90+, this is SM{cap[0]}{cap[1]}; use fp8_gemm=emulated"
        return None
    if cap != (9, 0):
        return (f"fp8_gemm={path} is wired for SM90 (fp32 block scales), this is SM{cap[0]}{cap[1]}; "
                "use fp8_gemm=rowwise")
    if path == "blockwise_loop":
        from baselines import fp8_loop

        return fp8_loop.unavailable()
    _, why = load_deep_gemm()
    if why:
        return f"{why}; {DEEPGEMM_HINT}"
    bad = deep_gemm_build_check()
    return f"{bad}; {DEEPGEMM_FIX}" if bad else None


def resolve(case: Case, option: str = "auto") -> tuple[str, Optional[str]]:
    """(the fp8 GEMM path this case runs with the option ``fp8_gemm=option``, why it cannot run or None). bf16 /
    mxfp8: ("none", None). ("auto", None): several real paths are installed and ``fastest_experts`` picks one at
    setup."""
    if case.precision != "fp8":
        return "none", None
    opt, device = option, getattr(case, "device", "cpu")
    if opt == "emulated":
        return "emulated", None
    if opt == "auto":
        if device != "cuda":
            return "emulated", None  # a CPU has no fp8 GEMM: the row says it measures accuracy only
        found = auto_candidates(device)
        if len(found) == 1:
            return found[0], None
        if found:
            return "auto", None  # several: ExpertParams times them at setup (fastest_experts)
        whys = [f"{p}: {path_unavailable(p, device)}" for p in FP8_GEMM_PATHS]
        return "auto", ("no real fp8 grouped GEMM on this machine (" + "; ".join(whys) +
                        "); fp8_gemm=emulated measures accuracy only")
    return opt, path_unavailable(opt, device)


def auto_candidates(device: str) -> list[str]:
    """The real paths this machine can run, in ``FP8_GEMM_PATHS`` order."""
    return [p for p in FP8_GEMM_PATHS if path_unavailable(p, device) is None]


def scaling_label(path: str, case: Case, dispatch: str, picked: str = "") -> str:
    """What ran, for a row's ``scaling``; ``picked``: how ``auto`` chose the path (short; the times go to notes)."""
    auto = f"; {picked}" if picked else ""
    if path == "rowwise":
        return ("e4m3 rowwise (per-row activation / per-channel weight scales), torch._scaled_grouped_mm: forward, "
                f"dgrad and wgrad in fp8 (wgrad scales per expert and channel along the tokens); dispatch "
                f"{dispatch}{auto}")
    if path == "blockwise":
        check = f"; {_BUILD_CHECK['line']}" if _BUILD_CHECK.get("line") else ""
        return (f"e4m3 block 1x{BLOCK}/{BLOCK}x{BLOCK}, DeepGEMM ({deep_gemm_version()}): forward and dgrad m-grouped "
                f"contiguous, wgrad k-grouped (1x{BLOCK} along tokens), all in fp8, experts eager (not compiled); "
                f"dispatch {dispatch}{auto}{check}")
    if path == "blockwise_loop":
        dg = load_deep_gemm()[0] if case.device == "cuda" else None
        why = "fallback: DeepGEMM not loadable" if dg is None else "DeepGEMM also loads here"
        return (f"e4m3 block 1x{BLOCK}/{BLOCK}x{BLOCK}, torch scaled_mm v2 per-expert loop ({why}): forward and dgrad "
                f"1x{BLOCK} x {BLOCK}x{BLOCK}, wgrad 1x{BLOCK} x 1x{BLOCK} along tokens, all in fp8, experts padded "
                f"to {BLOCK} rows, eager (not compiled); dispatch {dispatch}{auto}")
    return (f"block 1x{case.act_block}/{case.weight_block}x{case.weight_block} emulated (bf16 GEMM on e4m3 values): "
            f"measures accuracy, not fp8 GEMM speed; dispatch {dispatch}")


# ---- quantization -------------------------------------------------------------------------------------------------


def _q(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).to(E4M3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [..., R, C] with one scale per row (over the last dim): fp32 [..., R]."""
    scale = x.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return _q(x, scale.unsqueeze(-1)), scale


def quantize_token_groups(x_PC: torch.Tensor, group_P: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [P, C] with one scale per (group, column), over the rows of the group: fp32 [groups, C]. Rows of group
    id ``groups`` (padding slack past the last group) get a scale of their own, dropped from the result."""
    C = x_PC.shape[1]
    amax = torch.zeros(groups + 1, C, dtype=torch.float32, device=x_PC.device)
    amax.scatter_reduce_(0, group_P.unsqueeze(1).expand(-1, C), x_PC.float().abs(), "amax")
    scale = amax.clamp(min=1e-12) / FP8_MAX
    return _q(x_PC, scale.index_select(0, group_P)), scale[:groups]


# ---- rowwise: torch._scaled_grouped_mm ----------------------------------------------------------------------------


def reference_scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                                offs: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=bf16)`` in plain torch (fp32 math),
    for the two layouts used here: 2d x 3d (groups along M: a [M, K], b [G, K, N], scales [M] / [G, N]) and 2d x 2d
    (groups along K: a [M, Ktot], b [Ktot, N], scales [G*M] / [G*N], out [G, M, N]). Rows past ``offs[-1]`` are 0."""
    # the layouts torch checks on SM90 (seen on an H200, torch 2.11: "Expected mat2 to be transposed"): A row-major,
    # B column-major (the transpose of a contiguous [.., N, K] tensor)
    if a.stride(-1) != 1:
        raise ValueError("Expected mat1 to be row-major (the reference checks what torch._scaled_grouped_mm checks)")
    if b.stride(-2) != 1:
        raise ValueError("Expected mat2 to be transposed (the reference checks what torch._scaled_grouped_mm checks)")
    for t in (a, b):
        if any(st != 1 and st * t.element_size() % 16 for st in t.stride()):
            raise RuntimeError("strides should be multiple of 16 bytes (the reference checks what "
                               "torch._scaled_grouped_mm checks)")
    ends = [int(e) for e in offs.tolist()]
    af, bf = a.float(), b.float()
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
        s = 0
        for g, e in enumerate(ends):
            out[s:e] = (af[s:e] * scale_a[s:e, None]) @ (bf[g] * scale_b[g][None, :])
            s = e
        return out.to(torch.bfloat16)
    G, M, N = len(ends), a.shape[0], b.shape[1]
    sa, sb = scale_a.view(G, M), scale_b.view(G, N)
    out = torch.zeros(G, M, N, dtype=torch.float32, device=a.device)
    s = 0
    for g, e in enumerate(ends):
        out[g] = (af[:, s:e] * sa[g][:, None]) @ (bf[s:e] * sb[g][None, :])
        s = e
    return out.to(torch.bfloat16)


def scaled_grouped_mm(a, b, scale_a, scale_b, offs) -> torch.Tensor:
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
    return reference_scaled_grouped_mm(a, b, scale_a, scale_b, offs)


class RowwiseWeight:
    """One stacked weight [G, N, K] quantized once: per-output-channel (forward) and per-input-channel (dgrad)."""

    def __init__(self, w_GNK: torch.Tensor, experts_per_step: int = 8) -> None:
        w = w_GNK.detach()
        G, N, K = w.shape
        self.q = torch.empty(G, N, K, dtype=E4M3, device=w.device)
        self.q_t = torch.empty(G, K, N, dtype=E4M3, device=w.device)  # [G, K, N] contiguous: dgrad's weight
        self.s = torch.empty(G, N, dtype=torch.float32, device=w.device)
        self.s_t = torch.empty(G, K, dtype=torch.float32, device=w.device)
        for lo in range(0, G, experts_per_step):  # a few experts at a time: bounded fp32 scratch
            hi = min(G, lo + experts_per_step)
            self.q[lo:hi], self.s[lo:hi] = quantize_rows(w[lo:hi])
            self.q_t[lo:hi], self.s_t[lo:hi] = quantize_rows(w[lo:hi].transpose(-2, -1).contiguous())

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.s, self.q_t, self.s_t]


class _RowwiseLinear(torch.autograd.Function):
    """y [P, N] = x [P, K] @ w[g]^T per expert, every GEMM in fp8 (``torch._scaled_grouped_mm``)."""

    @staticmethod
    def forward(ctx, x_PK, w_GNK, q, s, q_t, s_t, offs, group_P):  # type: ignore[override]
        xq, xs = quantize_rows(x_PK)
        ctx.save_for_backward(x_PK, q_t, s_t, offs, group_P)
        ctx.groups = w_GNK.shape[0]
        return scaled_grouped_mm(xq, q.transpose(-2, -1), xs, s, offs)

    @staticmethod
    def backward(ctx, dy_PN):  # type: ignore[override]
        x_PK, q_t, s_t, offs, group_P = ctx.saved_tensors
        G = ctx.groups
        dyq, dys = quantize_rows(dy_PN)
        dx = scaled_grouped_mm(dyq, q_t.transpose(-2, -1), dys, s_t, offs)
        gq, gs = quantize_token_groups(dy_PN, group_P, G)  # [P, N], [G, N]
        xq, xs = quantize_token_groups(x_PK, group_P, G)  # [P, K], [G, K]
        dw = scaled_grouped_mm(gq.t().contiguous(), xq.t().contiguous().t(), gs.reshape(-1), xs.reshape(-1), offs)
        return dx, dw, None, None, None, None, None, None


# ---- blockwise: DeepGEMM ------------------------------------------------------------------------------------------


def reference_m_grouped_nt(a, b, d: torch.Tensor, m_indices: torch.Tensor) -> None:
    """DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous((aq, as), (bq, bs), d, m_indices)`` in plain torch: row r of d is
    A[r] @ B[m_indices[r]]^T (1x128 blocks on A [P, K], 128x128 on B [G, N, K]); rows of index -1 are left alone."""

    A = dequantize_blocks(a[0], a[1], 1, BLOCK)
    B = dequantize_blocks(b[0], b[1], BLOCK, BLOCK)
    for g in range(B.shape[0]):
        rows = torch.nonzero(m_indices == g).flatten()
        if rows.numel():
            d[rows] = (A[rows] @ B[g].t()).to(d.dtype)


def reference_k_grouped_nt(a, b, d: torch.Tensor, ks: Sequence[int], ks_tensor, c: Optional[torch.Tensor]) -> None:
    """DeepGEMM ``k_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, ks, ks_tensor, c)`` in plain torch: group g
    owns ``ks[g]`` of the K positions (in order); its A block [M, k_g] and B block [N, k_g] lie row-major one after
    the other in the flat data; ``sfa`` [M, Ktot/128] and ``sfb`` [N, Ktot/128] scale 1x128 blocks along K.
    d[g] = c[g] + A_g @ B_g^T (fp32)."""
    (aq, sfa), (bq, sfb) = a, b
    M, N = d.shape[1], d.shape[2]
    k0 = 0
    for g, k in enumerate(ks):
        A = aq[k0 * M:(k0 + k) * M].float().view(M, k) * sfa[:, k0 // BLOCK:(k0 + k) // BLOCK].repeat_interleave(
            BLOCK, 1)
        B = bq[k0 * N:(k0 + k) * N].float().view(N, k) * sfb[:, k0 // BLOCK:(k0 + k) // BLOCK].repeat_interleave(
            BLOCK, 1)
        d[g] = (c[g] if c is not None else 0) + A @ B.t()
        k0 += k


class BlockwiseWeight:
    """One stacked weight [G, N, K] in 128x128 blocks, once; the dgrad operand W^T reuses the same blocks."""

    def __init__(self, w_GNK: torch.Tensor) -> None:
        w, G, N, K = w_GNK.detach(), *w_GNK.shape
        self.q = torch.empty(G, N, K, dtype=E4M3, device=w.device)  # [G, N, K] and [G, N/128, K/128]
        self.s = torch.empty(G, N // BLOCK, K // BLOCK, dtype=torch.float32, device=w.device)
        for lo in range(0, G, 8):  # a few experts at a time: bounded fp32 scratch
            self.q[lo:lo + 8], self.s[lo:lo + 8] = quantize_blocks(w[lo:lo + 8], BLOCK, BLOCK)
        self.q_t = self.q.transpose(-2, -1).contiguous()
        self.s_t = self.s.transpose(-2, -1).contiguous()

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.s, self.q_t, self.s_t]


def blockwise_align(device_is_cuda: bool) -> int:
    """Rows per expert for DeepGEMM's contiguous layouts (a multiple of the 128-token wgrad blocks)."""
    align = load_deep_gemm()[0].get_mk_alignment_for_contiguous_layout() if device_is_cuda else BLOCK
    assert align % BLOCK == 0, f"DeepGEMM's alignment {align} is not a multiple of {BLOCK}"
    return align


def _deep_gemm_ops(device_is_cuda: bool):
    if device_is_cuda:
        dg, why = load_deep_gemm()
        if dg is None:
            raise RuntimeError(f"{why}; {DEEPGEMM_HINT}")
        return dg.m_grouped_fp8_gemm_nt_contiguous, dg.k_grouped_fp8_gemm_nt_contiguous
    return reference_m_grouped_nt, reference_k_grouped_nt


class _BlockwiseLinear(torch.autograd.Function):
    """y [P, N] = x [P, K] @ w[g]^T per expert, every GEMM in block-scaled fp8 (DeepGEMM)."""

    @staticmethod
    def forward(ctx, x_PK, w_GNK, q, s, q_t, s_t, layout):  # type: ignore[override]
        m_grouped, _ = _deep_gemm_ops(x_PK.is_cuda)
        xq = quantize_blocks(x_PK, 1, BLOCK)
        y = torch.zeros(x_PK.shape[0], q.shape[1], dtype=torch.bfloat16, device=x_PK.device)
        m_grouped(xq, (q, s), y, layout.m_indices)
        ctx.save_for_backward(x_PK, q_t, s_t)
        ctx.layout = layout
        return y

    @staticmethod
    def backward(ctx, dy_PN):  # type: ignore[override]
        x_PK, q_t, s_t = ctx.saved_tensors
        layout = ctx.layout
        m_grouped, k_grouped = _deep_gemm_ops(dy_PN.is_cuda)
        dy_PN = dy_PN.contiguous()
        dx = torch.zeros_like(x_PK)
        m_grouped(quantize_blocks(dy_PN, 1, BLOCK), (q_t, s_t), dx, layout.m_indices)
        ga, gsf = k_grouped_operand(dy_PN, layout)
        xa, xsf = k_grouped_operand(x_PK, layout)
        N, K = dy_PN.shape[1], x_PK.shape[1]
        dw = torch.empty(layout.G, N, K, dtype=torch.bfloat16, device=dy_PN.device)
        ks = layout.padded_host
        # DeepGEMM accumulates the wgrad in fp32: a few experts at a time bounds that scratch (kimi_k2_7's w13 at EP=1
        # would need 45 GB at once); each step's groups own a contiguous slice of the operands
        step = max(1, WGRAD_SCRATCH_ELEMS // (N * K))
        k0 = 0
        for g0 in range(0, layout.G, step):
            kc = ks[g0:g0 + step]
            k1 = k0 + sum(kc)
            acc = torch.zeros(len(kc), N, K, dtype=torch.float32, device=dy_PN.device)
            k_grouped((ga[k0 * N:k1 * N], gsf[k0 // BLOCK:k1 // BLOCK].t()),
                      (xa[k0 * K:k1 * K], xsf[k0 // BLOCK:k1 // BLOCK].t()),
                      acc, kc, torch.tensor(kc, dtype=torch.int32, device=dw.device), acc)
            dw[g0:g0 + len(kc)] = acc
            k0 = k1
        return dx, dw, None, None, None, None, None


# ---- the expert MLP -----------------------------------------------------------------------------------------------


def weight_format(path: str) -> type:
    """How ``path`` stores a weight (blockwise and blockwise_loop share the same 128x128 blocks)."""
    return RowwiseWeight if path == "rowwise" else BlockwiseWeight


class Fp8Experts:
    """Grouped SwiGLU experts with real fp8 GEMMs (``path``: one of ``FP8_GEMM_PATHS``); weights quantized here,
    once (or given: ``weights``, a (w13, w2) pair of ``weight_format(path)`` made for another path)."""

    def __init__(self, path: str, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor, weights=None) -> None:
        assert path in FP8_GEMM_PATHS, path
        self.path = path
        make = weight_format(path)
        self.w13, self.w2 = weights if weights is not None else (make(w13_LIH), make(w2_LHI))
        self._gemm = (self.w13, self.w2)  # the operands the GEMMs take
        if path == "blockwise_loop":
            from baselines import fp8_loop

            self._gemm = (fp8_loop.LoopWeight(self.w13), fp8_loop.LoopWeight(self.w2))

    def tensors(self) -> list[torch.Tensor]:
        return self._gemm[0].tensors() + self._gemm[1].tensors()

    def __call__(self, x_MH, w13_LIH, w2_LHI, counts_L, swiglu_fn, limit) -> torch.Tensor:
        M = x_MH.shape[0]
        if M == 0:
            # no rows here (an idle rank): the empty bf16 GEMMs of baselines.common.grouped_linear, which keep x and
            # the weights in the graph (zero gradients, the same collectives in the backward as on the other ranks)
            gate, up = (x_MH @ w13_LIH[0].t()).chunk(2, dim=-1)
            return swiglu_fn(gate, up, limit) @ w2_LHI[0].t()
        w13, w2 = self._gemm
        if self.path == "rowwise":
            lay = GroupLayout(counts_L, M, ROWWISE_ALIGN)
            x = lay.pad(x_MH)
            h = _RowwiseLinear.apply(x, w13_LIH, *w13.tensors(), lay.offs, lay.group)
            gate, up = h.chunk(2, dim=-1)
            y = _RowwiseLinear.apply(swiglu_fn(gate, up, limit), w2_LHI, *w2.tensors(), lay.offs, lay.group)
            return lay.unpad(y)
        if self.path == "blockwise":
            fn, align = _BlockwiseLinear, blockwise_align(x_MH.is_cuda)
        else:
            from baselines import fp8_loop

            fn, align = fp8_loop.LoopLinear, fp8_loop.ALIGN
        # DeepGEMM's k-grouped GEMM and the per-expert loop take the group sizes on the host
        lay = GroupLayout(counts_L, M, align, host_counts=counts_L.tolist())
        x = lay.pad(x_MH)
        h = fn.apply(x, w13_LIH, *w13.tensors(), lay)
        gate, up = h.chunk(2, dim=-1)
        y = fn.apply(swiglu_fn(gate, up, limit).contiguous(), w2_LHI, *w2.tensors(), lay)
        return lay.unpad(y)


# ---- auto: the fastest real path, timed at setup ------------------------------------------------------------------


def _time_experts(ex: Fp8Experts, x: torch.Tensor, dy: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  counts: torch.Tensor, swiglu_fn, limit) -> tuple[float, float]:
    """Median forward and backward ms of one untimed and ``AUTO_ITERS`` timed calls (CUDA events)."""
    fwd, bwd = [], []
    for i in range(AUTO_ITERS + 1):
        xl, a, b = (t.detach().requires_grad_() for t in (x, w13, w2))  # gradients land in throwaway leaves
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        y = ex(xl, a, b, counts, swiglu_fn, limit)
        ev[1].record()
        y.backward(dy)
        ev[2].record()
        torch.cuda.synchronize()
        if i:
            fwd.append(ev[0].elapsed_time(ev[1]))
            bwd.append(ev[1].elapsed_time(ev[2]))
        del xl, a, b, y
    return sorted(fwd)[len(fwd) // 2], sorted(bwd)[len(bwd) // 2]


def fastest_experts(case: Case, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor, swiglu_fn, group=None
                    ) -> tuple[Fp8Experts, str]:
    """``auto`` with several real paths installed: time each one's expert GEMM stack (eager forward + backward,
    ``AUTO_ITERS`` iterations) on this case's shape, ``tokens_per_gpu * topk`` rows split evenly over the local
    experts, and keep the fastest (forward + backward). With ``group``, every rank takes the same path: the slowest
    rank's time of each path decides. Returns the experts and a line with the pick and every path's times. Runs in
    setup, outside the timed region. One weight format is held at a time (the run's own footprint: kimi_k2_7 at EP=1
    has no room for two): blockwise and blockwise_loop share theirs; the pick is quantized again if another format
    was timed after it."""
    paths = auto_candidates(case.device)
    L, H, dev = w13_LIH.shape[0], w13_LIH.shape[2], w13_LIH.device
    M = case.tokens_per_gpu * case.topk
    counts = torch.full((L,), M // L, dtype=torch.int64, device=dev)
    counts[: M % L] += 1
    g = torch.Generator(device=dev).manual_seed(case.seed)
    x = torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16)
    dy = torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16)
    made: tuple[Optional[type], Any] = (None, None)  # the weight format held and its (w13, w2)
    times: dict[str, tuple[float, float]] = {}
    for p in paths:
        if made[0] is not weight_format(p):
            made = (None, None)  # freed before the next format is made
            made = (weight_format(p), (weight_format(p)(w13_LIH), weight_format(p)(w2_LHI)))
        ex = Fp8Experts(p, w13_LIH, w2_LHI, weights=made[1])
        t = torch.tensor(_time_experts(ex, x, dy, w13_LIH, w2_LHI, counts, swiglu_fn, case.swiglu_limit),
                         device=dev)
        del ex
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(t, torch.distributed.ReduceOp.MAX, group=group)
        times[p] = (float(t[0]), float(t[1]))
    best = min(paths, key=lambda p: sum(times[p]))  # the first of equals: FP8_GEMM_PATHS order
    weights = made[1] if made[0] is weight_format(best) else None
    made = (None, None)  # freed before the pick's own format is made again
    ex = Fp8Experts(best, w13_LIH, w2_LHI, weights=weights)
    shown = ", ".join(f"{p} {f:.2f}+{b:.2f} ms" for p, (f, b) in times.items())
    return ex, (f"fp8_gemm=auto picked {best}, the fastest at setup: eager fwd+bwd of the expert GEMMs on "
                  f"{M} rows over {L} experts, median of {AUTO_ITERS}, slowest rank: {shown}")
