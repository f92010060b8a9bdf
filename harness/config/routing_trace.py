"""Replayed routing traces: the file format, its checks, and the routing a point replays from one.

Shape legend: S steps, Y layers, N tokens of the trace's global batch, K top-k, T tokens per rank of the point.

A trace is a folder (docs/configuration.md, "Replayed routing traces")::

    manifest.json                what it holds, the model it came from, how it was captured, a sha256 per tensor
    tensors/expert_ids.pt        int64   [S, Y, N, K]  global expert ids, K distinct ids per token
    tensors/gates.pt             float32 [S, Y, N, K]  the router's top-k weights, each token's K summing to 1
    tensors/source_rank.pt       int32   [N]           the rank each token was captured on (0 for one process)

Megatron-LM's token-imbalance trace (PR #7488) is the same folder with one step and one layer: 2-D ``[N, K]``
``expert_ids`` / ``gates`` and its own manifest fields; it is read as S = Y = 1 (its ``token_ids``, a copy of
``expert_ids`` there, is not read).

Replaying: step ``s`` of a run takes the trace's step ``s mod S``, layer ``trace_layer``; rank ``r`` of an EP group
takes the trace's tokens ``[r*T, (r+1)*T)`` (the global batch split contiguously, as a data loader shards it), so a
trace of N tokens serves any EP size with ``EP * T <= N``; the first ``EP * T`` tokens are used, and a point that
needs more is refused. The ids are global expert ids: each rank's dispatch sends them to the ranks that own them,
which is the projection onto the ranks' local experts at any EP size. ``source_rank`` is recorded, not used to split.

Every problem (a missing or damaged file, a checksum that does not match, a shape or dtype the manifest does not
state, ids out of range or repeated, gates that are not normalised, a point whose ``num_experts`` / ``topk`` differ
from the trace's, too few tokens, a layer the trace lacks) raises :class:`~harness.core.errors.ConfigError`, which the
command line turns into one line and exit code 2 before anything runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import torch

from harness.core.errors import ConfigError

FORMAT = "mokbench-routing-trace"
SCHEMA_VERSION = 1
# name -> dtype; expert_ids and gates are [S, Y, N, K] (or Megatron's [N, K]), source_rank [N]
TENSORS = {"expert_ids": torch.int64, "gates": torch.float32, "source_rank": torch.int32}
GATE_SUM_TOL = 1e-3


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_trace(folder: str | Path, expert_ids: torch.Tensor, gates: torch.Tensor, *, model: dict[str, Any],
                capture: dict[str, Any], source_rank: Optional[torch.Tensor] = None) -> dict:
    """Write a trace (``expert_ids`` / ``gates`` [S, Y, N, K]) to ``folder``, which must not hold one; returns the
    manifest. ``model`` holds at least ``name``, ``num_experts``, ``topk`` and ``hidden_size``; ``capture`` says
    how the routing was recorded."""
    folder = Path(folder)
    if (folder / "manifest.json").exists():
        raise FileExistsError(f"{folder} already holds a trace: pick another folder")
    for key in ("name", "num_experts", "topk", "hidden_size"):
        if key not in model:
            raise ValueError(f"model needs '{key}'")
    if expert_ids.dim() != 4 or gates.shape != expert_ids.shape:
        raise ValueError(f"expert_ids and gates must both be [steps, layers, tokens, topk] "
                         f"(got {tuple(expert_ids.shape)}, {tuple(gates.shape)})")
    s, y, n, k = expert_ids.shape
    if source_rank is None:
        source_rank = torch.zeros(n, dtype=torch.int32)
    tensors = {"expert_ids": expert_ids.to(torch.int64).cpu().contiguous(),
               "gates": gates.to(torch.float32).cpu().contiguous(),
               "source_rank": source_rank.to(torch.int32).cpu().contiguous()}
    (folder / "tensors").mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, t in tensors.items():
        path = folder / "tensors" / f"{name}.pt"
        torch.save(t, path)
        entries[name] = {"file": f"tensors/{name}.pt", "sha256": _sha256(path), "shape": list(t.shape),
                         "dtype": str(t.dtype).removeprefix("torch.")}
    manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION,
                "num_experts": int(model["num_experts"]), "topk": int(model["topk"]),
                "hidden_size": int(model["hidden_size"]), "num_steps": s, "num_layers": y, "num_tokens": n,
                "world_size": int(tensors["source_rank"].max()) + 1 if n else 1,
                "model": dict(model), "capture": dict(capture), "tensors": entries}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _fail(folder: Path, what: str, fix: str) -> ConfigError:
    return ConfigError(f"routing trace {folder}: {what}: {fix}")


RECAPTURE = "capture it again (scripts/capture_routing.py) or restore the folder"


def _manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not folder.is_dir():
        raise _fail(folder, "no such folder", "give workload.trace_path=<a trace folder>")
    if not path.is_file():
        raise _fail(folder, "no manifest.json", "give the folder that holds manifest.json")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(folder, f"manifest.json is not JSON ({type(e).__name__})", RECAPTURE) from None
    if not isinstance(m, dict):
        raise _fail(folder, "manifest.json is not an object", RECAPTURE)
    if m.get("schema_version") != SCHEMA_VERSION:
        raise _fail(folder, f"schema_version {m.get('schema_version')!r} is not {SCHEMA_VERSION}",
                    "capture it again with this version's scripts/capture_routing.py")
    for key in ("num_experts", "topk", "tensors"):
        if key not in m:
            raise _fail(folder, f"manifest.json lacks '{key}'", RECAPTURE)
    return m


def _load(folder: Path, m: dict, name: str, *, verify: bool) -> torch.Tensor:
    entry = m["tensors"].get(name) if isinstance(m["tensors"], dict) else None
    if not isinstance(entry, dict) or "file" not in entry:
        raise _fail(folder, f"manifest.json lists no tensor '{name}'", RECAPTURE)
    path = folder / entry["file"]
    if not path.is_file():
        raise _fail(folder, f"tensor file {entry['file']} is missing", RECAPTURE)
    if verify and _sha256(path) != entry.get("sha256"):
        raise _fail(folder, f"{entry['file']} does not match its sha256 in manifest.json (the file is damaged)",
                    RECAPTURE)
    try:
        t = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same refusal
        raise _fail(folder, f"cannot read {entry['file']} ({type(e).__name__})", RECAPTURE) from None
    if not isinstance(t, torch.Tensor):
        raise _fail(folder, f"{entry['file']} is not a tensor", RECAPTURE)
    if list(t.shape) != list(entry.get("shape", [])) or t.dtype != TENSORS[name]:
        raise _fail(folder, f"{entry['file']} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, the manifest "
                            f"says {entry.get('dtype')} {entry.get('shape')} (expected {TENSORS[name]})", RECAPTURE)
    return t


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """[S, Y, N, K]; a Megatron trace's [N, K] is one step of one layer."""
    return t.view(1, 1, *t.shape) if t.dim() == 2 else t


