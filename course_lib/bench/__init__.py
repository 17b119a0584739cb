"""Benchmarks, one module per ``python -m course_lib bench <name>``; each measures the course's
code side by side with the native implementation in one run and prints the machine's ceiling.
What they share (sizes, lists, tables, CSV) is in :mod:`.common`."""
