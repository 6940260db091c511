"""The one error both plugins raise for a configuration Foundry cannot restore correctly."""

from __future__ import annotations

from ..config import ConfigError


class FoundryUnsupportedError(ConfigError):
    """An engine configuration Foundry refuses at startup, before any GPU work (fail closed).

    ``str(err)`` is one line naming every reason: ``Foundry cannot run this <engine> configuration:
    <reason>; <reason>``. ``reasons`` holds them one by one.
    """

    def __init__(self, engine: str, reasons: list[str]):
        self.engine = engine
        self.reasons = list(reasons)
        super().__init__(f"Foundry cannot run this {engine} configuration: " + "; ".join(self.reasons))
