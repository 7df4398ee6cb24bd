"""What a topology's `tracing:` section adds to each vLLM instance's launch: vLLM's own per-request
OpenTelemetry spans (`--otlp-traces-endpoint`), named so that a receiver can tell the instances apart.

vLLM's API server sends one `llm_request` span per finished request; the OpenTelemetry SDK adds the
resource attributes below from the environment (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) to
every span the instance exports. Those names are the contract with whoever reads the spans
(`kvpush bench` joins a request's prefill and decode spans by them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.deploy.topology.topology import InstanceSpec, Role, Topology

TRACES_FLAG = "--otlp-traces-endpoint"
INSTANCE_ATTRIBUTE = "service.name"  # the instance's name (prefill-0, decode-0, ...)
DEPLOYMENT_ATTRIBUTE = "kvpush.deployment"
ROLE_ATTRIBUTE = "kvpush.role"  # prefill | decode


def tracing_argv(topo: Topology) -> list[str]:
    return [] if topo.tracing is None else [TRACES_FLAG, topo.tracing.otlp_endpoint]


def tracing_env(topo: Topology, role: Role, spec: InstanceSpec) -> dict[str, str]:
    tracing = topo.tracing
    if tracing is None:
        return {}
    return {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": tracing.protocol,
        # the SDK's batch processor exports every this many ms (its default is 5 s)
        "OTEL_BSP_SCHEDULE_DELAY": str(tracing.export_delay_ms),
        "OTEL_SERVICE_NAME": str(spec.name),
        # names and roles are plain names ([a-z0-9-]): nothing here needs the format's escaping
        "OTEL_RESOURCE_ATTRIBUTES": f"{DEPLOYMENT_ATTRIBUTE}={topo.name},{ROLE_ATTRIBUTE}={role}",
    }
