"""The launcher's OpenAI frontend process: its command line, where the API key goes, the tokenizer it is given
(the real process, restarts and health: tests/integration/test_openai.py)."""

import shutil
import subprocess

from spec_decode.launcher import frontend as fe_mod
from spec_decode.launcher import prepare_repository
from spec_decode.launcher.frontend import OpenAIFrontend, tokenizer_path


def test_command_line_names_and_key_in_the_environment(monkeypatch):
    seen = {}

    class Popen:
        def __init__(self, cmd, env, stdout, stderr, preexec_fn):
            seen.update(cmd=cmd, env=env, preexec_fn=preexec_fn)
            self.pid = 1

    monkeypatch.setattr(subprocess, "Popen", Popen)
    fe = OpenAIFrontend("127.0.0.1:1", 9123, "0.0.0.0", "/models/t", api_key="k3y", served_names=("a", "b")).start()
    cmd = seen["cmd"]
    assert cmd[1:3] == ["-m", "spec_decode.openai_api"] and "k3y" not in " ".join(cmd)
    assert seen["env"]["OPENAI_API_KEY"] == "k3y"
    assert cmd[cmd.index("--port") + 1] == "9123" and cmd[cmd.index("--grpc-url") + 1] == "127.0.0.1:1"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--served-model-name"] == ["a", "b"]
    assert fe.served_name == "a" and fe.url == "http://127.0.0.1:9123"
    assert seen["preexec_fn"] is fe_mod._die_with_parent  # it goes when the launcher goes


def test_tokenizer_is_generates(tmp_path):
    assert tokenizer_path(fe_mod.REPO_ROOT / "model_repository") == "default"
    repo = prepare_repository({"generate": {"tokenizer_path": str(tmp_path)}})
    try:
        assert tokenizer_path(repo) == str(tmp_path)
    finally:
        shutil.rmtree(repo)


def test_nothing_listening_is_no_health():
    from spec_decode.launcher import free_ports

    assert OpenAIFrontend("127.0.0.1:1", free_ports(1)[0]).health() is None


def test_the_frontend_serves_on_httptools_and_uvloop_unless_told_otherwise(monkeypatch):
    """uvicorn gets the C parser and uvloop by default (both installed by the set-up: the layer's first-token cost,
    docs/benchmarks.md); ``--http h11 --loop asyncio`` (extra_args) gives the pure-Python ones."""
    import types

    import uvicorn

    import spec_decode.openai_api.__main__ as main_mod

    __import__("httptools"), __import__("uvloop")  # what the defaults need is there
    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    assert main_mod.main(["--grpc-url", "127.0.0.1:1"]) == 0
    assert main_mod.main(["--grpc-url", "127.0.0.1:1", "--http", "h11", "--loop", "asyncio"]) == 0
    assert [(r["http"], r["loop"]) for r in runs] == [("httptools", "uvloop"), ("h11", "asyncio")]
    seen = {}
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: seen.update(cmd=cmd) or types.SimpleNamespace(pid=1))
    OpenAIFrontend("127.0.0.1:1", 9123, extra_args=("--http", "h11")).start()
    assert seen["cmd"][-2:] == ["--http", "h11"]
