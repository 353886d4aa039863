"""Redis servers and clusters for tests and tools: not imported by the core."""
