"""The coordinator service: admission, leases, work assignment, persisted state, status.

It imports neither torch nor hivemind, and never touches weights or gradients."""

__all__: list[str] = []