@functools.lru_cache(maxsize=8)
def _verified(folder: str, signature: tuple) -> tuple[dict, str]:
    """The manifest of a trace whose every tensor was checked (checksums, shapes, ids, gates), and its digest."""
    path = Path(folder)
    m = _manifest(path)
    ids = _as_4d(_load(path, m, "expert_ids", verify=True))
    gates = _as_4d(_load(path, m, "gates", verify=True))
    src = _load(path, m, "source_rank", verify=True)
    e, k = int(m["num_experts"]), int(m["topk"])
    if ids.dim() != 4 or gates.shape != ids.shape or ids.shape[-1] != k or src.shape != (ids.shape[2],):
        raise _fail(path, f"expert_ids {list(ids.shape)}, gates {list(gates.shape)} and source_rank "
                          f"{list(src.shape)} are not [steps, layers, tokens, topk={k}] twice and [tokens]", RECAPTURE)
    if ids.numel() == 0:
        raise _fail(path, "the trace holds no token", RECAPTURE)
    if int(ids.min()) < 0 or int(ids.max()) >= e:
        raise _fail(path, f"expert ids span [{int(ids.min())}, {int(ids.max())}], outside [0, {e})", RECAPTURE)
    srt = ids.sort(dim=-1).values
    if bool((srt[..., 1:] == srt[..., :-1]).any()):
        raise _fail(path, "a token chooses one expert twice", RECAPTURE)
    if not bool(torch.isfinite(gates).all()) or bool((gates < 0).any()):
        raise _fail(path, "gates hold a negative, NaN or infinite value", RECAPTURE)
    dev = float((gates.double().sum(-1) - 1).abs().max())
    if dev > GATE_SUM_TOL:
        raise _fail(path, f"a token's gates sum to 1 +- {dev:.3g}, not within {GATE_SUM_TOL:g}",
                    "renormalise them over the top-k (scripts/capture_routing.py does)")
    digest = hashlib.sha256("".join(f"{n}:{m['tensors'][n]['sha256']}\n" for n in sorted(TENSORS)).encode())
    return m, digest.hexdigest()


