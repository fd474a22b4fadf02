"""HTTP engines as a backend: client, dialects, capture, workloads, layout probe, P/D, the server pool."""
