"""The checked-in stubs under services/pb are what protos/generate.py makes of protos/."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "services" / "pb"


def _files(root: Path) -> dict[Path, bytes]:
    return {
        path.relative_to(root): path.read_bytes()
        for path in root.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_checked_in_stubs_are_current(tmp_path: Path) -> None:
    env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "protos/generate.py", "--out", str(tmp_path)], cwd=REPO, env=env, check=True)
    generated, checked_in = _files(tmp_path), _files(CHECKED_IN)
    assert any(path.name == "worker_pb2_grpc.py" for path in generated)
    assert sorted(map(str, generated)) == sorted(map(str, checked_in)), "run `make protos`"
    stale = sorted(str(path) for path in generated if generated[path] != checked_in[path])
    assert not stale, f"stale stubs {stale}: run `make protos`"


def test_stubs_import_each_other_from_the_services_package() -> None:
    # protoc's own `from kvfleet.v1 import common_pb2` would look inside the kvfleet facade and fail.
    from services.pb.kvfleet.v1 import scheduler_pb2_grpc, worker_pb2

    assert worker_pb2.NewRequestData.DESCRIPTOR.fields_by_name["sampling_params"].message_type.full_name == (
        "kvfleet.v1.SamplingParams"
    )
    assert scheduler_pb2_grpc.SchedulerStub
