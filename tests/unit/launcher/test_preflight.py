"""What the launcher refuses before anything starts: its four ports (spec_decode.launcher.processes.port_problems: two
endpoints on one port, a port something listens on, a value that is no port; each named by its flag and variable), a
flag value out of range, and a speculator head made for another target (check_heads_fit)."""

import socket

import pytest

from spec_decode.launcher import __main__ as launcher
from spec_decode.launcher.processes import free_ports, port_problems


def test_free_distinct_ports_pass():
    ports = free_ports(4)
    assert port_problems(dict(zip("abcd", ports)), "127.0.0.1") == []


def test_two_endpoints_on_one_port_are_named():
    p = free_ports(1)[0]
    problems = port_problems({"--http-port / HTTP_PORT": p, "--openai-port / OPENAI_PORT": p}, "127.0.0.1")
    assert problems == [f"--openai-port / OPENAI_PORT {p} is also --http-port / HTTP_PORT: give each endpoint its "
                        f"own port"]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_port_something_listens_on_is_named(host):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        (problem,) = port_problems({"--grpc-port / GRPC_PORT": taken}, host)
    assert problem.startswith(f"--grpc-port / GRPC_PORT {taken} cannot be used on {host}: Address already in use")


def test_a_value_that_is_no_port_is_named():
    assert port_problems({"--metrics-port / METRICS_PORT": 70000}, "127.0.0.1") == [
        "--metrics-port / METRICS_PORT 70000 is not a TCP port (1-65535)"]


def test_the_launcher_refuses_a_clash_before_it_starts_anything(monkeypatch, capsys):
    """The scale-out example that once collided: HTTP on 9000 beside the OpenAI frontend's default 9000. Nothing is
    prepared or started (the model's conversion and tritonserver would come first)."""
    def started(*args, **kwargs):
        raise AssertionError("the launcher started something before refusing its ports")

    monkeypatch.setattr(launcher, "prepare_default_model", started)
    monkeypatch.setattr(launcher.TritonServer, "start", started)
    for var in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT"):
        monkeypatch.delenv(var, raising=False)
    http, grpc, metrics = free_ports(3)
    with pytest.raises(SystemExit) as e:
        launcher.main(["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                       "--openai-port", str(http)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--openai-port / OPENAI_PORT {http} is also --http-port / HTTP_PORT" in err, err
    # --no-openai: the frontend's port is not the launcher's to check
    with pytest.raises(SystemExit):
        launcher.main(["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                       "--openai-port", str(http), "--no-openai", "--kv-cache-max-tokens", "16"])
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert "OPENAI_PORT" not in error and "--kv-cache-max-tokens 16: at least 1024" in error, error


def test_the_launcher_refuses_a_head_made_for_another_target_before_it_starts_anything(monkeypatch, capsys,
                                                                                        tmp_path, real_model_dir):
    """README's old example: a published EAGLE-3 head (here one for a tiny target) beside the embedded SmolLM2. The
    launcher names the head, the target it was made for and the served target (check_heads_fit) and starts nothing;
    the same head with its own target (--model) passes the check."""
    import json

    from tests.speculator_checkpoints.eagle import write_eagle3

    head = tmp_path / "eagle3-for-tiny"
    write_eagle3(head, 32, 97, 4, 2, 64, 48, layer_ids=[0, 1, 1])
    monkeypatch.setattr(launcher.TritonServer, "start", _never)
    for var in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT", "MODEL", "SPECULATORS"):
        monkeypatch.delenv(var, raising=False)
    ports = [str(p) for p in free_ports(4)]
    flags = ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--openai-port", ports[3]]
    with pytest.raises(SystemExit) as e:
        launcher.main([*flags, "--speculator", str(head)])
    assert e.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert (f"--speculator / SPECULATORS: speculator head {head} (eagle3) was made for a target of hidden size 32 and "
            f"vocabulary 97, not for the served target {real_model_dir} (hidden size 576, vocabulary 49152)") in error
    # with its own target the check passes and the launcher goes on to start tritonserver (stopped here)
    tiny = tmp_path / "tiny-target"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                                                  "vocab_size": 97, "num_hidden_layers": 2}))
    monkeypatch.setattr("spec_decode.engine.model_loading.check_servable", lambda *a, **k: None)  # a config alone
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the launcher's copy of the repository
    with pytest.raises(AssertionError, match="started something"):
        launcher.main([*flags, "--model", str(tiny), "--speculator", str(head)])


def _never(*args, **kwargs):
    raise AssertionError("the launcher started something")


def _refusal(capsys, argv, monkeypatch, **env) -> str:
    """The one line the launcher refuses ``argv`` with (exit status 2), nothing started."""
    monkeypatch.setattr(launcher, "prepare_default_model", _never)
    monkeypatch.setattr(launcher.TritonServer, "start", _never)
    for var in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT", "SPECULATORS", "MODEL"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        launcher.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_port_variable_that_is_no_port_is_named_not_a_traceback(monkeypatch, capsys):
    """Kubernetes sets <SERVICE>_PORT=tcp://IP:PORT for the Services of a namespace: a Service named http would."""
    line = _refusal(capsys, [], monkeypatch, HTTP_PORT="tcp://10.0.0.1:8000")
    assert line.endswith("argument --http-port: 'tcp://10.0.0.1:8000' (the flag, or HTTP_PORT) is not a TCP port "
                         "(1-65535)"), line
    # the flag wins over the variable
    ports = [str(p) for p in free_ports(4)]
    line = _refusal(capsys, ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                             "--openai-port", ports[3], "--kv-cache-max-tokens", "8"], monkeypatch, HTTP_PORT="abc")
    assert "--kv-cache-max-tokens 8: at least 1024" in line, line


