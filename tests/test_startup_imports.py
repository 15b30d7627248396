"""What a `cluster` process imports at its start: a node and `cluster status` go without the
tokenizer (`transformers`, seconds to import), and mlx-lm's package still works in full when a
process uses its names. Each check runs in a fresh interpreter: this one imported mlx-lm
before `cluster`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from cluster.cli import COMMAND_MODULES, main

# The tokenizer and what brings it in, then the HTTP stack (the coordinator's, the benchmark's).
HEAVY = ("transformers", "mlx_lm.tokenizer_utils", "coordinator.service", "aiohttp")


def _fresh(code: str) -> dict:
    """Run `code` in a new interpreter. It fills the dict `found`, which comes back with
    `heavy` (which of HEAVY the process had imported by its end) and `stderr`."""
    tail = f"found['heavy'] = [m for m in {HEAVY!r} if m in sys.modules]\nprint(json.dumps(found))"
    program = "import json, sys\nfound = {}\n" + textwrap.dedent(code) + "\n" + tail
    # As a process started by a user: without what this one's import of mlx-lm set.
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]) | {"stderr": done.stderr}


def _after_command(*argv: str) -> list[str]:
    """Which of HEAVY the process imported to run `cluster ARGV`."""
    code = f"from cluster.cli import main\nmain({list(argv)!r}, standalone_mode=False)"
    return _fresh(code)["heavy"]


def test_a_node_and_status_start_without_the_tokenizer() -> None:
    assert _after_command("node", "--help") == []
    for command in ("status", "down"):  # (status asks the coordinator's HTTP API: aiohttp)
        assert set(_after_command(command, "--help")).isdisjoint(HEAVY[:3]), command


def test_a_node_runs_a_step_without_the_tokenizer() -> None:
    found = _fresh("""
        import cluster
        from cluster.config import bundled_model_path
        from cluster.decode.runner import ShardRunner
        from cluster.messages import StepRequest
        from cluster.model.loading import load_shard
        runner = ShardRunner(load_shard(bundled_model_path(), for_decoding=True))
        (result,) = runner.run([StepRequest("r", (1, 2, 3), 0)]).results
        found["tokens"] = list(result.tokens)
    """)
    assert len(found["tokens"]) == 1 and found["heavy"] == []


def test_mlx_lm_names_resolve_on_first_use() -> None:
    found = _fresh("""
        import cluster
        import mlx_lm.models.qwen3_5
        found["deferred"] = "load" not in sys.modules["mlx_lm"].__dict__
        from mlx_lm import stream_generate
        import mlx_lm
        found["callable"] = callable(mlx_lm.load) and callable(stream_generate)
        found["version"] = mlx_lm.__version__
        try:
            mlx_lm.no_such_name
        except AttributeError as error:
            found["missing"] = str(error)
    """)
    assert found["deferred"] and found["callable"] and found["version"]
    assert found["missing"] == "module 'mlx_lm' has no attribute 'no_such_name'"
    assert "transformers" in found["heavy"]  # the package's body ran, as mlx-lm's own import


def test_the_tokenizer_imported_first_is_as_quiet_as_under_mlx_lm() -> None:
    """mlx-lm's body turns transformers' advisory warnings off before importing it; the
    coordinator imports the tokenizer's module before any use of the body runs it."""
    found = _fresh("""
        import cluster
        import coordinator.service
        found["body"] = "load" in sys.modules["mlx_lm"].__dict__
    """)
    assert not found["body"] and "transformers" in found["heavy"]
    assert "PyTorch was not found" not in found["stderr"], found["stderr"]


def test_every_command_is_listed_and_runs_its_help() -> None:
    listed = CliRunner().invoke(main, ["--help"])
    assert listed.exit_code == 0, listed.output
    for name in set(COMMAND_MODULES) - {"hosts"} | {"generate"}:
        assert f"  {name} " in listed.output, name
    assert "  hosts " not in listed.output  # run over ssh by `cluster up --hosts`: hidden
    for name in COMMAND_MODULES:
        helped = CliRunner().invoke(main, [name, "--help"])
        assert helped.exit_code == 0 and "Usage:" in helped.output, (name, helped.output)
    unknown = CliRunner().invoke(main, ["nonsense"])
    assert unknown.exit_code == 2 and "No such command 'nonsense'" in unknown.output


def test_threads_first_using_mlx_lm_at_once_all_get_its_names() -> None:
    """The body runs once; a thread that asks while another runs it waits for it, rather than
    finding the package without its names."""
    found = _fresh("""
        import threading
        import cluster
        import mlx.core as mx
        import mlx_lm
        start, got = threading.Barrier(4), []
        def use():
            start.wait()
            try:
                got.append(callable(mlx_lm.load))
            except AttributeError as error:
                got.append(str(error))
            finally:
                # The body made a stream in this thread (mlx_lm.generate's). MLX 0.32 asks a
                # thread to drop its streams before it ends: left to the thread's exit, their
                # teardown takes the GIL and, should the interpreter be finalizing by then,
                # aborts the process (about 1 exit in 10 on 2 busy cores).
                mx.clear_streams()
        threads = [threading.Thread(target=use) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        found["got"] = got
    """)
    assert found["got"] == [True] * 4
