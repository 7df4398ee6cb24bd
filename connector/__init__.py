"""kvpush connector."""
