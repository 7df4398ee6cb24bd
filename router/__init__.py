"""kvpush router."""
