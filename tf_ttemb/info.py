"""`python -m tf_ttemb info`: what this tf_ttemb is, what it was built for, what it runs.

Prints, and with `--json PATH` also writes as JSON:

* tf_ttemb's version and where the package is (a checkout or an installed wheel);
* the running TensorFlow (version, path, whether it is a CUDA build) and the one the op
  library was built against, with their C++11 ABI flags and compile flags, and whether
  they match (the import-time check of `tf_ttemb.ops._loader`);
* the op library: its path and size, the compile flags of the build, the CPU extensions
  it needs and whether this CPU has them, and whether CUDA kernels are compiled in: as
  recorded by the build (`_build_info.json`) and as seen in TensorFlow's kernel registry
  (a GPU kernel of any TfTtemb op);
* every TfTtemb op of the library with its registered kernels per device type and the
  dtypes they accept;
* the devices TensorFlow sees.

The kernel registry is read with TensorFlow's `get_registered_kernels_for_op`, which
TensorFlow exposes only under `tensorflow.python` (there is no public API for it); when
it is unavailable the kernels section says so instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Dict, List, Optional

EPILOG = """examples:
  python -m tf_ttemb info
  python -m tf_ttemb info --json info.json     # also write everything as JSON
  python -m tf_ttemb info --json -             # JSON only, on stdout"""

_OP_PREFIX = "TfTtemb>"
_DTYPE_ORDER = ("float16", "bfloat16", "float32", "float64", "int32", "int64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the command's options to its subparser."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Versions (tf_ttemb, the running TensorFlow and the one the op library was built "
        "against), the build's compiler flags and ABI, whether CUDA kernels are compiled in, "
        "the registered kernels per device of every TfTtemb op, and the visible devices."
    )
    parser.epilog = EPILOG
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the information as JSON to PATH ('-': only JSON, on stdout)",
    )


def _dtype_name(enum_value: int) -> str:
    import tensorflow as tf

    try:
        return tf.as_dtype(enum_value).name
    except TypeError:
        return str(enum_value)


def _registered_kernels(op_name: str) -> Optional[Dict[str, Any]]:
    """device type -> {"count": n, "constraints": {attr: [dtype, ...]}} for one op."""
    try:
        from tensorflow.python.framework import kernels  # no public equivalent
    except ImportError:
        return None
    per_device: Dict[str, Any] = {}
    for kernel in kernels.get_registered_kernels_for_op(op_name).kernel:
        entry = per_device.setdefault(kernel.device_type, {"count": 0, "constraints": {}})
        entry["count"] += 1
        for constraint in kernel.constraint:
            values = entry["constraints"].setdefault(constraint.name, [])
            for value in constraint.allowed_values.list.type:
                name = _dtype_name(value)
                if name not in values:
                    values.append(name)
    for entry in per_device.values():
        for name, values in entry["constraints"].items():
            values.sort(key=lambda v: (_DTYPE_ORDER.index(v) if v in _DTYPE_ORDER else 99, v))
    order = {"CPU": 0, "GPU": 1}
    return {k: per_device[k] for k in sorted(per_device, key=lambda d: (order.get(d, 2), d))}


def _op_names(library: Any) -> List[str]:
    """The TfTtemb ops the loaded library registered, from its generated wrappers."""
    return sorted(
        _OP_PREFIX + name[len("TfTtemb_") :]
        for name in dir(library)
        if name.startswith("TfTtemb_") and callable(getattr(library, name))
    )


