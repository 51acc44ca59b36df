"""Generated code of ``hivepath.peer.v1``; regenerate with ``python -m protos.generate``."""
