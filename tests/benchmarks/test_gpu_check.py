"""The prepared GPU device check (benchmarks/gpu/check.sh), end to end in its dry run:
the same script the H200 runs, on this CPU with tiny shapes through Triton's
interpreter. Device time is scarce, so every code path must work before it gets
there: each section runs without error and the accuracy and parity verdicts hold;
the speed sections' numbers mean nothing here, only that they are all measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ["kernel_accuracy", "greedy_parity", "kernel_speed", "engine_speed", "speculative"]
KERNELS = ["reshape_and_cache", "paged_decode", "paged_decode_1_split", "paged_decode_16_splits",
           "paged_prefill_mixed", "rms_norm", "rms_norm_residual", "rotary_", "silu_and_mul"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "KVFLEET_CHECK_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "benchmarks/gpu/check.sh"), "--dry-run", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    return json.loads((out / "gpu_check_dry_run.json").read_text()), done.stdout, out


def test_every_section_runs_without_error(run) -> None:
    report, stdout, out = run
    assert report["mode"] == "dry-run" and report["environment"]["triton_interpreter"]
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["error"] is None, f"{name}: {section['error']}"
        assert section["targets"], name
    assert stdout == (out / "gpu_check_dry_run.txt").read_text()
    assert "5 sections ran, 0 crashed" in stdout


def test_every_kernel_is_within_tolerance_in_both_dtypes(run) -> None:
    kernels = run[0]["sections"]["kernel_accuracy"]["kernels"]
    assert sorted(kernels) == sorted(f"{name}/{dtype}" for name in KERNELS for dtype in ("bfloat16", "float32"))
    failing = {label: result for label, result in kernels.items() if not result["allclose"]}
    assert not failing
    assert kernels["reshape_and_cache/float32"]["max_abs_err"] == 0  # a copy: exact


def test_greedy_parity_is_exact(run) -> None:
    parity = run[0]["sections"]["greedy_parity"]
    assert parity["exact"] and not parity["mismatches"]
    assert parity["prefix_cache_hits"] > 0  # a chunk after cached blocks was among the steps
    assert not parity["cuda_graphs_captured"]  # a CPU: the graph buffers ran eagerly instead
    speculative = parity["speculative"]
    assert speculative["exact"] and speculative["all_accepted"] and speculative["graph_rows_per_request"] == [1, 4]
    assert speculative["draft_graphs"]


def test_the_speed_sections_measure_everything_they_report(run) -> None:
    sections = run[0]["sections"]
    kernel = sections["kernel_speed"]
    assert kernel["copy_bandwidth_GBps"] > 0 and len(kernel["cases"]) == 2
    for case in kernel["cases"]:
        assert case["triton_ms"] > 0 and case["sdpa_ms"] > 0 and case["max_abs_diff_vs_sdpa"] < 1e-2
    engine = sections["engine_speed"]
    assert engine["single_request"]["decode_tokens_per_s"] > 0 and engine["single_request"]["completed"]
    workload = engine["workload"]
    for name in ("kvfleet_full", "kvfleet_subset", "transformers_subset"):
        assert engine[name]["completed"], name
    assert engine["kvfleet_full"]["useful_tokens"] == workload["output_tokens"]
    assert engine["transformers_subset"]["useful_tokens"] == engine["kvfleet_subset"]["useful_tokens"]
    assert engine["throughput_ratio_full_vs_transformers_subset"] > 0
    speculative = sections["speculative"]
    assert set(speculative["verification_steps"]) == set(speculative["ratios"]) == {"1", "2"}
    for step in speculative["verification_steps"].values():
        assert step["decode_ms"] > 0 and step["verify_ms"] > 0
    assert all(rate > 0 for rates in speculative["tokens_per_s"].values() for rate in rates.values())
