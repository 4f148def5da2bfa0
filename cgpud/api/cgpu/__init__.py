"""Generated protobuf packages, laid out as proto/ is (cgpu/v1/...)."""
