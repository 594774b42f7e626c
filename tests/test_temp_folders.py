"""The temporary folders a launcher, an engine or an offline LLM makes carry their maker's pid, and a sweep
removes those whose maker is gone (a SIGKILL runs no clean-up): never a running maker's, never a name
that is not ours. tests/test_reliability.py kills a real launcher and sweeps what it left."""

from __future__ import annotations

import os
import subprocess
import sys

from protocol import temp_folders


def test_the_sweep_removes_only_what_a_maker_no_longer_running_left(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    dead = int(gone.stdout)
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = [tmp_path / f"engine-run-{dead}-abc", tmp_path / f"engine-metrics-{dead}-x"]
        for path in left:
            (path / "inside").mkdir(parents=True)
        (tmp_path / f"engine-refusal-{dead}-y").write_text("")
        kept = [f"engine-run-{living.pid}-abc", f"engine-state-{os.getpid()}-z", "engine-abc", "other-1-2"]
        for name in kept:
            (tmp_path / name).mkdir()
        mine = temp_folders.folder("run", str(tmp_path))
        assert os.path.basename(mine).startswith(f"engine-run-{os.getpid()}-")
        removed = temp_folders.sweep(str(tmp_path))
        assert sorted(os.path.basename(p) for p in removed) == sorted(
            [f"engine-run-{dead}-abc", f"engine-metrics-{dead}-x", f"engine-refusal-{dead}-y"]
        )
        assert sorted(os.listdir(tmp_path)) == sorted([*kept, os.path.basename(mine)])
    finally:
        living.kill()
        living.wait()
