"""The one timing and memory utility of tf_ttemb's measurements: `python -m tf_ttemb bench`
(tf_ttemb/bench.py), the demo (tf_ttemb/demo/) and the benchmark programs in python/bench/
(through python/bench/_bench_util.py, which loads this file without importing the package).

Timing: `time_calls` (one callable, repeated) and `time_alternating` (several callables
timed in turn, so a shared machine's load affects all alike); both take a `sync` that
waits until the call's work is done (a GPU call returns once its kernels are queued).

The benchmark programs, `python -m tf_ttemb bench` and the demo also share their command
line from here: the integer and choice-list types and options (`positive_int`,
`positive_int_list`, `add_int_options`, `add_choice_list`), the timing options
(`add_timing_options`), the worker entry point (`main_or_worker`), the report rows of
worker results (`result_rows`), the settings written with the results (`option_values`)
and the quiet `--json` of the GPU benchmarks (`write_json_if_asked`).

Nothing here imports TensorFlow or PyTorch (the standard library only, and no tf_ttemb
module): the benchmark drivers stay light and each measurement runs in a worker process
that imports the framework it measures (see `run_worker`).

Peak memory is measured two ways:

* TensorFlow's allocator statistics (`tensorflow_peak_bytes`): with
  `TF_CPU_ALLOCATOR_USE_BFC=true` in the environment before TensorFlow places its first
  tensor, CPU tensors come from a BFC allocator that counts them, and
  `tf.config.experimental.get_memory_info("CPU:0")` reports the current and peak bytes
  (`reset_memory_stats` restarts the peak). It counts allocator chunks, not tensors: the
  BFC allocator hands out a free chunk of up to twice the requested size without splitting
  it, so a tensor can count up to 2x its size. It is blind to memory a kernel takes from
  `malloc`/`new` directly (e.g. `std::vector` scratch) and to other frameworks.
* The resident set size (`PeakRss`): Linux keeps a high-water mark of it (`VmHWM`), which
  writing "5" to `/proc/self/clear_refs` resets to the current size. It sees every byte
  the process touches, including the C library's caches, so it is the comparable measure
  across frameworks, and a little noisier. Where the reset is not allowed, the growth of
  `getrusage().ru_maxrss` is used instead (a lower bound once the process has peaked
  higher before).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

MIB = float(1 << 20)

# The checkout this package lies in (for `git rev-parse`; an installed wheel has none).
CHECKOUT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock statistics of repeated calls, in milliseconds."""

    median_ms: float
    min_ms: float
    repeats: int

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _no_sync(result: Any = None) -> None:
    pass


@contextlib.contextmanager
def collector_paused():
    """Python's garbage collector off for the timed calls (as `timeit` does; here and in
    torch's side of `python -m tf_ttemb bench`, tf_ttemb/_bench_torch.py), after one
    full collection: a collection lands in whichever call happens to allocate past its
    threshold and, in a process holding TensorFlow's objects, takes milliseconds, so it
    would be charged to one call at random and to every framework differently."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_calls(
    fn: Callable[[], Any],
    warmup: int,
    repeats: int,
    sync: Optional[Callable[[], Any]] = None,
) -> Timing:
    """Times `fn()` `repeats` times after `warmup` untimed calls.

    Without `sync`, `fn` must return only once its work is done (TensorFlow on CPU and
    PyTorch on CPU both run synchronously). With it, `sync()` runs after the warm-up and
    inside every timed call, after `fn()`. Its result is dropped before the next call, so
    consecutive calls do not hold each other's outputs.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sync = sync or _no_sync
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    with collector_paused():
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(samples), min(samples), repeats)


