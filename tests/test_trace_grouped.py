"""python/bench/trace_grouped.py, on the CPU at a tiny scale: it traces the grouped step,
and its summary names the step's ops and gives positive times. (The GPU run, with the
device's kernels and copies, is `gpu_verify.sh trace`.)"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent


def test_trace_names_the_grouped_ops_and_times_them(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "python" / "bench" / "trace_grouped.py"),
            *("--scale", "0.0005", "--batch", "37", "--calls", "3"),
            *("--timeline-events", "400", "--out", str(tmp_path / "trace")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    times = {
        k: float(v) for k, v in re.findall(r"^(untraced|traced): ([0-9.]+) ms per call", out, re.M)
    }
    assert set(times) == {"untraced", "traced"} and all(t > 0 for t in times.values()), out
    assert "== plane '/host:CPU'" in out, out
    timeline = out.split("the last call's host timeline", 1)[1]
    # The step's own ops, each with a duration, in the call's timeline.
    for op in (
        "TfTtemb>GroupBags",
        "TfTtemb>ResourceGatherReduceSum",
        "TfTtemb>GatherReduceSumGrad",
    ):
        rows = [line for line in timeline.splitlines() if op in line]
        assert rows, (op, timeline[:3000])
        start, _, duration = rows[0].split()[:3]
        assert float(start) >= 0 and float(duration) > 0, rows[0]
