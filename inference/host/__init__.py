"""This machine: CPU features and the kernel choice, thread counts, the heap, pinning, locked
memory and the GC policy. Nothing here knows of models or requests."""
