#!/usr/bin/env bash
# Sets up everything the package needs and builds the op library.
#
#   bash configure.sh
#
# Unattended and idempotent; a re-run with nothing changed takes seconds.
#   1. .venv (python3 -m venv) with tensorflow==2.21.*, numpy, pytest,
#      absl-py and matplotlib: only what is missing is installed.
#   2. Bazel: Debian's bazel-bootstrap (4.2.3) and bazel-platforms, plus g++,
#      from apt when no bazel is on PATH.
#   3. .bazelrc (git-ignored), regenerated from the venv's tf.sysconfig: the
#      paths read by WORKSPACE's local repository rules, TensorFlow's compile
#      flags, the CPU's vector extensions and the overrides that keep Bazel
#      offline. With nvcc on PATH it also holds `build:cuda`, used below.
#   4. bazel build //:_tf_ttemb_ops.so, copied to tf_ttemb/_tf_ttemb_ops.so,
#      with tf_ttemb/_build_info.json beside it, then a load check.
#
# Environment:
#   TF_TTEMB_NO_CUDA=1   build for CPU only even when nvcc is on PATH.
#   PYTHON=python3.x     the interpreter that creates .venv (3.10 or newer).
#
# Bazel's own output goes to .bazel-build.log; its tail is shown on failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT="$(pwd -P)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TARGET="_tf_ttemb_ops.so"
SO_DEST="$ROOT/tf_ttemb/_tf_ttemb_ops.so"
INFO_DEST="$ROOT/tf_ttemb/_build_info.json"
BAZEL_LOG="$ROOT/.bazel-build.log"
START_S=$SECONDS

say() { printf 'configure: %s\n' "$*"; }
die() { printf 'configure: error: %s\n' "$*" >&2; exit 1; }

APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null || die "need $* but apt-get is not available; install them by hand"
  [ "$(id -u)" = 0 ] || die "need $* from apt; run as root or install them first"
  export DEBIAN_FRONTEND=noninteractive
  if [ "$APT_UPDATED" = 0 ]; then
    say "apt-get update"
    apt-get update -qq
    APT_UPDATED=1
  fi
  say "apt-get install $*"
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---------------------------------------------------------------- Python ---
python_ok() {  # $1: an interpreter; true when it is Python 3.10 or newer
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null
}

if ! { [ -x "$PY" ] && python_ok "$PY"; }; then
  BASE_PY="${PYTHON:-python3}"
  if ! command -v "$BASE_PY" >/dev/null; then
    apt_install python3 python3-venv
  fi
  python_ok "$BASE_PY" || die "$BASE_PY is older than Python 3.10"
  # Debian's python3 lacks ensurepip (and so venv) without python3-venv.
  if ! "$BASE_PY" -c 'import ensurepip, venv' 2>/dev/null; then
    apt_install python3-venv
  fi
  rm -rf "$VENV"
  say "creating .venv with $("$BASE_PY" --version 2>&1)"
  "$BASE_PY" -m venv "$VENV"
fi

# Ask the package metadata, not an import: importing TensorFlow takes seconds.
MISSING="$("$PY" - <<'PY'
from importlib import metadata

wanted = [
    ("tensorflow", "tensorflow==2.21.*", lambda v: v.split(".")[:2] == ["2", "21"]),
    ("numpy", "numpy", None),
    ("pytest", "pytest", None),
    ("absl-py", "absl-py", None),
    ("matplotlib", "matplotlib", None),
    # The style checks (python/tools/check_style.sh, run by tests/test_style.py), pinned so
    # that every machine formats alike.
    ("ruff", "ruff==0.17.6", lambda v: v == "0.17.6"),
    ("clang-format", "clang-format==23.1.5", lambda v: v == "23.1.5"),
]
missing = []
for dist, spec, version_ok in wanted:
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        missing.append(spec)
        continue
    if version_ok is not None and not version_ok(version):
        missing.append(spec)
