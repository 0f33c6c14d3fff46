"""The embedded default rewarded through a remote judge, over several seeds: the learning figure of the remote path.

    python launch/recipes/remote_judge_seeds.py --seeds 1 2 3 --out DIR [-- more overrides]

Starts the stand-in OpenAI-compatible judge (``python -m tests.reward.judge_server`` on the loopback address: it
answers each question with the rule's verdict, since no outside judge can be reached here), then runs
``launch/recipes/seeds.py`` with the embedded default's reward asked of it (``launch/recipes/arithmetic_judge.py``,
``reward.judge.base_url``): every sample's reward is an HTTP round trip through the judge client's concurrency
limit, retries and timeouts. The figure to set it against is seeds.py's rule run with the same seeds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch" / "recipes"))

import seeds  # noqa: E402  (launch/recipes/seeds.py)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.reward.judge_server"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        judge = [
            f"custom_reward_function.path={ROOT / 'launch' / 'recipes' / 'arithmetic_judge.py'}",
            f"reward.judge.base_url=http://127.0.0.1:{port}/v1",
        ]
        if "--title" not in argv:
            argv = ["--title", "embedded default, rewarded by a remote judge", *argv]
        if "--" not in argv:
            argv.append("--")
        seeds.main([*argv, *judge])
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
