"""Generated from third_party/proto/k8s/podresources/ (setup.py build_proto); not in git."""
