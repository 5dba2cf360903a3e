"""Writes the tf_ttemb platform wheel from a built op library and the package's files.

Usually run for you, by `bash build_wheel.sh` (through Bazel's `//:wheel` target). It can
also be run directly on an op library that `bash configure.sh` has already built, with
any Python 3.8+ (standard library only; TensorFlow is not imported):

  python3 python/tools/build_wheel.py --out-dir dist
  python3 python/tools/build_wheel.py --library bazel-bin/_tf_ttemb_ops.so \\
      --build-info tf_ttemb/_build_info.json --out dist/tf_ttemb-0.1.0-py3-none-linux_x86_64.whl \\
      tf_ttemb/__init__.py tf_ttemb/ops/_loader.py ...

The wheel (`tf_ttemb-<version>-py3-none-linux_<machine>.whl`) holds the package's Python
files, the op library as `tf_ttemb/_tf_ttemb_ops.so` and `tf_ttemb/_build_info.json`
(which the import-time ABI check reads). Its tags:

* `linux_<machine>` from the library's ELF header. Not `manylinux_*`: the library is not
  audited against a manylinux policy (it needs the glibc and libstdc++ of the build
  machine, and the CPU extensions of its compile flags).
* `py3-none`: the library links no Python (it is opened by `tf.load_op_library` and binds
  only to `libtensorflow_framework.so.2`); what it depends on is the TensorFlow build,
  pinned exactly by `Requires-Dist: tensorflow==<the version built against>` (TensorFlow
  keeps no C++ ABI across releases) and checked again at import against the build's
  C++11 ABI flag and compile flags. `Requires-Python: >=3.10` is the package's own floor.

Other dependencies: numpy and keras (imported by the package; both are TensorFlow
dependencies too), and matplotlib as the `demo` extra (`pip install
'tf_ttemb-....whl[demo]'`) for the demo's plots.

The archive is reproducible: entries sorted, timestamps from SOURCE_DATE_EPOCH (default
1980-01-01), fixed permissions.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import struct
import sys
import time
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

NAME = "tf_ttemb"
SUMMARY = (
    "Fused EmbeddingBag, Tensor-Train embedding bags and Product-Key Memory: TensorFlow "
    "custom ops (CPU and CUDA) and Keras 3 layers"
)
REQUIRES_PYTHON = ">=3.10"
# Besides tensorflow (pinned from the build info): what the package itself imports.
REQUIRES = ["numpy", "keras>=3"]
EXTRAS = {"demo": ["matplotlib"]}
CONSOLE_SCRIPTS = {"tf-ttemb": "tf_ttemb.__main__:main"}
LIBRARY_NAME = "_tf_ttemb_ops.so"
BUILD_INFO_NAME = "_build_info.json"

_ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
_CUDA_MARKER = b"__cudaRegisterFatBinary"


class WheelError(Exception):
    """Inputs that cannot make a correct wheel."""


def package_version(package_dir: str) -> str:
    """`__version__` of the package, read from its `__init__.py` without importing it."""
    path = os.path.join(package_dir, "__init__.py")
    with open(path, encoding="utf-8") as f:
        match = re.search(r'^__version__\s*=\s*"([^"]+)"', f.read(), re.M)
    if not match:
        raise WheelError(f'no __version__ = "..." line in {path}')
    return match.group(1)


def elf_machine(library: str) -> str:
    """The machine an ELF shared object is built for (x86_64, aarch64)."""
    with open(library, "rb") as f:
        header = f.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        raise WheelError(f"{library} is not an ELF file")
    endian = "<" if header[5] == 1 else ">"
    (machine,) = struct.unpack(endian + "H", header[18:20])
    if machine not in _ELF_MACHINES:
        raise WheelError(f"{library}: unsupported ELF machine {machine}")
    return _ELF_MACHINES[machine]


def read_build_info(path: str, library: str) -> dict:
    """The build info, checked for the fields the wheel needs and against the library."""
    if not os.path.exists(path):
        raise WheelError(f"{path} does not exist: run `bash configure.sh` first (it writes it)")
    with open(path, encoding="utf-8") as f:
        info = json.load(f)
    for key in ("tf_version", "cxx11_abi", "cuda", "compile_flags"):
        if key not in info:
            raise WheelError(f"{path} has no {key!r}: re-run `bash configure.sh`")
    if not re.fullmatch(r"\d+\.\d+\.\d+\S*", str(info["tf_version"])):
        raise WheelError(f"{path}: tf_version {info['tf_version']!r} is not a version")
    with open(library, "rb") as f:
        has_cuda = _CUDA_MARKER in f.read()
    if has_cuda != bool(info["cuda"]):
        raise WheelError(
            f"{path} says cuda={str(bool(info['cuda'])).lower()}, but {library} "
            f"{'has' if has_cuda else 'has no'} CUDA kernels: the library and the build info "
            "come from different builds (re-run `bash configure.sh`; build //:wheel with "
            "--config=cuda exactly when the build info says cuda=true)"
        )
    return info


def package_files(package_dir: str, files: Sequence[str]) -> Dict[str, str]:
    """Archive name -> path of the package's Python files (given, or found under the dir)."""
    if not files:
        found = []
        for dirpath, dirnames, filenames in os.walk(package_dir):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            found += [os.path.join(dirpath, n) for n in filenames if n.endswith(".py")]
        files = found
    root = os.path.abspath(package_dir)
    members = {}
    for path in files:
        rel = os.path.relpath(os.path.abspath(path), root)
        if rel.startswith(os.pardir) or not path.endswith(".py"):
            raise WheelError(f"{path} is not a Python file under {package_dir}")
        members[NAME + "/" + rel.replace(os.sep, "/")] = path
    if NAME + "/__init__.py" not in members:
        raise WheelError(f"no {package_dir}/__init__.py among the package files")
    return members


