"""The prepared GPU device check: Triton kernel accuracy, greedy parity with
transformers, decode-kernel speed, engine speed and speculative decoding, in one run of
at most 9 minutes on one H200. Run it through check.sh (it sets the import path up on a
machine where kvfleet is not installed); --dry-run runs every code path on a CPU, with
tiny shapes, through Triton's interpreter, where its numbers mean nothing.

Each section runs on its own: one that crashes is recorded with its error and the
others still run. Targets are reported, not enforced: the exit status is 1 only when
a section crashed. The JSON and a text summary are rewritten after every section, so
a run cut short still leaves what it measured.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
# Triton picks its interpreter when the kernels' modules are defined, so worker_svc's
# choice must come before anything (transformers) imports triton.
import worker_svc.kernels.triton.interpreter  # noqa: E402,F401,I001

# isort: split
import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
import triton  # noqa: E402

from benchmarks.gpu import engine_speed, kernel_accuracy, kernel_speed, parity, speculative  # noqa: E402
from benchmarks.gpu.common import DRY_RUN, GPU, Profile, free_device  # noqa: E402
from worker_svc.kernels.cpu.threads import configure_torch_threads  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SECTIONS: dict[str, Callable[[Profile, Path], dict[str, Any]]] = {
    "kernel_accuracy": lambda profile, _: kernel_accuracy.run(profile),
    "greedy_parity": parity.run,
    "kernel_speed": lambda profile, _: kernel_speed.run(profile),
    "engine_speed": engine_speed.run,
    "speculative": speculative.run,
}


def _environment(profile: Profile) -> dict[str, Any]:
    device = torch.cuda.get_device_name() if profile.device.type == "cuda" else platform.processor() or "cpu"
    return {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "transformers": transformers.__version__,
            "triton_interpreter": worker_svc.kernels.triton.interpreter.INTERPRETED}


def summary(report: dict[str, Any]) -> str:
    sections = report["sections"]
    crashed = [name for name, section in sections.items() if section["error"]]
    targets = [t for section in sections.values() for t in section.get("targets", [])]
    lines = [f"kvfleet GPU check ({report['mode']}) on {report['environment']['device']}: "
             f"{len(sections)} sections ran, {len(crashed)} crashed; targets met "
             f"{sum(t['met'] for t in targets)}/{len(targets)}; {report['total_seconds']:.0f} s"]
    for name, section in sections.items():
        status = f"CRASHED: {section['error'].splitlines()[-1]}" if section["error"] else "ok"
        lines.append(f"[{name}] {status} ({section['seconds']:.1f} s)")
        lines += [f"  {note}" for note in section.get("notes", [])]
        for goal in section.get("targets", []):
            value = goal["value"]
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"  {'met ' if goal['met'] else 'MISS'} {goal['name']}: {shown} (target {goal['target']})")
    return "\n".join(lines) + "\n"


def _write(report: dict[str, Any], out_dir: Path, stem: str) -> str:
    text = summary(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{stem}.txt").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, in run order")
    parser.add_argument("--workdir", type=Path, default=None, help="where the random checkpoints go (a temp dir)")
    args = parser.parse_args()
    profile = DRY_RUN if args.dry_run else GPU
    if profile.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run")
    names = args.sections.split(",")
    unknown = set(names) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    configure_torch_threads()  # KVFLEET_NUM_THREADS, as the engine would (tests pin one)
    stem = "gpu_check_dry_run" if args.dry_run else "gpu_check"
    began = time.perf_counter()
    report: dict[str, Any] = {"mode": profile.name, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "environment": _environment(profile), "profile": profile.describe(),
                              "total_seconds": 0.0, "sections": {}}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="kvfleet-gpu-check-") as workdir:
        for name in names:
            started = time.perf_counter()
            section: dict[str, Any] = {"error": None}
            try:
                section.update(SECTIONS[name](profile, Path(workdir)))
            except Exception:
                section["error"] = traceback.format_exc()
            section["seconds"] = time.perf_counter() - started
            free_device()
            report["sections"][name] = section
            report["total_seconds"] = time.perf_counter() - began
            text = _write(report, args.out_dir, stem)
            print(f"[{time.strftime('%H:%M:%S')}] {name} done in {section['seconds']:.1f} s", file=sys.stderr,
                  flush=True)
    print(text, end="")
    return 1 if any(section["error"] for section in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
