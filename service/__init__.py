"""What web/ and inference/ share: the settings, the cpulist format and the error kinds. It
imports neither."""
