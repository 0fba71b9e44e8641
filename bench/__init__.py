"""deskchat's benchmark: the engine as configured against plain transformers, side by side.

`python -m bench --help`. Each side runs in its own child process (bench/compare/child.py), so peak
RSS and load time are its own; requests alternate between the two so that a noisy shared CPU
hurts both alike.
"""
