"""Serving: the worker thread and its FIFO, the engine step and its streams, jobs, sampling,
the grammar constraint, prompts and detokenizing. The model is called only from here."""