def time_alternating(
    steps: Mapping[str, Callable[[], Any]],
    warmup: int,
    repeats: int,
    sync: Callable[[Any], Any] = _no_sync,
) -> Dict[str, Timing]:
    """name -> Timing of each step, the steps timed in turn (one call of each per round).

    `sync(result)` runs on every call's result, inside the timing: it must wait until the
    call's work is done.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for fn in steps.values():
            sync(fn())
    samples: Dict[str, List[float]] = {name: [] for name in steps}
    with collector_paused():
        for _ in range(repeats):
            for name, fn in steps.items():
                start = time.perf_counter()
                sync(fn())
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: Timing(statistics.median(s), min(s), len(s)) for name, s in samples.items()}


def chained_steps(tf: Any, step: Callable[[], Any], steps: int) -> Callable[[], Any]:
    """A `tf.function` that runs `step()` (a float32 scalar) `steps` times in one
    `tf.while_loop`, one iteration after the other, and returns their sum: a step's time
    inside a graph, without TensorFlow's cost of a call. `parallel_iterations=1`, since by
    default up to 10 iterations that nothing orders would run at once (on a CPU, on its
    inter-op threads), which measures throughput, not one step after another."""

    @tf.function
    def loop():
        def body(i, total):
            return i + 1, total + step()

        start = (tf.constant(0), tf.constant(0.0))
        return tf.while_loop(lambda i, _: i < steps, body, start, parallel_iterations=1)[1]

    return loop


def time_per_call_and_in_graph(
    tf: Any,
    probes: Mapping[Any, Callable[[Any], Any]],
    inputs: Sequence[Any],
    warmup: int,
    repeats: int,
) -> List[Dict[str, Any]]:
    """Times TensorFlow steps through `tf.function`, all alternately: for each key of
    `probes` (fn(x) -> a scalar tensor that depends on the step's whole result), "per call"
    runs fn(inputs[0]) in one call and "in graph" the steps of every input in one call,
    divided by their count. Each call ends by fetching the scalar (so its time includes
    the device's work). Returns dicts of key, kind, median_ms, min_ms."""
    steps = {}
    for key, fn in probes.items():
        steps[(key, "per call")] = tf.function(lambda fn=fn: fn(inputs[0]))
        steps[(key, "in graph")] = tf.function(lambda fn=fn: tf.add_n([fn(x) for x in inputs]))
    timings = time_alternating(steps, warmup, repeats, sync=lambda r: r.numpy())
    out = []
    for (key, kind), t in timings.items():
        divisor = len(inputs) if kind == "in graph" else 1
        out.append(
            dict(key=key, kind=kind, median_ms=t.median_ms / divisor, min_ms=t.min_ms / divisor)
        )
    return out


# ----------------------------------------------------------------------------------------
# Peak memory.


def status_kib(field: str) -> Optional[int]:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), or None where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _ru_maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class PeakRss:
    """Measures how far the resident set size rises above its level at `start()`.

    Example:
      meter = PeakRss()
      meter.start()
      step()
      growth_bytes = meter.growth_bytes()
    """

    def __init__(self) -> None:
        self.method = ""
        self._baseline = 0

    def start(self) -> None:
        """Resets the high-water mark (where allowed) and records the baseline."""
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            rss_kib = status_kib("VmRSS")
            if rss_kib is None or status_kib("VmHWM") is None:
                raise OSError("no VmRSS/VmHWM in /proc/self/status")
            self.method = "VmHWM (reset via /proc/self/clear_refs)"
            self._baseline = rss_kib * 1024
        except OSError:
            self.method = "ru_maxrss growth (lower bound)"
            self._baseline = _ru_maxrss_bytes()

    def growth_bytes(self) -> int:
        """Peak RSS since `start()` minus the baseline, in bytes (never negative)."""
        if not self.method:
            raise RuntimeError("PeakRss.growth_bytes() called before start()")
        if self.method.startswith("VmHWM"):
            peak = (status_kib("VmHWM") or 0) * 1024
        else:
            peak = _ru_maxrss_bytes()
        return max(0, peak - self._baseline)


def tensorflow_peak_bytes(tf: Any, step: Callable[[], Any]) -> Dict[str, Any]:
    """Peak growth of TensorFlow's CPU allocator over one call of `step()`.

    Needs `TF_CPU_ALLOCATOR_USE_BFC=true` in the environment before TensorFlow placed its
    first tensor. The result of `step()` stays alive until the peak is read, so it counts.

    Returns:
      `{"ok": True, "growth_bytes": int}`, or `{"ok": False, "reason": str}` when the
      allocator keeps no statistics.
    """
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except (ValueError, tf.errors.OpError) as e:
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"}
    result = step()
    info = tf.config.experimental.get_memory_info("CPU:0")
    del result
    if info["peak"] <= 0:
        return {"ok": False, "reason": "the CPU allocator reported a peak of 0 bytes"}
    return {"ok": True, "growth_bytes": int(info["peak"] - before)}


# ----------------------------------------------------------------------------------------
# Worker processes.


def run_worker(
    script: str, spec: Mapping[str, Any], env_updates: Mapping[str, Optional[str]]
) -> Dict[str, Any]:
    """Runs `script --_worker SPEC` in a fresh interpreter and returns its JSON result.

    The worker writes its result to the file named by `spec["result_path"]` (set here),
    so TensorFlow's log lines on stdout/stderr cannot corrupt it.

    Args:
      script: Path of the benchmark program.
      spec: What to measure; must be JSON-serialisable.
      env_updates: Environment changes for the worker; a value of None removes the name.

    Returns:
      The worker's result, or `{"ok": False, "error": ...}` with the tail of its output
      when it failed.
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for key, value in env_updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    fd, result_path = tempfile.mkstemp(prefix="tf_ttemb_bench_", suffix=".json")
    os.close(fd)
    try:
        spec = dict(spec, result_path=result_path)
        proc = subprocess.run(
            [sys.executable, script, "--_worker", json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        try:
            with open(result_path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
            return {"ok": False, "error": f"worker exited with status {proc.returncode}:\n{tail}"}
    finally:
        os.unlink(result_path)


def write_worker_result(spec: Mapping[str, Any], result: Mapping[str, Any]) -> None:
    """The worker side of `run_worker`."""
    with open(spec["result_path"], "w", encoding="utf-8") as f:
        json.dump(result, f)


def error_summary(e: BaseException) -> str:
    """`Type: first line of the message`, how a failed measurement is reported in a table."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def worker_main(spec: Mapping[str, Any], measure: Callable[[Mapping[str, Any]], Any]) -> None:
    """The worker side of `run_worker`: writes `measure(spec)`, or `{"ok": False, "error":
    ...}` when it raised (reported in the table instead of a traceback)."""
    try:
        result = measure(spec)
    except Exception as e:  # noqa: BLE001 -- reported in the table instead of a traceback
        result = {"ok": False, "error": error_summary(e)}
    write_worker_result(spec, result)


# ----------------------------------------------------------------------------------------
# Reporting.


def cpu_model() -> str:
    """The CPU's model name as the OS reports it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# Environment variables that change what a benchmark measures: TensorFlow's thread pools,
# oneDNN, OpenMP (torch), and the package's own CPU switches (README).
RESULT_ENVIRONMENT = (
    "TF_NUM_INTEROP_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_ENABLE_ONEDNN_OPTS",
    "OMP_NUM_THREADS",
    "TF_TTEMB_CPU_ISA",
    "TF_TTEMB_ROW_PREFETCH",
    "TF_TTEMB_ROW_PREFETCH_LINES",
    "TF_TTEMB_HUGE_PAGES",
)


def result_environment() -> Dict[str, str]:
    """The RESULT_ENVIRONMENT variables that are set, with their values."""
    return {name: os.environ[name] for name in RESULT_ENVIRONMENT if name in os.environ}


def environment_suffix() -> str:
    """Each variable of result_environment() as ", NAME=value", for a report's header."""
    return "".join(f", {name}={value}" for name, value in result_environment().items())


def machine_info() -> Dict[str, Any]:
    """Facts about the machine and the run that make a result reproducible."""
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "command_line": [sys.executable] + sys.argv,
        "environment": result_environment(),
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "-C", CHECKOUT_ROOT, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(cell).ljust(width) if i == 0 else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        ]
        return " | ".join(parts)

    rule = "-+-".join("-" * width for width in widths)
    return "\n".join([line(headers), rule] + [line(row) for row in rows])