def wheel_name(version: str, machine: str) -> Tuple[str, str]:
    """(file name, tag) of the wheel."""
    tag = f"py3-none-linux_{machine}"
    return f"{NAME}-{version}-{tag}.whl", tag


def metadata(version: str, info: dict, machine: str) -> str:
    """The METADATA file (core metadata 2.1)."""
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {NAME}",
        f"Version: {version}",
        f"Summary: {SUMMARY}",
        "Platform: linux",
        f"Requires-Python: {REQUIRES_PYTHON}",
        f"Requires-Dist: tensorflow=={info['tf_version']}",
    ]
    lines += [f"Requires-Dist: {req}" for req in REQUIRES]
    for extra, reqs in EXTRAS.items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {req}; extra == "{extra}"' for req in reqs]
    lines.append("Description-Content-Type: text/markdown")
    cpu = [f[2:] for f in info["compile_flags"] if f.startswith("-m")]
    build = (
        f"This wheel was built against TensorFlow {info['tf_version']} (C++11 ABI flag "
        f"{info['cxx11_abi']}) for linux {machine}, "
        f"{'with' if info['cuda'] else 'without'} CUDA kernels, compiled with "
        f"`{' '.join(info['compile_flags'])}`. "
        + (f"It needs a CPU with {', '.join(cpu)}. " if cpu else "")
        + "`import tf_ttemb` refuses a TensorFlow of another version or ABI with an "
        "ImportError naming both versions."
    )
    body = f"""
# tf_ttemb {version}

{SUMMARY}.

{build}

    python -m tf_ttemb info     # versions, build flags, registered kernels
    python -m tf_ttemb bench    # the op benchmarks on this machine
    python -m tf_ttemb demo     # what the ops buy, measured (plots need the [demo] extra)
"""
    return "\n".join(lines) + "\n" + body


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def write_wheel(
    out_path: str, members: Dict[str, bytes], executables: Sequence[str], dist_info: str
) -> None:
    """Writes the zip with RECORD last; `members` maps archive names to contents."""
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
    stamp = time.gmtime(max(epoch, 315532800))[:6]
    record_name = f"{dist_info}/RECORD"
    record_lines = [f"{name},{_record_hash(data)},{len(data)}" for name, data in members.items()]
    record_lines.append(f"{record_name},,")
    entries = list(members.items()) + [(record_name, ("\n".join(record_lines) + "\n").encode())]
    tmp_path = out_path + ".tmp"
    with zipfile.ZipFile(tmp_path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            zinfo = zipfile.ZipInfo(name, date_time=stamp)
            mode = 0o755 if name in executables else 0o644
            zinfo.external_attr = (0o100000 | mode) << 16
            zinfo.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zinfo, data, compresslevel=6)
    os.replace(tmp_path, out_path)


