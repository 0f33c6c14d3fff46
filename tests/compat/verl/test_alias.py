"""``scaletrain.compat.verl_alias``: verl's import paths answered with scaletrain's modules (``make test-verl``).

Run in a fresh interpreter: installing the finder in the suite's own processes would make every later ``import
verl`` succeed there."""

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_verl_paths_are_scaletrains_modules_and_unknown_ones_are_refused():
    result = _run(
        """
        from scaletrain.compat.verl_alias import install
        install()
        import verl.trainer.ppo.core_algos as core_algos
        from verl import DataProto
        from verl.protocol import DataProto as ProtoToo
        import scaletrain.compat.verl.trainer.ppo.core_algos as ours
        import scaletrain.protocol
        assert core_algos is ours, "the alias must be the same module object (mock.patch on verl.x patches ours)"
        assert core_algos.__name__ == "scaletrain.compat.verl.trainer.ppo.core_algos"
        assert core_algos.__spec__.name == core_algos.__name__  # its own spec kept
        assert DataProto is ProtoToo is scaletrain.protocol.DataProto
        try:
            import verl.trainer.ppo.no_such_module  # noqa: F401
        except ModuleNotFoundError as exc:
            print("refused:", exc.name)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "refused: verl.trainer.ppo.no_such_module" in result.stdout


def test_without_install_there_is_no_verl():
    result = _run("import verl")
    assert result.returncode != 0 and "No module named 'verl'" in result.stderr
