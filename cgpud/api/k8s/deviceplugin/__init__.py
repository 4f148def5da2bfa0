"""Generated from third_party/proto/k8s/deviceplugin/ (setup.py build_proto); not in git."""