def build(
    library: str,
    build_info_path: str,
    package_dir: str,
    files: Sequence[str],
    out: Optional[str] = None,
    out_dir: Optional[str] = None,
) -> str:
    """Builds the wheel; returns its path. Exactly one of `out`, `out_dir` is given."""
    if not os.path.exists(library):
        raise WheelError(f"{library} does not exist: run `bash configure.sh` first")
    version = package_version(package_dir)
    machine = elf_machine(library)
    info = read_build_info(build_info_path, library)
    filename, tag = wheel_name(version, machine)
    if out is not None and os.path.basename(out) != filename:
        raise WheelError(
            f"the wheel is {filename}, but the output was named {os.path.basename(out)}: "
            "update the wheel's name in BUILD (version and machine must match)"
        )
    out_path = out if out is not None else os.path.join(out_dir or ".", filename)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)

    members: Dict[str, bytes] = {}
    for name, path in sorted(package_files(package_dir, files).items()):
        if name in (f"{NAME}/{LIBRARY_NAME}", f"{NAME}/{BUILD_INFO_NAME}"):
            continue
        with open(path, "rb") as f:
            members[name] = f.read()
    with open(library, "rb") as f:
        members[f"{NAME}/{LIBRARY_NAME}"] = f.read()
    with open(build_info_path, "rb") as f:
        members[f"{NAME}/{BUILD_INFO_NAME}"] = f.read()

    dist_info = f"{NAME}-{version}.dist-info"
    members[f"{dist_info}/METADATA"] = metadata(version, info, machine).encode()
    members[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: tf_ttemb python/tools/build_wheel.py\n"
        f"Root-Is-Purelib: false\nTag: {tag}\n"
    ).encode()
    members[f"{dist_info}/top_level.txt"] = f"{NAME}\n".encode()
    scripts = "".join(f"{name} = {target}\n" for name, target in CONSOLE_SCRIPTS.items())
    members[f"{dist_info}/entry_points.txt"] = f"[console_scripts]\n{scripts}".encode()
    write_wheel(out_path, members, [f"{NAME}/{LIBRARY_NAME}"], dist_info)
    return out_path


def main(argv: Optional[List[str]] = None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser = argparse.ArgumentParser(
        description="Writes the tf_ttemb platform wheel from a built op library.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Defaults are the checkout's tf_ttemb/ (as `bash configure.sh` leaves it).",
    )
    parser.add_argument(
        "--library",
        default=os.path.join(here, NAME, LIBRARY_NAME),
        help="the op library to ship (default: tf_ttemb/_tf_ttemb_ops.so)",
    )
    parser.add_argument(
        "--build-info",
        default=os.path.join(here, NAME, BUILD_INFO_NAME),
        help="its build info (default: tf_ttemb/_build_info.json)",
    )
    parser.add_argument(
        "--package-dir",
        default=os.path.join(here, NAME),
        help="the tf_ttemb package directory (default: the checkout's)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="the wheel's path; its name must be the wheel's name")
    where.add_argument("--out-dir", help="directory to write the wheel into (default: dist)")
    parser.add_argument(
        "files",
        nargs="*",
        help="the package's Python files (default: every *.py under --package-dir)",
    )
    args = parser.parse_args(argv)
    if args.out is None and args.out_dir is None:
        args.out_dir = os.path.join(here, "dist")
    try:
        path = build(
            args.library, args.build_info, args.package_dir, args.files, args.out, args.out_dir
        )
    except WheelError as e:
        print(f"build_wheel: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
