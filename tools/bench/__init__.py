"""The benchmarks: ``state`` (control plane, Redis) and ``transfer`` (data plane, UCX)."""
