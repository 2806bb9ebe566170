"""OpInfos: nn (being written)."""
