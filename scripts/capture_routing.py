"""Capture the routing of a Hugging Face transformers MoE model into a routing trace (harness/config/routing_trace.py)
that ``workload=trace`` replays.

A forward hook on each MoE block's router (the ``gate`` or ``router`` module of a block that holds ``experts``)
records, for every token of every layer, the top-k expert ids the model chose and their weights renormalised to sum
to 1 (the router's own top-k scores where it returns them: Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE,
gpt-oss in transformers >= 5; the softmax of its logits where it returns logits alone). Each step is one forward
pass over a new batch of ``--tokens`` tokens (``--seq-len`` tokens a sequence): random token ids (seeded) or
consecutive chunks of a text file (``--text``).

    python scripts/capture_routing.py --model Qwen/Qwen3-30B-A3B --out traces/qwen3_30b --tokens 8192 --steps 4
    python scripts/capture_routing.py --tiny qwen3_moe --out /tmp/tiny_trace --tokens 256 --steps 2

``--tiny KIND`` builds a small randomly initialised model from a config that transformers ships (``qwen3_moe``,
``mixtral``, ``olmoe``; 8 experts, top-2 unless ``--num-experts`` / ``--topk``): its trace tests the capture and
replay path, not a routing distribution that any trained model has.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

TINY = ("qwen3_moe", "mixtral", "olmoe")


def import_transformers() -> Any:
    """``transformers`` (the ``traces`` extra), imported only where a model is built."""
    import transformers

    return transformers


def tiny_model(kind: str, *, num_experts: int = 8, topk: int = 2, layers: int = 2, seed: int = 0) -> Any:
    """A small randomly initialised causal LM of ``kind`` (built from its config class, nothing downloaded)."""
    tf = import_transformers()
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=topk, max_position_embeddings=4096)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                num_experts=num_experts, decoder_sparse_step=1, mlp_only_layers=[],
                                norm_topk_prob=True)
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=num_experts)
        cls = tf.MixtralForCausalLM
    elif kind == "olmoe":
        cfg = tf.OlmoeConfig(**common, intermediate_size=32, num_experts=num_experts)
        cls = tf.OlmoeForCausalLM
    else:
        raise ValueError(f"unknown tiny model '{kind}'; choose one of: {', '.join(TINY)}")
    torch.manual_seed(seed)
    return cls(cfg).eval()


def routers(model: Any) -> list[tuple[str, torch.nn.Module]]:
    """The router of each MoE block, in layer order: the ``gate`` / ``router`` child of a module with ``experts``."""
    out = []
    for name, mod in model.named_modules():
        if hasattr(mod, "experts"):
            for attr in ("gate", "router"):
                child = getattr(mod, attr, None)
                if isinstance(child, torch.nn.Module):
                    out.append((f"{name}.{attr}", child))
                    break
    return out


def model_facts(model: Any) -> dict[str, Any]:
    """What a trace records of its model: name, num_experts, topk, hidden_size, layers."""
    cfg = model.config
    e = next((getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
              if isinstance(getattr(cfg, k, None), int)), None)
    return {"name": getattr(cfg, "_name_or_path", "") or type(model).__name__, "model_type": cfg.model_type,
            "num_experts": e, "topk": cfg.num_experts_per_tok, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers}


def _topk(output: Any, k: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A router's output as top-k ids [N, K], weights [N, K] renormalised to sum to 1, and what it returned."""
    if isinstance(output, torch.Tensor):  # logits alone
        probs = torch.softmax(output.float().reshape(-1, output.shape[-1]), dim=-1)
        w, ids = probs.topk(k, dim=-1)
        how = "logits: softmax, top-k, renormalised"
    else:
        ids = next(t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point())
        floats = [t for t in output if isinstance(t, torch.Tensor) and t.is_floating_point()]
        scores = next((t for t in floats if t.shape == ids.shape), None)
        if scores is None:  # dense scores [N, E]: take the chosen experts'
            scores = floats[-1].reshape(ids.shape[0], -1).float().gather(1, ids)
        ids, w = ids.reshape(-1, ids.shape[-1]), scores.float().reshape(-1, ids.shape[-1])
        how = "the router's top-k ids and scores, renormalised"
    return ids.to(torch.int64), (w / w.sum(-1, keepdim=True)).float(), how


