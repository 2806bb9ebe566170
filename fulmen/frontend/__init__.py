"""Entry points: ``fulmen.jit`` (tracing, caching, the module wrapper) and the torch.compile backend."""
