"""The one macro that builds a tf_ttemb op library, and its nvcc rule.

Flags are split like this:
  * C++ flags shared by every target (TensorFlow's from tf.sysconfig, -O3,
    the CPU's vector extensions) come from .bazelrc, which configure.sh
    writes; BUILD files never repeat them.
  * nvcc's own flags (language level, GPU architectures, -fPIC) are fixed
    here in _NVCC_FLAGS; nvcc also gets every -D of --copt so that both
    compilers agree on macros such as _GLIBCXX_USE_CXX11_ABI.
  * Under --config=cuda (--define=tf_ttemb_cuda=1) every C++ source of the
    library is compiled with GOOGLE_CUDA=1 and the CUDA headers, so
    `#if GOOGLE_CUDA` blocks work in any of them.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load("@local_cuda//:defs.bzl", "CUDA_CONFIGURED", "NVCC")

_CUDA_ENABLED = "//:cuda_enabled"

# Native code for the H200 we measure on (sm_90, plus PTX for newer GPUs)
# and for A100-class GPUs (sm_80).
_NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-arch=sm_90",
    "-gencode=arch=compute_80,code=sm_80",
    "-Xcompiler",
    "-fPIC",
]

def _nvcc_archive_impl(ctx):
    if not ctx.files.srcs:
        return [DefaultInfo(files = depset())]
    if not CUDA_CONFIGURED:
        fail("%s has CUDA sources but @local_cuda is not configured: build with " % ctx.label +
             "--config=cuda after running configure.sh on a machine with nvcc on PATH.")

    cc_toolchain = find_cpp_toolchain(ctx)
    defines = [flag for flag in ctx.fragments.cpp.copts if flag.startswith("-D")]
    headers = depset(ctx.files.hdrs)
    objects = []
    for src in ctx.files.srcs:
        stem = src.short_path[:-len(src.extension) - 1]
        obj = ctx.actions.declare_file("_nvcc/%s/%s.pic.o" % (ctx.label.name, stem))
        args = ctx.actions.args()
        args.add_all(_NVCC_FLAGS)
        args.add_all(defines)
        args.add_all(ctx.attr.copts)
        args.add("-ccbin", cc_toolchain.compiler_executable)
        args.add("-I.")
        args.add("-I" + ctx.bin_dir.path)
        args.add("-c", src)
        args.add("-o", obj)
        ctx.actions.run(
            executable = NVCC,
            arguments = [args],
            inputs = depset([src], transitive = [headers]),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "Compiling CUDA %s" % src.short_path,
            use_default_shell_env = True,
        )
        objects.append(obj)

    archive = ctx.actions.declare_file("lib%s.pic.a" % ctx.label.name)
    ctx.actions.run(
        executable = cc_toolchain.ar_executable,
        arguments = ["rcs", archive.path] + [obj.path for obj in objects],
        inputs = objects,
        outputs = [archive],
        mnemonic = "NvccArchive",
        progress_message = "Archiving CUDA objects of %s" % ctx.label,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([archive]))]

# Compiles .cu files with nvcc into one position-independent static archive.
_nvcc_archive = rule(
    implementation = _nvcc_archive_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = True),
        "copts": attr.string_list(),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
)

def tf_ttemb_op_library(
        name,
        srcs,
        hdrs = [],
        gpu_srcs = [],
        cuda_srcs = [],
        cuda_hdrs = [],
        deps = [],
        copts = [],
        nvcc_copts = [],
        visibility = None):
    """Builds a TensorFlow op library (a shared object for tf.load_op_library).

    Args:
      name: name of the shared object, e.g. "_tf_ttemb_ops.so".
      srcs: C++ sources of the CPU build: op registrations and CPU kernels.
      hdrs: C++ headers used by srcs and gpu_srcs.
      gpu_srcs: C++ GPU OpKernel glue (TensorFlow headers allowed), compiled
        only under --config=cuda.
      cuda_srcs: .cu files compiled by nvcc under --config=cuda; they must not
        include TensorFlow headers.
      cuda_hdrs: headers of cuda_srcs (launcher declarations) that the glue
        includes too.
      deps: further cc_library dependencies.
      copts: extra C++ options for this library only.
      nvcc_copts: extra nvcc options for this library only.
      visibility: visibility of the shared object.
    """
    base = name[:-len(".so")] if name.endswith(".so") else name
    cuda = str(Label(_CUDA_ENABLED))

    # cuda_srcs is a plain list (a glob), so an empty one is known here; a
    # cc_library must not list a rule that produces no files in its srcs.
    cuda_objects = []
    if cuda_srcs:
        _nvcc_archive(
            name = base + "_cuda_objects",
            srcs = select({cuda: cuda_srcs, "//conditions:default": []}),
            hdrs = cuda_hdrs,
            copts = nvcc_copts,
        )
        cuda_objects = [":" + base + "_cuda_objects"]

    # The nvcc archive, the runtime, and the launcher headers for the glue
    # (textual_hdrs: cc rules take no .cuh in srcs or hdrs).
    native.cc_library(
        name = base + "_cuda",
        srcs = select({cuda: cuda_objects, "//conditions:default": []}),
        textual_hdrs = select({cuda: cuda_hdrs, "//conditions:default": []}),
        linkstatic = 1,
        deps = select({
            cuda: ["@local_cuda//:cuda_headers", "@local_cuda//:cudart_static"],
            "//conditions:default": [],
        }),
    )

    native.cc_binary(
        name = name,
        srcs = srcs + hdrs + select({cuda: gpu_srcs, "//conditions:default": []}),
        copts = copts,
        local_defines = select({cuda: ["GOOGLE_CUDA=1"], "//conditions:default": []}),
        linkshared = 1,
        deps = deps + [
            "@local_tf//:libtensorflow_framework",
            "@local_tf//:tf_headers",
        ] + select({cuda: [":" + base + "_cuda"], "//conditions:default": []}),
        visibility = visibility,
    )
