"""Generated protobuf packages mirroring the proto package hivepath.coordinator.v1."""
