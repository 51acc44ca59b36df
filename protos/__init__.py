"""gRPC contracts between peers and the coordinator, with their generated (committed) stubs."""

__all__: list[str] = []
