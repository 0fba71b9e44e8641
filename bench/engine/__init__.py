"""The engine alone in this process: int8 kernels, forward and step times, prefill."""
