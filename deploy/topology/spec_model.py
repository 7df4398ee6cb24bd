"""The base of every model in the topology schema: a field the file does not know, or a NaN or an
infinity, is an error; and how a field that topology_defaults fills is read once it is filled.
"""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict

DAY_S = 86_400.0  # upper bound of every timeout
SPEC_CONFIG = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)
T = TypeVar("T")


class SpecModel(BaseModel):
    model_config = SPEC_CONFIG


def defaulted(value: T | None, field: str) -> T:
    """A field that topology_defaults fills where the file leaves it out, read as filled."""
    assert value is not None, f"{field} is unset: read a topology loaded through topology_from_document"
    return value