@pytest.mark.parametrize("host, why", [("nonexistent.invalid", "does not resolve"),
                                       ("192.0.2.1", "is not an address of this machine")])
def test_a_bad_host_is_named_once(monkeypatch, capsys, host, why):
    line = _refusal(capsys, ["--host", host], monkeypatch)
    assert line == f"python -m spec_decode.launcher: error: --host / HOST {host!r} {why}" + line.split(why, 1)[1]
    assert "PORT" not in line


def test_a_missing_model_repository_and_a_file_as_a_head_are_refused_before_the_models_conversion(
        monkeypatch, capsys, tmp_path):
    ports = [str(p) for p in free_ports(4)]
    flags = ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--openai-port", ports[3]]
    line = _refusal(capsys, [*flags, "--model-repository", str(tmp_path / "none")], monkeypatch)
    assert "--model-repository" in line and "not a model repository" in line, line
    file = tmp_path / "head.safetensors"
    file.write_bytes(b"")
    line = _refusal(capsys, [*flags, "--speculator", str(file)], monkeypatch)
    assert line.endswith(f"--speculator / SPECULATORS: not a folder: {file} (give a speculator folder: config.json "
                         f"and its weights; docs/speculators.md)"), line


def test_one_head_given_by_the_variable_and_the_flag_counts_once(monkeypatch, tmp_path, real_model_dir):
    from tests.speculator_checkpoints.eagle import write_eagle3

    head = tmp_path / "head"
    write_eagle3(head, 32, 97, 4, 2, 64, 48, layer_ids=[0, 1, 1])
    asked = []
    monkeypatch.setattr(launcher, "check_heads_fit", lambda path, target: asked.append(path) or _never())
    monkeypatch.setenv("SPECULATORS", str(head))
    ports = [str(p) for p in free_ports(4)]
    with pytest.raises(AssertionError, match="started something"):
        launcher.main(["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--openai-port",
                       ports[3], "--speculator", str(head)])
    assert asked == [f"auto,{head}"]
