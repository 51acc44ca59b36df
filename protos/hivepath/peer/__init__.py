"""Generated protobuf packages mirroring the proto package hivepath.peer.v1."""
