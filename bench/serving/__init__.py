"""The server as clients and its worker feel it: HTTP, latency, batching, soak, GC."""
