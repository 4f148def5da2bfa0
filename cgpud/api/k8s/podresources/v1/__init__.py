"""v1: api_pb2 and api_pb2_grpc generated from third_party/proto/k8s/podresources/v1/api.proto."""
