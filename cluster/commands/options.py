"""The options that several commands share, each one decorator, so that a flag reads, defaults
and helps the same wherever it appears.

Light to import: no MLX, no tokenizer, no HTTP stack. What parses an option's value (a model
path's default, an MTP depth) is imported when the command runs, never for `--help`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

BUNDLED_MODEL_HELP = (
    "Model: a directory, or a Hugging Face repo id owner/name[@revision] read through the hub's "
    "cache (default: the bundled tiny Qwen3.5)."
)


def _resolved_model(bundled_default: bool) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def resolve(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
        if value is None:
            if not bundled_default:
                return None
            from cluster.config import bundled_model_path

            return bundled_model_path()
        from cluster.config import ModelDirError
        from cluster.hub import resolve_model

        try:
            return resolve_model(value)
        except ModelDirError as error:
            raise click.BadParameter(str(error), ctx, param) from error

    return resolve


def model_option(
    help: str = BUNDLED_MODEL_HELP,
    *,
    bundled_default: bool = True,
    show_default: str | None = None,
) -> Callable[[F], F]:
    """`--model DIR|OWNER/NAME[@REV]` as the parameter `model_dir`: the local directory it names
    (a repo id resolved through the Hugging Face cache, `cluster.hub`, downloading what is
    missing unless HF_HUB_OFFLINE), the bundled tiny model when not given (None instead unless
    `bundled_default`); `show_default` says so in the help. Only the commands that read the
    model here resolve it: nodes receive their shard from the coordinator."""
    return click.option(
        "--model",
        "model_dir",
        metavar="DIR|OWNER/NAME",
        default=None,
        callback=_resolved_model(bundled_default),
        show_default=show_default,
        help=help,
    )


def token_option(help: str = "Cluster secret.", *, required: bool = False) -> Callable[[F], F]:
    """`--token SECRET`, also read from $CLUSTER_TOKEN; None when neither is given."""
    return click.option("--token", envvar="CLUSTER_TOKEN", required=required, help=help)


def tls_cert_option(help: str) -> Callable[[F], F]:
    """`--tls-cert PEM`, also read from $CLUSTER_TLS_CERT: an existing file, or None."""
    return click.option(
        "--tls-cert", envvar="CLUSTER_TLS_CERT", type=click.Path(exists=True), help=help
    )


def tls_key_option(help: str) -> Callable[[F], F]:
    """`--tls-key PEM`, also read from $CLUSTER_TLS_KEY: an existing file, or None."""
    return click.option(
        "--tls-key", envvar="CLUSTER_TLS_KEY", type=click.Path(exists=True), help=help
    )


def api_key_option(help: str) -> Callable[[F], F]:
    """`--api-key KEY`, also read from the coordinator's API key variable; None if neither.
    (`{env}` in `help` names the variable.)"""
    from coordinator.api_keys import API_KEY_ENV  # the modules that use it import it anyway

    return click.option("--api-key", envvar=API_KEY_ENV, help=help.format(env=API_KEY_ENV))


def _mtp_depth(ctx: click.Context, param: click.Parameter, value: str | None) -> object:
    if value is None:
        return None
    from cluster.messages import RequestError, parse_mtp_depth

    try:
        return parse_mtp_depth(value)
    except RequestError as error:
        raise click.BadParameter(str(error), ctx, param) from error


def mtp_depth_option(help: str) -> Callable[[F], F]:
    """`--mtp-depth 0-8|auto` as the parameter `mtp_depth`: a `MtpDepth`, None where not given
    (`auto`, but for a seeded sampled request: `cluster.decode.mtp_depth.served_depth`)."""
    return click.option("--mtp-depth", default=None, callback=_mtp_depth, help=help)


def _layer_ranges(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> list[tuple[int, int]] | None:
    if not value:
        return None
    from cluster.model.shard import parse_layers

    try:
        return parse_layers(value)
    except ValueError as error:
        raise click.BadParameter(str(error), ctx, param) from error


def layers_option(help: str) -> Callable[[F], F]:
    """`--layers START:END,...` as the parameter `layers`: the half-open ranges, or None."""
    return click.option(
        "--layers", metavar="START:END,...", default=None, callback=_layer_ranges, help=help
    )


# The serving options of a coordinator, as `serving_options` adds them: (parameter, option).
# Every default is None, "not given", so that a cluster file's key can fill what no flag gave
# (`coordinator.settings.ServingOptions.over`); the help names the real default.
_SERVING_OPTIONS: list[tuple[str, Callable[[F], F]]] = [
    ("host", click.option(
        "--host", default=None,
        help="Where the HTTP endpoint listens [default: 127.0.0.1]. Beyond loopback it needs "
        "an API key.")),
    ("port", click.option(
        "--port", type=int, default=None,
        help="HTTP port; 0 takes any free one (the endpoint line says which) [default: 8000].")),
    ("api_key", click.option(
        "--api-key", envvar="CLUSTER_API_KEY", default=None,
        help="Require 'Authorization: Bearer KEY' on /v1 (also $CLUSTER_API_KEY).")),
    ("api_key_file", click.option(
        "--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None, help="Accepted API keys, one a line (with or instead of --api-key).")),
    ("no_api_key", click.option(
        "--no-api-key", is_flag=True, default=None,
        help="Serve beyond loopback without an API key, on purpose (refused otherwise).")),
    ("mtp_depth", click.option(
        "--mtp-depth", default=None, callback=_mtp_depth,
        help="MTP drafts per step for requests that do not name theirs: 0-8, or auto (the "
        "tail drafts where it pays) [default: auto].")),
    ("no_prefix_cache", click.option(
        "--no-prefix-cache", is_flag=True, default=None,
        help="Do not keep conversation (prefix) snapshots on the nodes.")),
    ("open_monitoring", click.option(
        "--open-monitoring", is_flag=True, default=None,
        help="With API keys: leave /metrics, /health and the dashboard's data open.")),
    ("tls_cert", click.option(
        "--tls-cert", envvar="CLUSTER_TLS_CERT", default=None,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Cluster certificate (PEM) when the nodes serve TLS.")),
    ("tls_key", click.option(
        "--tls-key", envvar="CLUSTER_TLS_KEY", default=None,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="The certificate's key: with TLS, needed to serve weights to nodes.")),
    ("max_running", click.option(
        "--max-running", type=click.IntRange(min=1), default=None,
        help="Requests decoded at once [default: 8].")),
    ("max_queued", click.option(
        "--max-queued", type=click.IntRange(min=0), default=None,
        help="Requests waiting for a slot [default: 64].")),
    ("max_context", click.option(
        "--max-context", type=click.IntRange(min=1), default=None, metavar="TOKENS",
        help="The longest request served, prompt + max_tokens; each node reserves its caches "
        "for --max-running such requests, and longer ones get a 400 [default: the model's "
        "context, or the longest that fits].")),
    ("weights_port", click.option(
        "--weights-port", type=click.IntRange(min=0, max=65535), default=None,
        help="Port of the weights service that nodes fetch from [default: any free port].")),
]  # fmt: skip


def serving_options(command: F) -> F:
    """The whole block of a coordinator's serving options (`--host`, `--port`, the API keys,
    `--mtp-depth`, `--no-prefix-cache`, `--open-monitoring`, TLS, admission limits, the
    longest request, the weights port), handed to `command` as one parameter, `serving`: a
    `coordinator.settings.ServingOptions` holding what was given (None elsewhere), which
    `ServingOptions.settings` turns into the coordinator's settings."""

    @functools.wraps(command)
    def with_serving(*args: Any, **kwargs: Any) -> Any:
        from coordinator.settings import ServingOptions

        given = {name: kwargs.pop(name) for name, _ in _SERVING_OPTIONS}
        no_prefix_cache = given.pop("no_prefix_cache")
        for flag in ("no_api_key", "open_monitoring"):  # a flag not given: None, not False
            given[flag] = given[flag] or None
        serving = ServingOptions(**given, prefix_cache=False if no_prefix_cache else None)
        return command(*args, serving=serving, **kwargs)

    for _, option in reversed(_SERVING_OPTIONS):
        with_serving = option(with_serving)
    return with_serving  # type: ignore[return-value]
