"""Model-written code against code_runner's sandbox (issue 30, item 1), written as an attacker would: each attack
runs through the real tool (bubblewrap, the unprivileged uid, the namespaces) and the host checks it did nothing:
a victim process owned by the driver's user lives, the trainer's files, tokens and environment are neither read
nor changed, no host socket saw a connection, no process outlived the run, the limits held and the next run works.
Where it is safe, the same attack is also run with ``allow_unsandboxed`` (no bubblewrap: resource limits only) and
must succeed there: proof that the attack is real and that the sandbox, not the attack, is what failed."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

from scaletrain.agent.tools import sandbox
from scaletrain.agent.tools.code_runner import CodeRunnerTool
from tests.agent.helpers import SET_NAME, ScriptedServer, config, make_agent_tokenizer, pids_named
from tests.agent.test_parser_tools import execute


def run(code: str, unsandboxed: bool = False, **settings) -> str:
    tool = CodeRunnerTool({"timeout": 10, **settings, "allow_unsandboxed": unsandboxed})
    response, _, metrics = execute(tool, code=textwrap.dedent(code))
    assert ("code_runner/unsandboxed" in metrics) == unsandboxed, metrics
    return response.text


def test_without_a_sandbox_the_tool_refuses_to_be_built_naming_the_key(no_sandbox):
    with pytest.raises(RuntimeError) as refused:
        CodeRunnerTool({"timeout": 5})
    message = str(refused.value)
    assert "scaletrain-no-such-bwrap" in message and "not installed" in message
    assert "allow_unsandboxed: true" in message and "apt-get install bubblewrap" in message
    assert run("print('ran')", unsandboxed=True) == "ran\n"  # forced: runs, and says so in its metrics


def test_the_code_cannot_signal_the_driver_or_any_host_process():
    victim = subprocess.Popen(["sleep", "60"])  # the driver's user's process, pid known to the attacker
    try:
        text = run(f"""
            import os, signal
            hits = []
            for target in (os.getppid(), {os.getpid()}, {victim.pid}, 1, -1):
                try:
                    os.kill(target, signal.SIGKILL)
                    hits.append(target)
                except OSError as exc:
                    pass
            for pid in range(1, 5000):
                try:
                    os.kill(pid, 0)
                    hits.append(pid)
                except OSError:
                    pass
            print('signalled', hits)
        """)
        time.sleep(0.2)
        assert victim.poll() is None, text  # alive
        seen = eval(text.split("signalled", 1)[1])  # only its own processes: its own pid, no host pid
        assert victim.pid not in seen and os.getpid() not in seen, text
        assert run("print('next')") == "next\n"
    finally:
        victim.kill()
        victim.wait()


def test_the_code_cannot_read_the_trainers_files_tokens_or_environment(tmp_path, monkeypatch, unsandboxed):
    canary = f"canary-{uuid.uuid4().hex}"
    token = tmp_path / "auth_token"
    token.write_text(canary)
    token.chmod(0o644)  # as Ray's per-user token file is
    monkeypatch.setenv("SCALETRAIN_CANARY_SECRET", canary)  # the driver's environment
    text = run(
        f"""
        import os
        found, read = [], 0
        paths = [{str(token)!r}, '/etc/shadow', os.path.expanduser('~/.ray/auth_token'), '/proc/{os.getpid()}/environ']
        paths += [f'/proc/{{p}}/environ' for p in os.listdir('/proc') if p.isdigit()]
        for root, _, files in os.walk({str(tmp_path)!r}):
            paths += [os.path.join(root, f) for f in files]
        for top in ('/', '/tmp', '/root', '/root/.ray', '/home', '/etc', '/work'):
            try:
                paths += [os.path.join(top, f) for f in os.listdir(top)]
            except OSError:
                pass
        for path in paths:
            try:
                with open(path, 'rb') as f:
                    data = f.read(1 << 20)
                read += 1
            except OSError:
                continue
            if {canary!r}.encode() in data:
                found.append(path)
        print('read', read, 'found', found, 'environ', {canary!r} in str(os.environ))
    """,
        unsandboxed=unsandboxed,
    )
    words = text.split()
    assert words[0] == "read" and int(words[1]) > 0, text  # the scan ran and could read something
    if unsandboxed:  # the attack is real: resource limits alone let it read the token
        assert str(token) in text, text
    else:
        assert canary not in text and "found [] environ False" in text, text


def test_the_code_cannot_change_the_reward_file_data_or_checkpoints(tmp_path, unsandboxed):
    targets = {name: tmp_path / name for name in ("reward.py", "train.parquet", "ckpt.pt")}
    for path in targets.values():
        path.write_text("original")
    run(
        f"""
        import os, shutil
        for path in {[str(p) for p in targets.values()]!r}:
            for attack in (lambda: open(path, 'w').write('def compute_score(*a): return 1.0'),
                           lambda: os.chmod(path, 0o777), lambda: os.rename(path, path + '.x'),
                           lambda: os.unlink(path)):
                try:
                    attack()
                except OSError:
                    pass
    """,
        unsandboxed=unsandboxed,
    )
    intact = all(p.exists() and p.read_text() == "original" for p in targets.values())
    assert intact != unsandboxed  # unsandboxed the attack rewrites them: the sandbox is what keeps them


class HostListeners:
    """A TCP server on the host's loopback, a Unix socket file and an abstract Unix socket, counting connections."""

    def __init__(self, tmp_path):
        self.accepted = 0
        self.abstract = f"\0scaletrain-canary-{uuid.uuid4().hex}"
        self.path = str(tmp_path / "host.sock")
        tcp = socket.create_server(("127.0.0.1", 0))
        self.port = tcp.getsockname()[1]
        self.sockets = [tcp]
        for address in (self.path, self.abstract):
            unix = socket.socket(socket.AF_UNIX)
            unix.bind(address)
            unix.listen()
            self.sockets.append(unix)
        for server in self.sockets:
            server.settimeout(0.2)
            threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server):
        while True:
            try:
                server.accept()[0].close()
                self.accepted += 1
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self):
        for server in self.sockets:
            server.close()