print(" ".join(missing))
PY
)"
if [ -n "$MISSING" ]; then
  read -r -a SPECS <<<"$MISSING"
  say "pip install ${SPECS[*]}"
  "$PY" -m pip install --disable-pip-version-check --progress-bar off -q "${SPECS[@]}"
else
  say "python packages: present"
fi

# ----------------------------------------------------------------- Bazel ---
if ! command -v bazel >/dev/null; then
  apt_install bazel-bootstrap bazel-platforms
fi
# Bazel's auto-configured C++ toolchain runs gcc; nvcc runs it as host compiler.
if ! command -v gcc >/dev/null || ! command -v g++ >/dev/null; then
  apt_install g++
fi
PLATFORMS=""
for dir in /usr/share/bazel/tools/platforms /usr/share/bazel/platforms; do
  if [ -f "$dir/cpu/BUILD" ]; then PLATFORMS="$dir"; break; fi
done
if [ -z "$PLATFORMS" ]; then
  apt_install bazel-platforms
  PLATFORMS=/usr/share/bazel/tools/platforms
fi

# ------------------------------------------------------------ TensorFlow ---
# tf.sysconfig needs `import tensorflow` (several seconds), so its answers are
# kept in .venv, keyed by where and which TensorFlow is installed.
# TensorFlow logs to stderr while it loads; that is shown only on failure.
PY_ERR="$(mktemp)"
trap 'rm -f "$PY_ERR"' EXIT
if ! SYSCONFIG="$("$PY" - "$VENV/.tf_ttemb_sysconfig.json" 2>"$PY_ERR" <<'PY'
import json
import os
import shlex
import sys
from importlib import metadata

cache_path = sys.argv[1]
dist = metadata.distribution("tensorflow")
record = os.path.join(str(dist.locate_file("")), "tensorflow", "__init__.py")
key = [dist.version, record, os.stat(record).st_mtime_ns]

try:
    with open(cache_path) as f:
        cached = json.load(f)
except (OSError, ValueError):
    cached = {}

if cached.get("key") != key:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    libdir, libname = tf.sysconfig.get_lib(), "libtensorflow_framework.so.2"
    for flag in tf.sysconfig.get_link_flags():
        if flag.startswith("-L"):
            libdir = flag[2:]
        elif flag.startswith("-l:"):
            libname = flag[3:]
    cached = {
        "key": key,
        "version": tf.__version__,
        "include": tf.sysconfig.get_include(),
        "libdir": libdir,
        "libname": libname,
        "cflags": [f for f in tf.sysconfig.get_compile_flags() if not f.startswith("-I")],
        "cxx11_abi": int(tf.sysconfig.CXX11_ABI_FLAG),
    }
    with open(cache_path, "w") as f:
        json.dump(cached, f)

print("TF_VERSION=" + shlex.quote(cached["version"]))
print("TF_INCLUDE=" + shlex.quote(cached["include"]))
print("TF_LIBDIR=" + shlex.quote(cached["libdir"]))
print("TF_LIBNAME=" + shlex.quote(cached["libname"]))
print("TF_CXX11_ABI=" + str(cached["cxx11_abi"]))
print("TF_CFLAGS=(" + " ".join(shlex.quote(f) for f in cached["cflags"]) + ")")
PY
)"; then
  cat "$PY_ERR" >&2
  die "could not read tf.sysconfig from .venv's TensorFlow"
fi
eval "$SYSCONFIG"
say "tensorflow $TF_VERSION (cxx11 abi $TF_CXX11_ABI)"

# C++ flags for every target: TensorFlow's, -O3, and the vector extensions
# this CPU has (all three or none: the kernels expect them together).
CXXFLAGS_ALL=("${TF_CFLAGS[@]}" -O3)
CPU_FLAGS="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
if [[ " $CPU_FLAGS " == *" avx2 "* && " $CPU_FLAGS " == *" fma "* && " $CPU_FLAGS " == *" f16c "* ]]; then
  CXXFLAGS_ALL+=(-mavx2 -mfma -mf16c)
