"""The benchmarks' profile summary: kernel and operator names sorted into kinds, and the times of a
profiled region read per operator (CPU mode) and summed per kind."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_rlhf.metrics.kernels import OTHER, by_kind, costliest, kind_of, op_times, print_report


@pytest.mark.parametrize(
    "name,kind",
    [
        ("nvjet_tst_192x192_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled (triton)"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("Memcpy HtoD (Pageable -> Device)", "copy / fill"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", OTHER),
        ("aten::addmm", "gemm"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ],
)
def test_kind_of_sorts_known_kernel_names(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_op_times_reads_cpu_operators_and_by_kind_adds_them_up() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(a, b)
        torch.nn.functional.silu(a)
    times = op_times(prof)
    assert times["aten::mm"][1] == 3 and times["aten::silu"][1] == 1
    assert all(name.startswith("aten::") and us > 0 for name, (us, _) in times.items())
    kinds = by_kind(times)
    assert kinds["gemm"] == pytest.approx(sum(us for name, (us, _) in times.items() if kind_of(name) == "gemm"))
    assert sum(kinds.values()) == pytest.approx(sum(us for us, _ in times.values()))
    assert list(kinds.values()) == sorted(kinds.values(), reverse=True)


def test_costliest_ranks_by_time_and_the_report_lands_beside_the_json(tmp_path, capsys) -> None:
    times = {"b": (5.0, 2), "a": (20.0, 1), "c": (1.0, 7)}
    lines = costliest(times, 2)
    assert [line.split()[-1] for line in lines] == ["a", "b"] and lines[0].split()[:3] == ["20.0", "us", "1.0x"]
    print_report(["== head", *lines], tmp_path / "bench.json")
    assert (tmp_path / "bench.profile.txt").read_text() == "\n".join(["== head", *lines]) + "\n"
    assert "== head" in capsys.readouterr().out
