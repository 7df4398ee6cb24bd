"""The secret files `kvpush up` would write, for tests that start a plan's processes themselves."""
from __future__ import annotations

from kvpush.common.deployment_secret import new_secret
from kvpush.deploy.plan.plan_model import Plan
from kvpush.deploy.runners import LocalRunner
from kvpush.deploy.lifecycle.secrets import AccessKeys, SecretDelivery


def write_secret_files(plan: Plan) -> AccessKeys:
    """Every secret file of every (local) host of the plan, with a fresh deployment secret; the
    keys kvpush's own requests would carry."""
    secret = new_secret()
    keys = AccessKeys.of(secret, None)
    runner = LocalRunner()
    SecretDelivery(plan, secret, keys).write({h.name: runner for h in plan.hosts}, {h.name: h.secret_files for h in plan.hosts})
    return keys


def keyless(argv: list[str]) -> list[str]:
    """A plan's vLLM argv without the instance-key middleware (kvpush.common.instance_auth), for tests
    that start an instance themselves and send it requests directly, as its only client: such an
    instance has no key in its environment, and the middleware refuses to start without one."""
    from kvpush.common.instance_auth import MIDDLEWARE_PATH

    at = argv.index(MIDDLEWARE_PATH)
    assert argv[at - 1] == "--middleware"
    return argv[:at - 1] + argv[at + 1:]