fi

# ------------------------------------------------------------------ CUDA ---
CUDA=0
NVCC=""
CUDA_INC=""
CUDA_LIB=""
if [ "${TF_TTEMB_NO_CUDA:-0}" = 1 ]; then
  say "cuda: off (TF_TTEMB_NO_CUDA=1)"
elif ! NVCC="$(command -v nvcc)"; then
  NVCC=""
  say "cuda: off (no nvcc on PATH)"
else
  # nvcc may be a wrapper script; its dry run names the real toolkit dirs.
  DRYRUN="$("$NVCC" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 || true)"
  TOP="$(sed -n 's/^#\$ TOP=//p' <<<"$DRYRUN" | head -n1)"
  CUDA_INC="$(sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' <<<"$DRYRUN" | head -n1)"
  [ -n "$CUDA_INC" ] || CUDA_INC="$TOP/../include"
  for dir in $(grep -o '"-L[^"]*"' <<<"$DRYRUN" | tr -d '"' | sed 's/^-L//') "$TOP/../lib64" "$TOP/../lib"; do
    if [ -f "$dir/libcudart_static.a" ]; then CUDA_LIB="$dir"; break; fi
  done
  if [ -d "$CUDA_INC" ] && [ -f "$CUDA_INC/cuda_runtime.h" ] && [ -n "$CUDA_LIB" ]; then
    CUDA=1
    CUDA_INC="$(cd "$CUDA_INC" && pwd -P)"
    CUDA_LIB="$(cd "$CUDA_LIB" && pwd -P)"
    NVCC_RELEASE="$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
    say "cuda: on (nvcc $NVCC_RELEASE at $NVCC)"
  else
    say "cuda: off (nvcc at $NVCC, but no cuda_runtime.h or libcudart_static.a found)"
    NVCC=""
  fi
fi

# -------------------------------------------------------------- .bazelrc ---
# Flags that decide which repositories exist and where they come from. They
# are given to `build` (and so to test, run, cquery, ...) and repeated for
# query, fetch and sync, which do not inherit from build.
REPO_FLAGS=(
  "--override_repository=rules_cc=$ROOT/third_party/rules_cc"
  "--override_repository=rules_java=$ROOT/third_party/rules_java"
  "--override_repository=platforms=$PLATFORMS"
  "--experimental_repository_disable_download"
  "--repo_env=TF_TTEMB_TF_INCLUDE=$TF_INCLUDE"
  "--repo_env=TF_TTEMB_TF_LIBDIR=$TF_LIBDIR"
  "--repo_env=TF_TTEMB_TF_LIBNAME=$TF_LIBNAME"
)
NEW_RC="$(mktemp)"
trap 'rm -f "$PY_ERR" "$NEW_RC"' EXIT
{
  echo "# Generated by configure.sh; re-run it instead of editing this file."
  echo
  echo "# Offline: Bazel 4.2.3 would download rules_cc, rules_java and platforms;"
  echo "# local copies replace them and any other download is an error."
  echo "# The pip TensorFlow $TF_VERSION is read by third_party/tf/tf_configure.bzl."
  for flag in "${REPO_FLAGS[@]}"; do echo "build $flag"; done
  for cmd in query fetch sync; do echo "$cmd ${REPO_FLAGS[*]}"; done
  echo
  echo "# C++ flags: tf.sysconfig.get_compile_flags() and this machine's CPU."
  echo "build --compilation_mode=opt"
  for flag in "${CXXFLAGS_ALL[@]}"; do
    case "$flag" in
      -std=* | --std=*) echo "build --cxxopt=$flag" ;;
      *) echo "build --copt=$flag" ;;
    esac
  done
  echo
  echo "# Execution: a fixed action PATH and a disk cache shared by all checkouts."
  echo "build --jobs=2"
  echo "build --incompatible_strict_action_env"
  echo "build --disk_cache=$HOME/.cache/tf_ttemb/bazel-disk-cache"
  echo "build --nosandbox_debug"
  if [ "$CUDA" = 1 ]; then
    echo
    echo "# CUDA (nvcc $NVCC_RELEASE): bazel build --config=cuda //:$TARGET"
    echo "build:cuda --define=tf_ttemb_cuda=1"
    echo "build:cuda --repo_env=TF_TTEMB_NVCC=$NVCC"
    echo "build:cuda --repo_env=TF_TTEMB_CUDA_INC=$CUDA_INC"
    echo "build:cuda --repo_env=TF_TTEMB_CUDA_LIB=$CUDA_LIB"
  fi
} >"$NEW_RC"
if ! cmp -s "$NEW_RC" "$ROOT/.bazelrc"; then
  cp "$NEW_RC" "$ROOT/.bazelrc"
  say "wrote .bazelrc"
