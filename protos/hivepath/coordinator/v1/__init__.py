"""Generated code of ``hivepath.coordinator.v1``; regenerate with ``python -m protos.generate``."""