CONNECT = """
import _socket, os
def attempt(family, address):
    try:
        s = _socket.socket(family, _socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(address)
        return 'connected'
    except OSError as exc:
        return type(exc).__name__
print('tcp', attempt(_socket.AF_INET, ('127.0.0.1', {port})), 'unix', attempt(_socket.AF_UNIX, {path!r}),
      'abstract', attempt(_socket.AF_UNIX, {abstract!r}))
"""


def test_no_host_socket_is_reachable_tcp_unix_or_abstract(tmp_path, unsandboxed):
    host = HostListeners(tmp_path)
    try:
        text = run(CONNECT.format(port=host.port, path=host.path, abstract=host.abstract), unsandboxed=unsandboxed)
        time.sleep(0.3)
        if unsandboxed:  # resource limits alone: a host Unix socket is one connect away (the finding)
            assert "unix connected" in text and host.accepted >= 1, text
        else:
            assert "connected" not in text and host.accepted == 0, text
    finally:
        host.close()


def test_setns_into_the_host_network_fails(tmp_path):
    host = HostListeners(tmp_path)
    try:
        text = run(
            textwrap.dedent("""
            import ctypes, glob, os
            libc = ctypes.CDLL(None, use_errno=True)
            joined = []
            for path in glob.glob('/proc/*/ns/net') + glob.glob('/run/netns/*') + glob.glob('/var/run/netns/*'):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                if libc.setns(fd, 0x40000000) == 0:
                    joined.append(path)
            print('joined', joined)
            print('interfaces', [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]])
            """)
            + CONNECT.format(port=host.port, path=host.path, abstract=host.abstract)
        )
        time.sleep(0.3)
        assert "joined []" in text and "interfaces ['lo']" in text, text
        assert "connected" not in text and host.accepted == 0, text
    finally:
        host.close()


