"""Distributed deep learning, built from scratch and run for real: the course library."""