def collect() -> Dict[str, Any]:
    """Everything `info` reports, as a JSON-serialisable dict."""
    import tensorflow as tf

    import tf_ttemb
    from tf_ttemb.ops import _loader

    package_dir = os.path.dirname(os.path.abspath(tf_ttemb.__file__))
    build = _loader.read_build_info()
    tf_build = dict(tf.sysconfig.get_build_info())
    flags = list(build.get("compile_flags", [])) if build else []
    cpu_flags = _loader.cpu_flags()
    needed = [ext for flag, ext in _loader._CPU_EXTENSIONS.items() if flag in flags]
    info: Dict[str, Any] = {
        "tf_ttemb_version": tf_ttemb.__version__,
        "package_dir": package_dir,
        "installed_from": (
            "checkout" if os.path.exists(_loader._CONFIGURE) else "installed package (wheel)"
        ),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "tf_version": tf.__version__,
        "tf_path": os.path.dirname(tf.__file__),
        "tf_cxx11_abi": int(tf.sysconfig.CXX11_ABI_FLAG),
        "tf_compile_flags": _loader.running_tf_flags(),
        "tf_is_cuda_build": bool(tf_build.get("is_cuda_build", False)),
        "tf_cuda_version": tf_build.get("cuda_version"),
        "build": build,
        "build_mismatches": _loader.build_mismatches(build) if build else [],
        "library_path": _loader.LIBRARY_PATH,
        "library_bytes": (
            os.path.getsize(_loader.LIBRARY_PATH) if os.path.exists(_loader.LIBRARY_PATH) else None
        ),
        "cpu_extensions_needed": needed,
        "cpu_extensions_missing": (
            [ext for ext in needed if ext not in cpu_flags] if cpu_flags is not None else None
        ),
        "library_loaded": False,
        "load_error": None,
        "ops": [],
        "kernels": {},
        "cuda_kernels_registered": None,
        "physical_devices": [
            {"name": d.name, "type": d.device_type} for d in tf.config.list_physical_devices()
        ],
    }
    try:
        library = _loader.load_op_library()
    except ImportError as e:
        info["load_error"] = str(e)
        return info
    info["library_loaded"] = True
    info["ops"] = _op_names(library)
    registry_ok = True
    for op in info["ops"]:
        kernels = _registered_kernels(op)
        if kernels is None:
            registry_ok = False
            break
        info["kernels"][op[len(_OP_PREFIX) :]] = kernels
    if registry_ok:
        info["cuda_kernels_registered"] = any("GPU" in k for k in info["kernels"].values())
    return info


def _yes_no(value: Optional[bool]) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def format_text(info: Dict[str, Any]) -> str:
    """The human-readable report."""
    build = info["build"] or {}
    rows = [
        (
            "tf_ttemb",
            f"{info['tf_ttemb_version']} ({info['installed_from']}: {info['package_dir']})",
        ),
        ("python", info["python"]),
        ("TensorFlow (running)", f"{info['tf_version']} ({info['tf_path']})"),
        (
            "  its build",
            f"C++11 ABI {info['tf_cxx11_abi']}, flags {' '.join(info['tf_compile_flags'])}, "
            + (f"CUDA {info['tf_cuda_version']}" if info["tf_is_cuda_build"] else "no CUDA"),
        ),
        ("TensorFlow (built against)", build.get("tf_version", "unknown (no _build_info.json)")),
        ("  build ABI", f"C++11 ABI {build.get('cxx11_abi', '?')}"),
        ("  build compile flags", " ".join(build.get("compile_flags", [])) or "unknown"),
        (
            "  match",
            "yes" if not info["build_mismatches"] else "NO: " + "; ".join(info["build_mismatches"]),
        ),
        (
            "op library",
            f"{info['library_path']}"
            + (
                f" ({info['library_bytes'] / 2**20:.1f} MiB)"
                if info["library_bytes"]
                else " (missing)"
            ),
        ),
        ("  loaded", "yes" if info["library_loaded"] else f"no: {info['load_error']}"),
        (
            "  CPU extensions needed",
            (", ".join(info["cpu_extensions_needed"]) or "none")
            + (
                ""
                if info["cpu_extensions_missing"] is None
                else (
                    f" (this CPU lacks {', '.join(info['cpu_extensions_missing'])})"
                    if info["cpu_extensions_missing"]
                    else " (this CPU has them)"
                )
            ),
        ),
        ("  CUDA kernels (build info)", _yes_no(build.get("cuda") if build else None)),
        ("  CUDA kernels (registered)", _yes_no(info["cuda_kernels_registered"])),
        (
            "devices",
            ", ".join(f"{d['name']}" for d in info["physical_devices"]) or "none",
        ),
    ]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key.ljust(width)}  {value}" for key, value in rows]
    if info["kernels"]:
        lines += ["", "Registered kernels (op: device, kernel count, accepted dtypes):"]
        op_width = max(len(op) for op in info["kernels"])
        for op, per_device in info["kernels"].items():
            if not per_device:
                lines.append(f"  {op.ljust(op_width)}  (no kernels)")
            for i, (device, entry) in enumerate(per_device.items()):
                constraints = "; ".join(
                    f"{name}: {','.join(values)}" for name, values in entry["constraints"].items()
                )
                label = op if i == 0 else ""
                lines.append(
                    f"  {label.ljust(op_width)}  {device:<4} {entry['count']:>3}  "
                    f"{constraints or '(no type constraints)'}"
                )
    elif info["library_loaded"]:
        lines += ["", "Registered kernels: TensorFlow's kernel registry is not readable here."]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Runs the command; returns the exit status (1 when the library does not load)."""
    info = collect()
    if args.json == "-":
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_text(info))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(info, f, indent=2)
                f.write("\n")
            print(f"\nWrote {args.json}")
    return 0 if info["library_loaded"] else 1