def test_limits_cannot_be_raised():
    text = run("""
        import os, resource
        raised, hard = [], {}
        for name in ('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_CORE', 'RLIMIT_NOFILE'):
            limit = getattr(resource, name)
            hard[name] = resource.getrlimit(limit)[1]
            if hard[name] == resource.RLIM_INFINITY:
                continue  # nothing above it to raise to
            try:
                resource.setrlimit(limit, (hard[name] + 1, hard[name] + 1))
                raised.append(name)
            except (ValueError, OSError):
                pass
        try:  # out of the OOM killer's reach
            fd = os.open('/proc/self/oom_score_adj', os.O_WRONLY)
            os.write(fd, b'-1000')
        except OSError:
            pass
        if open('/proc/self/oom_score_adj').read().strip() != '1000':
            raised.append('oom_score_adj')
        print('raised', raised)
        print('infinite', [name for name, value in hard.items() if value == resource.RLIM_INFINITY])
    """)
    assert "raised []" in text, text
    # the limits the tool sets are finite, so the attempt above was made on each of them
    assert not {"RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"} & set(eval(text.split("infinite")[1])), text


def test_a_fork_bomb_is_bounded_and_nothing_outlives_the_run():
    name = f"bomb{uuid.uuid4().hex[:8]}"
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], len(pids_named(name)))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    code = SET_NAME.format(name=name) + bomb
    start = time.perf_counter()
    try:
        text = run(code, timeout=3, max_processes=16)
    finally:
        stop.set()
        sampler.join()
    assert time.perf_counter() - start < 10 and "timed out after 3" in text, text
    assert 0 < peak[0] <= 16, peak  # seen, and bounded by max_processes
    time.sleep(0.2)
    assert pids_named(name) == [], "a fork-bomb process outlived the run"
    assert run("print('next')") == "next\n"


def test_a_process_cannot_escape_the_run_through_cgroups_or_a_new_session():
    name = f"stay{uuid.uuid4().hex[:8]}"
    text = run(
        SET_NAME.format(name=name)
        + textwrap.dedent("""
        import ctypes, glob, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        moved = []
        for procs in glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True) + ['/sys/fs/cgroup/cgroup.procs']:
            try:
                open(procs, 'w').write(str(os.getpid()))
                moved.append(procs)
            except OSError:
                pass
        mounted = libc.mount(b'cgroup', b'/tmp', b'cgroup', 0, b'pids') == 0
        if os.fork() == 0:  # a daemon: new session, double fork, no output pipe
            os.setsid()
            if os.fork() == 0:
                os.close(1); os.close(2)
                time.sleep(60)
            os._exit(0)
        print('moved', moved, 'mounted', mounted)
    """)
    )
    assert "moved [] mounted False" in text, text
    time.sleep(0.3)
    assert pids_named(name) == [], "a daemonised process outlived the run"


def test_filling_the_disk_stops_at_disk_mb_and_nothing_persists():
    text = run(
        """
        import os
        written = 0
        for top in ('/tmp', '/', '/dev/shm', '/var/tmp', '/sandbox', os.path.dirname(os.__file__)):
            for i in range(1000):
                try:
                    with open(os.path.join(top, f'fill{i}'), 'wb') as f:
                        for _ in range(4):
                            f.write(b'x' * (1 << 20))
                            written += 1 << 20
                except OSError:
                    break
        print('written_mib', written >> 20)
        """,
        disk_mb=8,
    )
    assert "written_mib" in text and int(text.split()[-1]) <= 8, text
    assert run("import os\nprint(sorted(os.listdir('/tmp')))") == "[]\n"  # a fresh /tmp per run


