"""The kubelet's own gRPC APIs (device plugin v1beta1, pod resources v1),
generated from third_party/proto/k8s/ by `pip install .` / `pip install -e .`
(setup.py build_proto); the modules are not in git."""
