"""Settings from vLLM's kv_transfer_config, and start-up refusals with a clear message."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.connector.settings import Settings, UnsupportedDeployment


def vllm_config(role="kv_consumer", extra=None, use_mla=False, dp=1, pp=1):
    kv = SimpleNamespace(kv_role=role, engine_id="dep.decode-0", kv_buffer_device="cpu",
                         kv_connector_extra_config={"side_channel_host": "127.0.0.1", "side_channel_port": 9,
                                                    "allowed_engines": ["dep.prefill-0"],
                                                    "secret_file": "/run/dep/deployment.secret", **(extra or {})})
    return SimpleNamespace(kv_transfer_config=kv, model_config=SimpleNamespace(model="/m", use_mla=use_mla,
                                                                                     get_total_num_kv_heads=lambda: 8),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_size=dp, pipeline_parallel_size=pp),
                           cache_config=SimpleNamespace(block_size=128))


def test_settings_from_config():
    s = Settings.from_vllm(vllm_config(extra={"transfer_timeout_s": 2}))
    assert not s.is_producer and s.allowed_engines == {"dep.prefill-0"} and s.transfer_timeout_s == 2.0
    assert Settings.from_vllm(vllm_config("kv_producer")).is_producer
    assert s.kv_heads == 8  # before TP splits them
    assert s.secret_file == "/run/dep/deployment.secret" and s.peer_side_channels is None
    peers = Settings.from_vllm(vllm_config(extra={"peer_side_channels": {"dep.prefill-0": "10.0.0.1:5600"}}))
    assert peers.peer_side_channels == {"dep.prefill-0": ("10.0.0.1", 5600)}
    with pytest.raises(UnsupportedDeployment, match="peer_side_channels must map engine ids to 'host:port'"):
        Settings.from_vllm(vllm_config(extra={"peer_side_channels": {"dep.prefill-0": "no-port"}}))
    with pytest.raises(UnsupportedDeployment, match=r"lacks \['secret_file'\]"):
        config = vllm_config()
        del config.kv_transfer_config.kv_connector_extra_config["secret_file"]
        Settings.from_vllm(config)
    with pytest.raises(UnsupportedDeployment, match="secret_file must name the deployment secret's file"):
        Settings.from_vllm(vllm_config(extra={"secret_file": ""}))


def test_decode_gives_a_silent_prefill_seconds_not_one():
    """A saturated host answered every ping within 0.22 s (liveness.py); a 1 s bound had failed a
    busy prefill's transfers."""
    from kvpush.connector.consumer import ConsumerConfig
    from kvpush.connector.liveness import DEFAULT_ADMISSION_S, DEFAULT_SILENCE_S

    assert Settings.from_vllm(vllm_config()).peer_silence_s == DEFAULT_SILENCE_S >= 5.0
    assert DEFAULT_ADMISSION_S >= 10.0
    assert Settings.from_vllm(vllm_config(extra={"peer_silence_s": 2})).peer_silence_s == 2.0
    assert ConsumerConfig("D", 0, None, frozenset()).connect_timeout_s >= 5.0  # a lost SYN comes again after 1 s


def test_huge_pages_default_on_and_switchable_with_a_boolean_only():
    assert Settings.from_vllm(vllm_config()).huge_pages is True
    assert Settings.from_vllm(vllm_config(extra={"huge_pages": False})).huge_pages is False
    with pytest.raises(UnsupportedDeployment, match="huge_pages must be true or false"):
        Settings.from_vllm(vllm_config(extra={"huge_pages": "no"}))


def test_verify_kv_defaults_off_and_takes_a_boolean_only():
    assert Settings.from_vllm(vllm_config()).verify_kv is False
    assert Settings.from_vllm(vllm_config(extra={"verify_kv": True})).verify_kv is True
    with pytest.raises(UnsupportedDeployment, match="verify_kv"):
        Settings.from_vllm(vllm_config(extra={"verify_kv": "yes"}))


def test_the_accepted_transfer_safety_net_is_configurable_and_must_be_positive():
    assert Settings.from_vllm(vllm_config()).accepted_timeout_s == 300.0
    assert Settings.from_vllm(vllm_config(extra={"accepted_timeout_s": 20})).accepted_timeout_s == 20.0
    for bad in (0, -3, "20"):
        with pytest.raises(UnsupportedDeployment, match="accepted_timeout_s must be a number"):
            Settings.from_vllm(vllm_config(extra={"accepted_timeout_s": bad}))