fi

# ----------------------------------------------------------------- build ---
BAZEL_ARGS=(build)
[ "$CUDA" = 1 ] && BAZEL_ARGS+=(--config=cuda)
BAZEL_ARGS+=("//:$TARGET")
say "bazel ${BAZEL_ARGS[*]} (a first build takes minutes; log: .bazel-build.log)"
BUILD_START_S=$SECONDS
if ! bazel "${BAZEL_ARGS[@]}" >"$BAZEL_LOG" 2>&1; then
  tail -n 40 "$BAZEL_LOG" >&2
  die "bazel build failed; full log in .bazel-build.log"
fi
say "bazel: done in $((SECONDS - BUILD_START_S)) s"

BUILT="$ROOT/bazel-bin/$TARGET"
[ -f "$BUILT" ] || die "bazel reported success but $BUILT is missing"
if cmp -s "$BUILT" "$SO_DEST"; then
  say "tf_ttemb/$TARGET: unchanged"
else
  # Replace the file rather than overwrite it: a running process may map it.
  cp "$BUILT" "$SO_DEST.tmp"
  chmod 0755 "$SO_DEST.tmp"
  mv -f "$SO_DEST.tmp" "$SO_DEST"
  say "tf_ttemb/$TARGET: updated; checking that TensorFlow loads it"
  if ! TF_CPP_MIN_LOG_LEVEL=2 "$PY" -c "import tensorflow as tf; m = tf.load_op_library('tf_ttemb/_tf_ttemb_ops.so'); print([n for n in dir(m) if 'gather' in n])" 2>"$PY_ERR"; then
    cat "$PY_ERR" >&2
    rm -f "$SO_DEST"
    die "TensorFlow $TF_VERSION could not load tf_ttemb/$TARGET"
  fi
fi

# ------------------------------------------------------------ build info ---
CUDA_JSON=false
COMPILE_FLAGS=("${CXXFLAGS_ALL[@]}")
if [ "$CUDA" = 1 ]; then
  CUDA_JSON=true
  COMPILE_FLAGS+=(-DGOOGLE_CUDA=1)
fi
"$PY" - "$INFO_DEST" "$TF_VERSION" "$TF_CXX11_ABI" "$CUDA_JSON" "${COMPILE_FLAGS[@]}" <<'PY'
import json
import sys

path, version, abi, cuda, *flags = sys.argv[1:]
info = {"tf_version": version, "cxx11_abi": int(abi), "cuda": cuda == "true", "compile_flags": flags}
text = json.dumps(info, indent=2) + "\n"
try:
    with open(path) as f:
        unchanged = f.read() == text
except OSError:
    unchanged = False
if not unchanged:
    with open(path, "w") as f:
        f.write(text)
PY

say "done in $((SECONDS - START_S)) s (cuda: $([ "$CUDA" = 1 ] && echo on || echo off))"
