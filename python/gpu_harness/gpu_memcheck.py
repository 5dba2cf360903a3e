"""Runs test files under compute-sanitizer, sharded over parallel processes, and sums up.

On the GPU machine, through ../shared/tf_gpu/ (TensorFlow places our ops on the GPU):

  bash .tfgpu/run.sh python3 python/gpu_harness/gpu_memcheck.py --tool memcheck --shards 12 \\
      --out "$OUT/memcheck" tests/test_gather_reduce_sum.py tests/test_tt_ops.py
  bash .tfgpu/run.sh python3 python/gpu_harness/gpu_memcheck.py --tool racecheck --shards 12 \\
      --out "$OUT/racecheck" -k "float32" tests/test_gpu_parity.py

pytest-xdist workers do not run under compute-sanitizer (the sanitizer follows the
controller only, or crashes), so this collects the tests itself, deals them round-robin
into `--shards` lists and runs one `compute-sanitizer --tool <tool> python -m pytest <ids>`
per list, all at once (one GPU, TF_FORCE_GPU_ALLOW_GROWTH). CUDA API calls that return
an error are not counted (`--report-api-errors no`: XLA looks up module symbols that may be
absent); a kernel that faults still is, and so is every memory error. Each shard writes its
sanitizer log and its pytest output under --out. The summary gives, per shard, the
sanitizer's ERROR SUMMARY line and pytest's last line, then the totals; the exit status is
0 only when every shard's sanitizer reported 0 errors and pytest passed. A shard that runs
past --timeout is killed and counts as a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="test files or node ids")
    parser.add_argument(
        "--tool", default="memcheck", choices=["memcheck", "racecheck", "initcheck", "synccheck"]
    )
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--out", required=True, help="folder for the logs")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("-m", dest="marker", default=None, help="pytest -m expression")
    parser.add_argument(
        "--timeout",
        type=float,
        default=540.0,
        help="seconds before the shards still running are killed",
    )
    parser.add_argument("--sanitizer", default="compute-sanitizer")
    return parser.parse_args(argv)


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def selection_args(args: argparse.Namespace) -> list[str]:
    extra = []
    if args.keyword:
        extra += ["-k", args.keyword]
    if args.marker:
        extra += ["-m", args.marker]
    return extra


def collect(args: argparse.Namespace) -> list[str]:
    """The node ids pytest selects, without running them (and without the sanitizer)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        *selection_args(args),
        *args.paths,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"collected nothing:\n{done.stdout}\n{done.stderr}")
    return ids


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ids = collect(args)
    shards = [ids[i :: args.shards] for i in range(min(args.shards, len(ids)))]
    print(f"{len(ids)} tests in {len(shards)} shards under {args.tool}", flush=True)
    procs = []
    start = time.monotonic()
    for i, shard in enumerate(shards):
        log = os.path.join(args.out, f"{args.tool}_{i}.log")
        cmd = [
            args.sanitizer,
            "--tool",
            args.tool,
            "--log-file",
            log,
            "--target-processes",
            "application-only",
            "--print-limit",
            "50",
            # Many processes importing TensorFlow at once take longer than the default
            # 10 s to reach CUDA; the sanitizer would then run them uninstrumented.
            "--launch-timeout",
            str(int(args.timeout)),
            # Counted: memory (or race) errors. CUDA API calls that fail by design
            # (XLA probing a module for a symbol) are not.
            "--report-api-errors",
            "no",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfE",
            "--tb=short",
            # A test that hangs leaves every thread's Python stack in the shard's output.
            "-o",
            f"faulthandler_timeout={max(30, int(args.timeout) // 3)}",
            *shard,
        ]
        out = open(os.path.join(args.out, f"pytest_{i}.txt"), "w")  # noqa: SIM115 (closed below)
        procs.append((i, log, out, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)))
    ok = True
    total_errors = 0
    for i, log, out, proc in procs:
        left = max(1.0, args.timeout - (time.monotonic() - start))
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        out.close()
        summary = "no ERROR SUMMARY line"
        if os.path.exists(log):
            # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards
            # displayed (N errors, W warnings)".
            found = re.findall(
                r"(?:ERROR SUMMARY: |SUMMARY: \d+ hazards? displayed \()(\d+) error", read(log)
            )
            if found:
                errors = int(found[-1])
                total_errors += errors
                summary = f"ERROR SUMMARY: {errors} errors"
                ok = ok and errors == 0
            else:
                ok = False
        else:
            ok = False
        lines = [line for line in read(out.name).splitlines() if line.strip()]
        last = lines[-1] if lines else "(no pytest output)"
        ok = ok and rc == 0
        print(f"shard {i:2d}: rc {rc}; {summary}; pytest: {last}", flush=True)
        if rc == "timeout":
            # pytest -q prints one character per finished test: the next one was running.
            finished = sum(
                len(re.match(r"[.FEsxX]*", line).group(0))
                for line in lines
                if re.match(r"[.FEsxX]+\s*(\[\s*\d+%\])?(Timeout \(|$)", line)
            )
            running = shard[finished] if finished < len(shard) else "(after the last test)"
            # faulthandler_timeout's dump names the test function that hung (its stack).
            frames = re.findall(
                r'File "[^"]*/(tests/\w+\.py)", line \d+ in (test_\w+)', "\n".join(lines)
            )
            if frames:
                running = "::".join(frames[-1]) + " (from its stack)"
            print(f"          {finished} of {len(shard)} finished; running: {running}", flush=True)
        if os.path.exists(log):
            # Where the errors are: the kernels they name, and the first failed tests.
            text = read(log)
            kernels = re.findall(
                r"=========\s+at (\S+?)(?:\+0x[0-9a-f]+)?(?: in |$)", text, re.MULTILINE
            )
            for name in sorted(set(kernels)):
                print(f"          {kernels.count(name)} x at {name}", flush=True)
        for line in [line for line in lines if line.startswith("FAILED")][:3]:
            print(f"          {line}", flush=True)
    print(
        f"{args.tool}: {len(ids)} tests, {total_errors} errors in all, "
        f"{time.monotonic() - start:.0f} s; {'clean' if ok else 'NOT CLEAN'}",
        flush=True,
    )
    # One file for all shards (the device returns a limited number of files).
    with open(os.path.join(args.out, f"{args.tool}_all.txt"), "w") as everything:
        for i in range(len(shards)):
            for name in (f"{args.tool}_{i}.log", f"pytest_{i}.txt"):
                path = os.path.join(args.out, name)
                if os.path.exists(path):
                    everything.write(f"==== {name}\n{read(path)}\n")
                    os.remove(path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
