"""`kvpush router`: run the router in the foreground, from a router config or a topology."""
from __future__ import annotations

import logging
from pathlib import Path

import typer

from kvpush.common.errors import KvpushError, UsageError, validation_problem

from .console import note
from .options import FILE_ARG, FILE_OPTION, examples, topology_file


def register(app: typer.Typer) -> None:
    @app.command("router", epilog=examples(('kvpush router my.yaml', "the topology's router, in the foreground"),
                      ('kvpush router --file my.yaml --log-level DEBUG', 'the same, with every request logged'),
                      ('kvpush router --config ~/.kvpush/local-cpu/router.json', 'from the config `up` wrote')))
    def router_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        config: Path | None = typer.Option(
            None, "--config", help="Router config JSON (as `kvpush up` writes it) instead of a topology."
        ),
        log_level: str = typer.Option("INFO", "--log-level", help="Python logging level."),
    ) -> None:
        """Run the push-aware router in the foreground (Ctrl-C stops it)."""
        from pydantic import ValidationError

        from kvpush.router.app import run
        from kvpush.router.config import RouterConfig
        from kvpush.router.keys import resolve_keys

        topology = topology_file(file, file_option)
        if topology is not None and config is not None:
            raise UsageError("router: give a topology (FILE or --file FILE) or --config FILE, not both")
        if not isinstance(logging.getLevelName(log_level.upper()), int):
            raise UsageError(
                f"--log-level: unknown level '{log_level}'; choose one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
            )
        if config is not None:
            try:
                router_config = RouterConfig.from_file(config)
            except FileNotFoundError:
                raise UsageError(
                    f"{config}: no such file; pass the router.json that `kvpush plan`/`up` wrote"
                ) from None
            except OSError as exc:
                raise UsageError(
                    f"{config}: cannot read it ({exc.strerror or exc}); pass the router.json that `kvpush plan`/`up` "
                    "wrote"
                ) from None
            except ValidationError as exc:
                raise UsageError(f"{config}: {validation_problem(exc)}") from None
            source = str(config)
        else:
            from kvpush.deploy.plan.plan import router_config as plan_router_config
            from kvpush.deploy.topology.topology import resolve_topology

            topo, source = resolve_topology(topology)
            planned = plan_router_config(topo)
            upstream_key = planned.instance_api_key_file
            params_key = planned.transfer_params_key_file
            # In the foreground the client key is read here (api_key_env, api_key_file); instances that
            # `up` started on this machine take the key it wrote for the router, others the client's.
            router_config = planned.model_copy(
                update={
                    "api_key_env": topo.router.api_key_env,
                    "api_key_file": topo.router.api_key_file,
                    "instance_api_key_file": upstream_key
                    if upstream_key and Path(upstream_key).expanduser().is_file()
                    else None,
                    "transfer_params_key_file": params_key
                    if params_key and Path(params_key).expanduser().is_file()
                    else None,
                }
            )
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        note(f"router from {source}: http://{router_config.bind}:{router_config.port} ({router_config.protocol})")
        try:
            run(router_config, resolve_keys(router_config))
        except OSError as exc:
            raise KvpushError(
                f"router: cannot listen on {router_config.bind}:{router_config.port}: {exc.strerror or exc}"
            ) from None
