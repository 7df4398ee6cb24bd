"""Doctor's parsers on recorded (this machine) and modeled (documented format) tool outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.deploy.doctor.parsers import (ParseError, fi_info_error, parse_df, parse_fi_info, parse_ibv_devices,
                                          parse_ls_lines, parse_meminfo, parse_nvidia_apps, parse_nvidia_gpus,
                                          parse_nvidia_topo, parse_proc_modules, parse_ucx_tls, parse_ulimit)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "doctor"


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_ulimit_recorded_numbers_and_unlimited():
    assert parse_ulimit(recorded("ulimit_l")["stdout"]) == 8192
    assert parse_ulimit(recorded("ulimit_hn")["stdout"]) > 0
    assert parse_ulimit("unlimited\n") is None
    with pytest.raises(ParseError, match="expected a number"):
        parse_ulimit("sh: ulimit: bad option\n")


def test_meminfo_and_df_recorded():
    info = parse_meminfo(recorded("meminfo")["stdout"])
    assert info["MemTotal"] >= info["MemAvailable"] > 0
    rows = parse_df(recorded("df")["stdout"])
    assert rows[0].mount == "/" and rows[0].available_bytes > 0
    with pytest.raises(ParseError):
        parse_df("df: /nope: No such file or directory\n")


def test_fi_info_success_lists_every_efa_device():
    providers = parse_fi_info(text("fi_info_efa_p5en.txt"))
    assert len(providers) == 16
    assert {p.provider for p in providers} == {"efa"}
    assert providers[0].domain == "rdmap79s0-rdm" and providers[0].fabric == "efa"


def test_fi_info_failures_have_no_providers_and_name_the_error():
    enodata = recorded("fi_info_efa_enodata")
    assert parse_fi_info(enodata["stdout"]) == []
    assert fi_info_error(enodata["stdout"], enodata["stderr"]) == "fi_getinfo: -61"
    missing = recorded("fi_info_efa_missing")
    assert missing["rc"] == 127 and parse_fi_info(missing["stdout"]) == []


def test_ibv_devices_table_and_failure_text():
    assert parse_ibv_devices(text("ibv_devices_p5en.txt"))[:2] == ["rdmap79s0", "rdmap80s0"]
    assert len(parse_ibv_devices(text("ibv_devices_p5en.txt"))) == 16
    failure = recorded("ibv_devices_enosys")
    assert parse_ibv_devices(failure["stdout"] + failure["stderr"]) == []


def test_infiniband_listing_absent_here():
    absent = recorded("infiniband_absent")
    assert absent["rc"] != 0 and "No such file" in absent["stderr"]
    assert parse_ls_lines(absent["stdout"]) == []


def test_nvidia_smi_queries():
    gpus = parse_nvidia_gpus(text("nvidia_gpus_p5en.txt"))
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[0].name == "NVIDIA H200" and gpus[0].memory_total_mib == 143771
    busy = parse_nvidia_apps(text("nvidia_apps_busy.txt"))
    assert busy[0].pid == 48211 and busy[0].used_mib == 70312 and busy[0].gpu_uuid == gpus[2].uuid
    assert parse_nvidia_apps(text("nvidia_apps_idle.txt")) == []
    with pytest.raises(ParseError):
        parse_nvidia_gpus("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")


def test_nvidia_topo_matrix_nearest_nic_and_affinity():
    matrix = parse_nvidia_topo(text("nvidia_topo_p5en.txt"))
    assert matrix.nics()[:2] == ["NIC0", "NIC1"] and len(matrix.nics()) == 16
    assert matrix.nearest_nic("GPU0") == ("NIC0", "PXB")
    assert matrix.nearest_nic("GPU5") == ("NIC10", "PXB")
    assert matrix.links["GPU0"]["NIC8"] == "SYS"
    assert matrix.numa_affinity["GPU4"] == "1" and matrix.cpu_affinity["GPU0"] == "0-47,96-143"
    assert matrix.nic_names["NIC0"] == "rdmap79s0"
    with pytest.raises(ParseError):
        parse_nvidia_topo(recorded("nvidia_smi_missing")["stderr"])


def test_nvidia_topo_recorded_on_an_h200_host_with_ansi_header():
    matrix = parse_nvidia_topo(recorded("h200_nvidia_topo")["stdout"])
    assert matrix.columns == ["GPU0"] and matrix.nics() == [] and matrix.nearest_nic("GPU0") is None
    assert matrix.cpu_affinity["GPU0"] == "0-15" and matrix.numa_affinity["GPU0"] == "0"
    gpus = parse_nvidia_gpus(recorded("h200_nvidia_gpus")["stdout"])
    assert [(g.index, g.name, g.memory_total_mib) for g in gpus] == [(0, "NVIDIA H200", 143771)]
    assert parse_nvidia_apps(recorded("h200_nvidia_apps")["stdout"]) == []
    assert parse_ulimit(recorded("h200_ulimit_l")["stdout"]) is None


def test_proc_modules():
    assert parse_proc_modules("nvidia_peermem 16384 0 - Live 0x0\nefa 139264 0 - Live 0x0\n") == {"nvidia_peermem", "efa"}


@pytest.mark.parametrize("value, transport, allowed", [
    ("tcp", "tcp", True), ("tcp", "cuda_copy", False), ("^tcp", "tcp", False), ("^tcp", "cuda_ipc", True),
    ("cuda,tcp", "cuda_ipc", True), ("all", "shm", True), ("self,sm", "shm", True),
])
def test_ucx_tls_allows(value, transport, allowed):
    assert parse_ucx_tls(value).allows(transport) is allowed


def test_ucx_tls_unset_is_none():
    assert parse_ucx_tls(None) is None
