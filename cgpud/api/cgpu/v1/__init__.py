"""cgpu.v1: local_pb2 and local_pb2_grpc are generated here from
proto/cgpu/v1/local.proto by `pip install .` / `pip install -e .`
(setup.py build_proto); they are not in git."""