def write_json(path: str, document: Any, indent: int = 2, announce: bool = True) -> None:
    """Writes `document` to `path` (creating its folder); logs where when `announce`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=indent)
    if announce:
        log(f"wrote {path}")


def write_json_if_asked(path: Optional[str], document: Any) -> None:
    """The GPU benchmarks' `--json PATH`: writes `document` there, compactly (indent 1) and
    without a log line, when a path was given."""
    if path:
        write_json(path, document, indent=1, announce=False)


def log(message: str) -> None:
    """Progress messages go to stderr, the results to stdout."""
    print(message, file=sys.stderr, flush=True)


def mib_text(num_bytes: Optional[float], missing: str = "-") -> str:
    """`num_bytes` in MiB as a report cell (`1,234.5`), or `missing` for None."""
    return missing if num_bytes is None else f"{num_bytes / MIB:,.1f}"


def parse_list(text: str, allowed: Sequence[str]) -> List[str]:
    """Parses a comma-separated choice list for argparse, keeping the order given."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise ValueError(
            f"unknown choice(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {', '.join(allowed)}"
        )
    return list(dict.fromkeys(items))


# ----------------------------------------------------------------------------------------
# Command-line types (argparse `type=`).


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1; thousands separators (`,` or `_`) are allowed."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0; thousands separators (`,` or `_`) are allowed."""
    return _int_at_least(text, 0)


