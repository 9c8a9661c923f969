"""Minimal @rules_java for offline Bazel 4.x: the native Java rules, re-exported.

Bazel 4 loads @rules_java//java:defs.bzl from its built-in tool BUILD files even
for a pure C++ build; the real repository would be downloaded. fthsdp builds no
Java, so forwarding to the native rules is all that is needed.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_lite_proto_library = native.java_lite_proto_library
java_package_configuration = native.java_package_configuration
java_plugin = native.java_plugin
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
