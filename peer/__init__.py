"""The volunteer node: DHT membership, the DiLoCo outer-step wrapper, compressed averaging,
checkpoints and stage serving. Submodules are imported where needed, so importing ``peer``
alone pulls in neither torch nor hivemind."""

__all__: list[str] = []