def test_an_agent_loop_survives_a_hostile_tool_call():
    """The agent loop runs in the driver: the model's tool call tries to kill its parent, its group and every
    process; the trajectory goes on to the model's next turn and the driver (this process) is unharmed."""
    from scaletrain.agent import ToolAgentLoop

    tok = make_agent_tokenizer()
    attack = (
        "import os, signal\\nfor p in (os.getppid(), 1, -1):\\n    try: os.kill(p, 9)\\n"
        "    except OSError: pass\\nprint('still here')"
    )
    call = '<tool_call>{"name": "code_runner", "arguments": {"code": "' + attack + '"}}</tool_call>'
    server = ScriptedServer(
        lambda rid, turn, p: tok(call if turn == 0 else "ok", add_special_tokens=False)["input_ids"]
    )
    tool = CodeRunnerTool({"timeout": 10})
    loop = ToolAgentLoop(config(), server, tok, response_length=400, tools={"code_runner": tool})
    out = asyncio.run(loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "hi"}], request_id="r"))
    tool_text = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert "still here" in tool_text and len(server.calls) == 2, tool_text


def test_the_jail_runs_the_base_interpreter_without_the_trainers_packages():
    text = run("import sys\nprint(sys.prefix)\ntry:\n    import torch\nexcept ImportError:\n    print('no torch')")
    assert text.split()[0] == os.path.realpath(sys.base_prefix) and "no torch" in text, text


def test_a_signal_death_is_reported_by_name():
    text = run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert text == "Error: killed by signal SIGSEGV", text  # bwrap exits 128 + the signal: named, not a number


NON_ROOT_DRIVER = """
import importlib.util, json, os, subprocess, sys, time
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
victim = subprocess.Popen(["sleep", "60"])  # the driver's own user's process
code = (f"import os\\nfor p in (os.getppid(), {os.getpid()}, {victim.pid}, -1):\\n    try:\\n"
        f"        os.kill(p, 9)\\n    except OSError:\\n        pass\\ntry:\\n"
        f"    print(open({sys.argv[2]!r}).read())\\nexcept OSError as exc:\\n"
        f"    print(type(exc).__name__)\\nprint(os.getuid())")
fd = os.memfd_create("code")
os.write(fd, code.encode())
os.lseek(fd, 0, os.SEEK_SET)
done = subprocess.run(sandbox.jail_argv(fd, 8), pass_fds=(fd,), capture_output=True, text=True, timeout=30)
time.sleep(0.2)
print(json.dumps({"problem": sandbox.sandbox_problem(), "out": done.stdout + done.stderr, "victim": victim.poll()}))
victim.kill()
"""


def test_a_non_root_driver_gets_the_user_namespace_jail():
    """A driver running as an ordinary user (a SLURM job, say): bwrap maps it to the sandbox's uid in a user
    namespace of its own; the code runs as that uid, cannot signal the driver or its user's processes (same uid
    outside, so the pid namespace is what stops it) and cannot read the user's files."""
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (to become an ordinary user) and /usr/bin/python3 (readable by that user)")
    home = tempfile.mkdtemp(prefix="scaletrain-nonroot-")
    try:
        os.chmod(home, 0o755)
        module = shutil.copy(sandbox.__file__, os.path.join(home, "sandbox.py"))  # the module uses the stdlib only
        secret = os.path.join(home, "secret")
        with open(secret, "w") as f:
            f.write("canary-of-the-user")
        os.chown(secret, 12345, 12345)
        os.chmod(secret, 0o600)  # the user's own file: readable by the user, and so by unjailed code
        as_user = ["setpriv", "--reuid=12345", "--regid=12345", "--clear-groups", "/usr/bin/python3", "-I", "-c"]
        done = subprocess.run([*as_user, NON_ROOT_DRIVER, module, secret], capture_output=True, text=True,
                              timeout=60, cwd=home)  # fmt: skip
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.splitlines()[-1])
    finally:
        shutil.rmtree(home)
    assert result["problem"] is None and result["victim"] is None, result  # the jail works; the victim lives
    assert result["out"].split() == ["FileNotFoundError", str(sandbox.SANDBOX_UID)], result
