"""The `cluster` command: a group whose commands live in `cluster.commands`, each imported only
when it runs."""

from __future__ import annotations

import importlib
import logging

import click

# Each command by name: the module of `cluster.commands` (or of the bench) it is in, and its
# name there. Only the command that runs is imported: a node's start then imports the node's
# code, not the coordinator's tokenizer (`transformers`, seconds to import) nor the
# benchmark's HTTP client; and `cluster hosts ...`, which `cluster up --hosts` runs over ssh
# on every host, imports no MLX either, since each ssh round trip starts a fresh process.
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "generate": ("cluster.commands.generate", "generate_command"),
    "node": ("cluster.commands.node", "node_command"),
    "plan": ("cluster.commands.plan", "plan_command"),
    "coordinator": ("cluster.commands.coordinator", "coordinator_command"),
    "up": ("cluster.commands.up", "up_command"),
    "down": ("cluster.commands.up", "down_command"),
    "status": ("cluster.commands.status", "status_command"),
    "models": ("cluster.commands.models", "models_command"),
    "bench": ("cluster.commands.bench", "bench_command"),
    "convert": ("cluster.commands.convert", "convert_command"),
    "hosts": ("cluster.commands.hosts", "hosts_group"),
}


class _Commands(click.Group):
    """The `cluster` group: every command is imported when asked for (`COMMAND_MODULES`)."""

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands or name not in COMMAND_MODULES:
            return super().get_command(ctx, name)
        module_name, attribute = COMMAND_MODULES[name]
        command = getattr(importlib.import_module(module_name), attribute)
        self.add_command(command, name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(COMMAND_MODULES))  # `hosts` is hidden in help


@click.group(cls=_Commands)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Serve Qwen3.5 models across several Macs, pipeline-parallel, with MTP decoding."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
