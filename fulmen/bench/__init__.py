"""Built-in models and the benchmark runner behind ``fulmen bench``, ``fulmen examine`` and ``fulmen demo``.

``fulmen.bench.models`` holds the models (``build("gpt-small")``); ``fulmen.bench.runner`` measures them;
``fulmen.bench.cli`` is the command line. Importing this package imports none of them.
"""