@torch.no_grad()
def capture(model: Any, batches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Run ``model`` on each batch of token ids [B, L] (one step each) and return the routing of every MoE layer:
    expert_ids, gates [S, Y, B*L, K], and how the weights were read."""
    facts = model_facts(model)
    found = routers(model)
    if not found:
        raise SystemExit(f"{type(model).__name__} has no MoE block (a module with 'experts' and a 'gate' or "
                         f"'router'): pick an MoE model")
    step: list[tuple[torch.Tensor, torch.Tensor]] = []
    how: list[str] = []

    def hook(_mod, _inp, out):
        ids, w, h = _topk(out, facts["topk"])
        step.append((ids.cpu(), w.cpu()))
        how.append(h)

    handles = [mod.register_forward_hook(hook) for _, mod in found]
    all_ids, all_w = [], []
    try:
        device = next(model.parameters()).device
        for batch in batches:
            step.clear()
            model(input_ids=batch.to(device))
            if len(step) != len(found):
                raise SystemExit(f"{len(step)} router calls for {len(found)} MoE layers in one forward")
            all_ids.append(torch.stack([i for i, _ in step]))
            all_w.append(torch.stack([w for _, w in step]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(all_ids), torch.stack(all_w), how[0]


def batches(*, tokens: int, seq_len: int, steps: int, vocab: int, seed: int,
            text: Optional[list[int]] = None) -> list[torch.Tensor]:
    """``steps`` batches of ``tokens`` token ids, ``seq_len`` a sequence: from ``text`` (consecutive chunks, cycled)
    or random (seeded)."""
    if tokens % seq_len:
        raise SystemExit(f"--tokens {tokens} is not a multiple of --seq-len {seq_len}")
    out = []
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        if text:
            ids = torch.tensor([text[(s * tokens + j) % len(text)] for j in range(tokens)])
        else:
            ids = torch.randint(0, vocab, (tokens,), generator=g)
        out.append(ids.view(-1, seq_len))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model id or folder (AutoModelForCausalLM)")
    src.add_argument("--tiny", choices=TINY, help="a small random model of this kind (tests the path only)")
    p.add_argument("--out", required=True, help="the trace folder to write (must not hold a trace)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens a step (the global batch)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default: --tokens, one sequence)")
    p.add_argument("--steps", type=int, default=1, help="forward passes, one step of the trace each")
    p.add_argument("--seed", type=int, default=0, help="seeds random token ids and --tiny's weights")
    p.add_argument("--text", help="a text file to tokenize (--model only) instead of random token ids")
    p.add_argument("--num-experts", type=int, default=8, help="--tiny: experts")
    p.add_argument("--topk", type=int, default=2, help="--tiny: top-k")
    p.add_argument("--layers", type=int, default=2, help="--tiny: layers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    a = p.parse_args(argv)

    from harness.config.routing_trace import write_trace

    seq_len = a.seq_len or a.tokens
    dtype = getattr(torch, a.dtype)
    text = None
    if a.tiny:
        model = tiny_model(a.tiny, num_experts=a.num_experts, topk=a.topk, layers=a.layers, seed=a.seed)
        source = f"tiny {a.tiny} (random weights, seed {a.seed}): tests the path, not a trained distribution"
    else:
        tf = import_transformers()
        model = tf.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval()
        source = a.model
        if a.text:
            tok = tf.AutoTokenizer.from_pretrained(a.model)
            text = tok(Path(a.text).read_text())["input_ids"]
    model = model.to(device=a.device, dtype=dtype)
    facts = model_facts(model)
    data = batches(tokens=a.tokens, seq_len=seq_len, steps=a.steps, vocab=model.config.vocab_size, seed=a.seed,
                   text=text)
    ids, gates, how = capture(model, data)
    import transformers

    capture_info = {"tool": "scripts/capture_routing.py", "source": source, "hook": "forward hook on each MoE "
                    "block's router", "weights": how, "input": f"{a.text} (tokenized)" if text else
                    f"random token ids (seed {a.seed})", "tokens_per_step": a.tokens, "seq_len": seq_len,
                    "dtype": a.dtype, "device": a.device, "transformers": transformers.__version__,
                    "torch": torch.__version__, "layers": [n for n, _ in routers(model)]}
    write_trace(a.out, ids, gates, model=facts, capture=capture_info)
    s, y, n, k = ids.shape
    print(f"{a.out}: {s} step(s) x {y} layer(s) x {n} tokens x top-{k} of {facts['num_experts']} experts "
          f"({facts['name']})")
    print(f"replay: python3 -m harness.run workload=trace workload.trace_path={a.out} shape=custom "
          f"shape.num_experts={facts['num_experts']} shape.topk={k} shape.hidden=... shape.ffn=... "
          f"workload.tokens_per_gpu=<= {n} / ep_size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
