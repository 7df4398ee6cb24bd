"""Where the router's signing key for kv_transfer_params comes from: a file `up` derives from the
deployment secret, on the router's host only, named in router.json; never the secret itself."""
from __future__ import annotations

from kvpush.common import deployment_secret as ds
from kvpush.deploy.lifecycle.secrets import AccessKeys, secret_file_content
from kvpush.deploy.plan.plan import build_plan, router_config
from kvpush.deploy.topology.topology import parse_topology


def topology(tmp_path, connector: str = "kvpush"):
    return parse_topology(f"""
name: t
model: {{path: /m}}
connector: {{type: {connector}}}
hosts:
  a: {{address: 10.0.0.1, workdir: {tmp_path}/a}}
  c: {{address: 10.0.0.3, workdir: {tmp_path}/c}}
prefill: [{{host: a}}]
decode: [{{host: a}}]
router: {{host: c}}
""")


def test_the_router_gets_the_derived_signing_key_and_not_the_secret(tmp_path):
    topo = topology(tmp_path)
    assert router_config(topo).transfer_params_key_file == f"{tmp_path}/c/t/router-params.key"
    kinds = {h.name: {f.kind for f in h.secret_files} for h in build_plan(topo).hosts}
    assert "router-params-key" in kinds["c"] and "router-params-key" not in kinds["a"]
    secret = ds.new_secret()
    content = secret_file_content("router-params-key", secret, AccessKeys.of(secret, None)).decode()
    assert content == ds.derive_token(secret, ds.TRANSFER_PARAMS) + "\n"
    assert secret.hex() not in content and ds.derive_token(secret, ds.SIDE_CHANNEL) not in content


def test_other_protocols_sign_nothing(tmp_path):
    topo = topology(tmp_path, "nixl-pull")
    assert router_config(topo).transfer_params_key_file is None
    assert all("router-params-key" not in {f.kind for f in h.secret_files} for h in build_plan(topo).hosts)


def test_the_check_of_signed_params_cannot_be_switched_off_from_extra_config(tmp_path):
    """The connector checks signatures whenever it has the deployment secret, whose path kvpush
    sets; a topology may not take it away (nor name another)."""
    import pytest

    from kvpush.common.errors import KvpushError

    for value in ('""', "null", "/tmp/other.secret"):
        with pytest.raises(KvpushError, match="secret_file"):
            parse_topology(f"""
name: t
model: {{path: /m}}
connector: {{type: kvpush, extra_config: {{secret_file: {value}}}}}
hosts:
  a: {{address: 10.0.0.1, workdir: {tmp_path}/a}}
prefill: [{{host: a}}]
decode: [{{host: a}}]
""")
