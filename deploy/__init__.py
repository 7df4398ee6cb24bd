"""kvpush deploy."""
