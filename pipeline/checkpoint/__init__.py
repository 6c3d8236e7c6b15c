"""The checkpoint format, its background writer, safe reading of DCP files, the run directory's layout and its lock."""
