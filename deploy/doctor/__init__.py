"""`kvpush doctor`: checks on every host of a topology before anything launches.

Public surface: run_doctor (all selected checks), fast_checks (what `up` runs first),
DoctorOptions, DoctorReport, CHECK_NAMES, and the CommandRunner protocol a host runner satisfies.
"""
from .engine import (
    CHECK_NAMES,
    FAST_CHECKS,
    PROBE_CHECK,
    DoctorOptions,
    DoctorReport,
    fast_checks,
    run_doctor,
    select_checks,
)
from .probes import CommandRunner
from .result import CheckResult, Evidence, Status

__all__ = [
    "CHECK_NAMES", "FAST_CHECKS", "PROBE_CHECK", "CheckResult", "CommandRunner", "DoctorOptions", "DoctorReport",
    "Evidence", "Status", "fast_checks", "run_doctor", "select_checks",
]
