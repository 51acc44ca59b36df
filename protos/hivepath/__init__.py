"""Generated protobuf packages mirroring the proto packages ``hivepath.coordinator.v1`` and ``hivepath.peer.v1``."""
