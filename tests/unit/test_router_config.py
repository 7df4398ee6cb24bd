"""router/config.py: what the router accepts as an instance's address."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpush.router.config import Upstream

pytestmark = pytest.mark.unit


def upstream(url: str) -> Upstream:
    return Upstream(name="d0", url=url, engine_id="dep.d0", side_channel_host="127.0.0.1", side_channel_port=5600)


def test_a_base_url_is_kept_without_its_trailing_slash():
    assert upstream("http://10.0.0.2:8100/").url == "http://10.0.0.2:8100"
    assert upstream("http://decode-0:8100").url == "http://decode-0:8100"


@pytest.mark.parametrize("url", ["https://d:8100", "ftp://d", "http://", "http://d:8100/v1", "d:8100", "http://d:8100?x=1"])
def test_anything_but_a_plain_http_base_url_is_refused_naming_the_field(url):
    with pytest.raises(ValidationError, match="url") as info:
        upstream(url)
    assert "http://host:port" in str(info.value)


def test_a_config_with_the_retired_retry_count_is_refused_with_the_fix():
    from kvpush.common.errors import validation_problem
    from kvpush.router.config import RouterConfig

    with pytest.raises(ValidationError) as info:
        RouterConfig.model_validate({"protocol": "kvpush", "served_model_name": "m", "max_retries": 2,
                                     "decode": [upstream("http://d:1").model_dump()]})
    problem = validation_problem(info.value)
    assert "remove max_retries" in problem and "retry_deadline_s" in problem


def test_what_a_client_may_hold_has_defaults_and_refuses_numbers_that_are_not_finite():
    from kvpush.router import config as cfg
    from kvpush.router.config import RouterConfig

    base = {"protocol": "kvpush", "served_model_name": "m", "decode": [upstream("http://d:1").model_dump()]}
    config = RouterConfig.model_validate(base)
    assert (config.max_connections, config.header_timeout_s, config.body_timeout_s, config.keepalive_timeout_s) == (
        cfg.MAX_CONNECTIONS, cfg.HEADER_TIMEOUT_S, cfg.BODY_TIMEOUT_S, cfg.KEEPALIVE_TIMEOUT_S)
    assert config.max_body_bytes == config.max_prompt_chars * cfg.MAX_BODY_BYTES_PER_CHAR + (1 << 20)
    for field, value in (("header_timeout_s", 0), ("body_timeout_s", float("inf")), ("keepalive_timeout_s", float("nan")),
                         ("max_connections", 0)):
        with pytest.raises(ValidationError, match=field):
            RouterConfig.model_validate({**base, field: value})
    assert RouterConfig.model_validate_json(config.to_file_json()) == config
