"""Offline stand-in for @rules_cc//cc:defs.bzl, for Bazel 4.2.3 only.

Bazel 4.2.3's C++ rules are built into the binary; the real rules_cc of
that era only forwarded to them, and the rules_cc that Debian packages needs
a newer Bazel. The WORKSPACE suffix of Bazel 4.2.3 would download rules_cc
because @bazel_tools and @local_config_cc load this file, so configure.sh
points @rules_cc here with --override_repository. Each symbol forwards to
the native rule of the same name; nothing else is provided.
"""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def fdo_prefetch_hints(**kwargs):
    native.fdo_prefetch_hints(**kwargs)

def fdo_profile(**kwargs):
    native.fdo_profile(**kwargs)

def objc_import(**kwargs):
    native.objc_import(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)
