"""deskchat's own decode step in C, built on the PC it runs on (docs/native.md)."""
