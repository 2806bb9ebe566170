"""Core data structures: dtypes, devices, proxies, symbols, traces and code generation."""