def verify(folder: str | Path) -> tuple[dict, str]:
    """Check a trace (every tensor against its sha256 in the manifest, its shapes, ids and gates) and return its
    manifest and digest: the sha256 of its tensors' sha256s (``name:sha256`` lines, by name), the trace's identity.
    Raises :class:`ConfigError`. A trace checked once in a process is checked again only when its files change."""
    path = Path(folder).expanduser().resolve()
    files = [path / "manifest.json", *(path / "tensors" / f"{n}.pt" for n in TENSORS)]
    signature = tuple((p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None for p in files)
    return _verified(str(path), signature)


def resolve(trace_path: Optional[str]) -> tuple[str, str]:
    """The absolute folder of ``workload.trace_path`` and the trace's digest, checked. Raises :class:`ConfigError`."""
    if not trace_path:
        raise ConfigError("workload=trace needs workload.trace_path=<a trace folder> "
                          "(scripts/capture_routing.py writes one)")
    path = Path(trace_path).expanduser().resolve()
    return str(path), verify(path)[1]


def case_trace(case: Any) -> tuple[str, int, Optional[str]]:
    """The trace folder, layer and digest of a ``routing=trace`` point (its ``routing_params``, filled by
    :func:`resolve` through the ``trace`` routing model, harness/config/routing_models.py)."""
    p = dict(case.routing_params)
    return p["trace_path"], p["trace_layer"], p.get("trace_sha256")


def check_case(case: Any) -> None:
    """Refuse a point the trace cannot serve: other ``num_experts`` / ``topk``, a layer it lacks, or fewer tokens
    than ``ep_size * tokens_per_gpu``. Raises :class:`ConfigError`."""
    folder, layer, _ = case_trace(case)
    m, _ = verify(folder)
    path = Path(folder)
    e, k, y, n = int(m["num_experts"]), int(m["topk"]), _layers(m), _tokens(m)
    if (case.num_experts, case.topk) != (e, k):
        raise _fail(path, f"it was captured with num_experts={e}, topk={k} and the point has "
                          f"num_experts={case.num_experts}, topk={case.topk}",
                    f"run it on a shape with both (shape=custom shape.num_experts={e} shape.topk={k} ...)")
    if not 0 <= layer < y:
        raise _fail(path, f"it holds {y} layer(s), no layer {layer}",
                    f"give workload.trace_layer=0..{y - 1}")
    need = case.ep_size * case.tokens_per_gpu
    if need > n:
        raise _fail(path, f"it holds {n} tokens a step and EP {case.ep_size} x {case.tokens_per_gpu} tokens per rank "
                          f"need {need}", f"give workload.tokens_per_gpu<={n // case.ep_size} or capture more tokens")


def _layers(m: dict) -> int:
    shape = m["tensors"]["expert_ids"]["shape"]
    return 1 if len(shape) == 2 else int(shape[1])


def _tokens(m: dict) -> int:
    shape = m["tensors"]["expert_ids"]["shape"]
    return int(shape[-2])


def _steps(m: dict) -> int:
    shape = m["tensors"]["expert_ids"]["shape"]
    return 1 if len(shape) == 2 else int(shape[0])


def trace_routing(case: Any, rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s top-k ids [T, K] (int64, global expert ids) and weights [T, K] (fp32) at step ``step`` of a
    run: the trace's step ``step mod S``, layer ``trace_layer``, tokens ``[rank*T, (rank+1)*T)``. The trace is
    verified (cached per process while its files are unchanged); raises :class:`ConfigError`."""
    folder, layer, want = case_trace(case)
    m, digest = verify(folder)
    if want is not None and digest != want:
        raise _fail(Path(folder), "it changed since the point was checked", "run the point again")
    path = Path(folder)
    t = case.tokens_per_gpu
    s = step % _steps(m)
    lo = rank * t
    ids = _as_4d(_load(path, m, "expert_ids", verify=False))[s, layer, lo:lo + t]
    w = _as_4d(_load(path, m, "gates", verify=False))[s, layer, lo:lo + t]
    return ids.clone().to(torch.int64), w.clone().to(torch.float32)