def positive_int_list(text: str) -> List[int]:
    """Comma-separated integers >= 1 (`2048,4096`; `_` may separate thousands)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [positive_int(item) for item in items]


def choice_list(allowed: Sequence[str]) -> Callable[[str], List[str]]:
    """An argparse type: a comma-separated list of `allowed` choices (see `parse_list`)."""

    def parse(text: str) -> List[str]:
        try:
            return parse_list(text, list(allowed))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


# ----------------------------------------------------------------------------------------
# Command-line options and settings the benchmark programs share.

# The short flags of the table and batch sizes.
SHORT_FLAGS = {"num_rows": "-N", "dim": "-D", "bags": "-B", "bag_size": "-L"}


def add_int_options(parser: argparse.ArgumentParser, **options: Any) -> None:
    """Adds positive-integer options, in the order given: each keyword is the option's dest
    (flag `--dest-with-dashes`, and the short flag of `SHORT_FLAGS` for the sizes) and its
    value the default, or a pair (default, help text)."""
    for dest, value in options.items():
        default, text = value if isinstance(value, tuple) else (value, None)
        flags = ["--" + dest.replace("_", "-")] + (
            [SHORT_FLAGS[dest]] if dest in SHORT_FLAGS else []
        )
        parser.add_argument(*flags, type=positive_int, default=default, help=text)


def add_choice_list(
    parser: argparse.ArgumentParser,
    flag: str,
    allowed: Sequence[str],
    text: str,
    default: Optional[Sequence[str]] = None,
    **kwargs: Any,
) -> None:
    """Adds option `flag`: a comma-separated list of `allowed` choices (see `choice_list`),
    with help `text`; `default` None leaves the choice to the program. `kwargs` go to
    `add_argument` (e.g. `metavar`)."""
    parser.add_argument(flag, type=choice_list(allowed), default=default, help=text, **kwargs)


def choices_parser(
    description: str, title: str, choices: Mapping[str, str], note: str
) -> argparse.ArgumentParser:
    """A benchmark's ArgumentParser whose --help epilog lists what it compares:
    `title: key = label; ... . note`."""
    listed = "; ".join(f"{key} = {label}" for key, label in choices.items())
    return argparse.ArgumentParser(description=description, epilog=f"{title}: {listed}. {note}")


def result_rows(
    results: Sequence[Mapping[str, Any]],
    label_of: Callable[[Mapping[str, Any]], str],
    width: int,
    row_of: Callable[[Mapping[str, Any], str], List[str]],
) -> Tuple[List[List[str]], List[str]]:
    """A report's table rows, one per worker result in order, and its failures: the row
    `row_of(result, label)` of a result that ran (`ok`), `label` and `width - 1` cells
    "n/a" for one that failed, with its line `label: error` in the failures."""
    rows, failures = [], []
    for result in results:
        label = label_of(result)
        if result.get("ok"):
            rows.append(row_of(result, label))
        else:
            rows.append([label] + ["n/a"] * (width - 1))
            failures.append(f"{label}: {result.get('error', 'failed')}")
    return rows, failures


def report_text(lines: Sequence[str], failures: Sequence[str]) -> str:
    """A printed report: its lines, then one `failed: ...` line per failure."""
    return "\n".join([*lines, *(f"failed: {failure}" for failure in failures)])


def add_timing_options(
    parser: argparse.ArgumentParser,
    repeats: Tuple[Optional[int], str],
    warmup: Tuple[Optional[int], str],
    threads_help: Optional[str] = None,
    warmup_type: Callable[[str], int] = non_negative_int,
) -> None:
    """Adds --repeats and --warmup, each from (default, help text), and --threads (TF
    intra-op threads, default 0) when `threads_help` is given."""
    parser.add_argument("--repeats", type=positive_int, default=repeats[0], help=repeats[1])
    parser.add_argument("--warmup", type=warmup_type, default=warmup[0], help=warmup[1])
    if threads_help is not None:
        parser.add_argument("--threads", type=non_negative_int, default=0, help=threads_help)


def main_or_worker(
    main: Callable[[Sequence[str]], int],
    worker_main: Callable[[Dict[str, Any]], None],
    argv: Optional[Sequence[str]] = None,
) -> int:
    """A benchmark program's entry point: the command line `--_worker SPEC` (how
    `run_worker` starts a worker) runs `worker_main(spec)`, any other `main(argv)`.

    argv defaults to `sys.argv[1:]`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 2 and argv[0] == "--_worker":
        worker_main(json.loads(argv[1]))
        return 0
    return main(argv)


def option_values(args: argparse.Namespace, *names: str) -> Dict[str, Any]:
    """{name: args.name} for the options named, in that order (a results file's settings)."""
    return {name: getattr(args, name) for name in names}


def from_options(cls: Any, args: argparse.Namespace, **overrides: Any) -> Any:
    """The dataclass `cls` with each field from the option of the same name, but those in
    `overrides`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**dict(values, **overrides))
