"""Offline stand-in for @rules_java//java:defs.bzl, for Bazel 4.2.3 only.

This project builds no Java, but @bazel_tools loads this file from packages
that Bazel may evaluate (for example the JDK toolchain definitions), and the
WORKSPACE suffix of Bazel 4.2.3 would download rules_java to serve it.
configure.sh points @rules_java here with --override_repository. Each symbol
forwards to the native rule of the same name.
"""

def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_library(**kwargs):
    native.java_library(**kwargs)

def java_lite_proto_library(**kwargs):
    native.java_lite_proto_library(**kwargs)

def java_package_configuration(**kwargs):
    native.java_package_configuration(**kwargs)

def java_plugin(**kwargs):
    native.java_plugin(**kwargs)

def java_proto_library(**kwargs):
    native.java_proto_library(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_test(**kwargs):
    native.java_test(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
