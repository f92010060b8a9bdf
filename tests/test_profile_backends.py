"""mok_tools/profile_backends.py on the CPU: one kernel table per backend, from the harness's own point."""

from __future__ import annotations

from mok_tools import profile_backends


def test_one_kernel_table_per_backend(tmp_path):
    out = tmp_path / "profile.txt"
    assert profile_backends.main(["--backends", "torch,nccl", "--steps", "1", "--warmup", "1", "--out", str(out),
                                  "--", "device=cpu", "shape=tiny", "workload.tokens_per_gpu=32"]) == 0
    text = out.read_text()
    head, torch_part, nccl_part = text.split("\n=== ")
    assert "shape=tiny precision=bf16 tokens=32" in head and "1 steps (forward + backward) after 1 untimed" in head
    assert torch_part.startswith("torch: impl=") and "aten::_grouped_mm" in torch_part
    assert nccl_part.startswith("nccl: grouped GEMM: per-expert loop")  # the CPU's path, as its notes say
    assert "aten::_grouped_mm" not in nccl_part and "aten::mm" in nccl_part