def test_the_late_write_backstop_applies_under_either_failure_policy():
    assert Settings.from_vllm(vllm_config()).late_write_hold_s == 30.0
    assert Settings.from_vllm(vllm_config(extra={"late_write_hold_s": 0})).late_write_hold_s == 0.0  # no backstop
    recompute = vllm_config()
    recompute.kv_transfer_config.kv_load_failure_policy = "recompute"  # vLLM frees a failed load's blocks too
    assert Settings.from_vllm(recompute).late_write_hold_s == 30.0
    with pytest.raises(UnsupportedDeployment, match="late_write_hold_s must be a number >= 0"):
        Settings.from_vllm(vllm_config(extra={"late_write_hold_s": -1}))


def test_idle_wait_defaults_by_platform_and_refuses_nonsense():
    assert Settings.from_vllm(vllm_config()).idle_wait_ms == 20.0
    gpu = vllm_config()
    gpu.kv_transfer_config.kv_buffer_device = "cuda"
    assert Settings.from_vllm(gpu).idle_wait_ms == 2.0
    assert Settings.from_vllm(vllm_config(extra={"idle_wait_ms": 0})).idle_wait_ms == 0.0
    for bad in ("5", -1, True):
        with pytest.raises(UnsupportedDeployment, match="idle_wait_ms must be a number >= 0"):
            Settings.from_vllm(vllm_config(extra={"idle_wait_ms": bad}))


def test_progress_delay_is_left_to_the_memory_type_unless_set():
    from kvpush.connector.transfer import PROGRESS_DELAY_US

    assert Settings.from_vllm(vllm_config()).progress_delay_us is None
    assert PROGRESS_DELAY_US["DRAM"] >= 10_000 > PROGRESS_DELAY_US["VRAM"]  # CPU: sleep long; GPU: as measured
    assert Settings.from_vllm(vllm_config(extra={"progress_delay_us": 250})).progress_delay_us == 250
    for bad in (-5, 2.5):
        with pytest.raises(UnsupportedDeployment, match="progress_delay_us must be a whole number >= 0"):
            Settings.from_vllm(vllm_config(extra={"progress_delay_us": bad}))


def test_an_entry_the_connector_does_not_know_is_refused_naming_it():
    with pytest.raises(UnsupportedDeployment, match=r"extra_config\.backends is not a setting of kvpush's connector; "
                                                    r"the settings are side_channel_host, .*transfer_timeout_s"):
        Settings.from_vllm(vllm_config(extra={"backends": ["UCX"]}))


@pytest.mark.parametrize("key, bad", [("transfer_timeout_s", "30"), ("transfer_timeout_s", 0), ("peer_silence_s", True),
                                      ("side_channel_port", 70000), ("allowed_engines", "dep.prefill-0"),
                                      ("stream_writes", 1), ("transfer_timeout_s", float("inf"))])
def test_a_value_of_the_wrong_kind_is_refused_naming_the_entry(key, bad):
    with pytest.raises(UnsupportedDeployment, match=rf"kv_connector_extra_config\.{key} must be"):
        Settings.from_vllm(vllm_config(extra={key: bad}))


@pytest.mark.parametrize("kwargs, words", [
    ({"role": "kv_both"}, "kv_role"),
    ({"use_mla": True}, "MLA"),
    ({"dp": 2}, "data_parallel_size"),
    ({"pp": 2}, "pipeline"),
])
def test_unsupported_is_refused_with_reason(kwargs, words):
    with pytest.raises(UnsupportedDeployment, match=words):
        Settings.from_vllm(vllm_config(**kwargs))


def test_hybrid_kv_groups_refused():
    with pytest.raises(UnsupportedDeployment, match="KV cache groups"):
        Settings.from_vllm(vllm_config(), SimpleNamespace(kv_cache_groups=[1, 2]))


def test_missing_extra_config_names_keys():
    cfg = vllm_config()
    cfg.kv_transfer_config.kv_connector_extra_config = {}
    with pytest.raises(UnsupportedDeployment, match="side_channel_host"):
        Settings.from_vllm(cfg)


def test_resolved_kv_cache_layout_is_read_from_the_kv_cache_config_or_cache_config():
    cfg = vllm_config()
    assert Settings.from_vllm(cfg).kv_cache_layout is None
    cfg.cache_config.kv_cache_layout = "LBHNC"
    assert Settings.from_vllm(cfg).kv_cache_layout == "LBHNC"
    assert Settings.from_vllm(cfg, SimpleNamespace(kv_cache_layout="BLHNC", kv_cache_groups=[])).kv_cache_layout == "BLHNC"



def test_local_ranks_are_vllms_ranks_on_this_host():
    config = vllm_config("kv_producer")
    assert Settings.from_vllm(config).local_ranks == 1  # its TP size, where vLLM says nothing more
    config.parallel_config.local_world_size = 4  # vLLM's count where an instance spans nodes
    assert Settings.from_vllm(config).local_ranks == 4
