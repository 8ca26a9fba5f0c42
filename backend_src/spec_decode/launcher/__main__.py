"""The launcher's command line: serve the model repository with tritonserver until interrupted.

``python -m spec_decode.launcher`` is what ``make serve`` and the Docker image run. It prepares the default model,
starts tritonserver (the one on PATH, or the embedded one from nvidia-pytriton) on HOST (default 127.0.0.1) with
HTTP_PORT, GRPC_PORT and METRICS_PORT (defaults 8000, 8001, 8002), waits until every model is READY, starts the
OpenAI-compatible frontend on OPENAI_PORT (default 9000; :mod:`spec_decode.openai_api`) and waits for it, prints the
ports, the speculative methods served and client commands, and serves until Ctrl-C or SIGTERM, healing model
processes (and the frontend) that die. docs/deployment.md covers health checks, faults and healing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

from ..engine.model_loading import default_model_dir, prepare_default_model
from ..proposers.speculators import check_heads_fit
from .frontend import OpenAIFrontend, tokenizer_path
from .processes import port_problems
from .repository import (
    DEFAULT_REPOSITORY,
    DEVICES,
    DTYPES,
    check_flag_values,
    draft_overrides,
    model_overrides,
    prepare_repository,
    served_dtype,
    served_methods,
    served_speculators,
)
from .server import TritonServer


def main(argv: list[str] | None = None) -> int:
    """Prepare the model, start tritonserver, print the ports once every model is READY, serve until stopped.

    While serving, a model process that dies is brought back (:class:`~spec_decode.launcher.healer.Healer`).

    Args:
        argv: the command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 after Ctrl-C or SIGTERM (tritonserver is stopped first); 1 when a model fails to load
        (tritonserver's log names it and why); when tritonserver dies by itself, or the healer could not restart it,
        the non-zero status of :func:`exit_status`.

    Raises:
        SystemExit: status 2, with one line naming the setting, before anything starts: a bad flag or variable, a
            host that does not resolve, ports that clash or are in use, a missing model repository, a speculator
            path that is not a folder or a head made for another target (docs/deployment.md lists them).
    """
    ap = argparse.ArgumentParser(prog="python -m spec_decode.launcher", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--http-port", type=_port("HTTP_PORT"), default=os.environ.get("HTTP_PORT", "8000"), metavar="PORT")
    ap.add_argument("--grpc-port", type=_port("GRPC_PORT"), default=os.environ.get("GRPC_PORT", "8001"), metavar="PORT")
    ap.add_argument("--metrics-port", type=_port("METRICS_PORT"), default=os.environ.get("METRICS_PORT", "8002"),
                    metavar="PORT")
    ap.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    ap.add_argument("--model", default=os.environ.get("MODEL", ""), metavar="PATH_OR_ID",
                    help="the target: a model folder, or a Hugging Face id resolved offline from the local cache "
                         "(HF_HOME / HF_HUB_CACHE; never downloaded); sets target_model's model_path, the tokenizers "
                         "and the OpenAI model name (default: the embedded SmolLM2-135M-Instruct; MODEL=...)")
    ap.add_argument("--dtype", choices=DTYPES, default=os.environ.get("DTYPE", ""),
                    help="the target's, draft LM's and heads' dtype (default: the configs' auto: bfloat16 on a GPU and "
                         "on a CPU that multiplies it natively, else float32; DTYPE=...)")
    ap.add_argument("--device", choices=DEVICES, default="", help="the target's and draft's device (default: auto)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="prompt + output positions per sequence, at most the model's (default: generate's config)")
    ap.add_argument("--kv-cache-max-tokens", type=int, default=0,
                    help="positions of the target's paged KV pool (default: target_model's config)")
    ap.add_argument("--draft-model", default=os.environ.get("DRAFT_MODEL", ""),
                    help="draft LM folder (or 'default' for the target itself) to enable speculative_method=draft")
    speculators = [p for p in os.environ.get("SPECULATORS", "").split(":") if p.strip()]
    ap.add_argument("--speculator", action="append", default=speculators, metavar="PATH",
                    help="a speculator folder in a published layout (EAGLE, EAGLE-3, Medusa, MLP speculator, Arctic), "
                         "served as the method its layout names beside the head make speculator trains (replacing it "
                         "when of the same method); repeatable; SPECULATORS=PATH[:PATH...]")
    ap.add_argument("--openai-port", type=_port("OPENAI_PORT"), default=os.environ.get("OPENAI_PORT", "9000"),
                    metavar="PORT",
                    help="port of the OpenAI-compatible frontend (/v1/completions, /v1/chat/completions)")
    ap.add_argument("--no-openai", action="store_true", help="serve Triton's endpoints alone")
    ap.add_argument("--api-key-file", type=Path, default=os.environ.get("OPENAI_API_KEY_FILE") or None,
                    help="read the API key from this file (a mounted Secret: kept out of the process's arguments "
                         "and environment); OPENAI_API_KEY_FILE")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                    help="the OpenAI frontend demands 'Authorization: Bearer KEY' (default: OPENAI_API_KEY; none)")
    ap.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                    help="a model name OpenAI clients send (repeatable; default: the target's folder name)")
    ap.add_argument("--log-verbose", type=int, default=0)
    ap.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"),
                    help="address to listen on (0.0.0.0 in a container)")
    args = ap.parse_args(argv)
    if args.api_key_file is not None:
        try:
            args.api_key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            ap.error(f"--api-key-file {str(args.api_key_file)!r}: {e.strerror or e}")
        if not args.api_key:
            ap.error(f"--api-key-file {str(args.api_key_file)!r} is empty")

    ports = {"--http-port / HTTP_PORT": args.http_port, "--grpc-port / GRPC_PORT": args.grpc_port,
             "--metrics-port / METRICS_PORT": args.metrics_port}
    if not args.no_openai:
        ports["--openai-port / OPENAI_PORT"] = args.openai_port
    clashes = port_problems(ports, args.host)
    if clashes:  # before anything starts: tritonserver or the frontend would fail later, after the model loads
        _refuse("; ".join(clashes))
    try:
        check_flag_values(args.dtype, args.device, args.max_model_len, args.kv_cache_max_tokens)
    except ValueError as e:
        _refuse(str(e))
    if not (args.model_repository / "generate" / "config.pbtxt").is_file():
        _refuse(f"--model-repository {str(args.model_repository)!r}: not a model repository (no generate/config.pbtxt)")
    # the speculator folders given (SPECULATORS, then each --speculator; an empty value such as --speculator=$(UNSET)
    # gives none; a folder given twice counts once), checked as folders before the model's conversion
    paths = list(dict.fromkeys(str(Path(p).expanduser().resolve()) for p in args.speculator if p.strip()))
    missing = [p for p in paths if not Path(p).is_dir()]
    if missing:
        _refuse(f"--speculator / SPECULATORS: not a folder: {', '.join(missing)} (give a speculator folder: "
                f"config.json and its weights; docs/speculators.md)")

    embedded = not args.model or args.model.strip().lower() == "default"  # the embedded target, its draft and head
    if embedded:  # another target needs no embedded model
        prepare_default_model()

    # kill, systemd, supervisors: stop tritonserver too, as Ctrl-C does. SIGINT too, explicitly: a launcher started in
    # the background of a script inherits SIGINT ignored, and tritonserver (which does not) would stop alone and be
    # restarted by the healer
    def _terminate(signum: int, frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    overrides: dict[str, dict[str, str]] = {}
    target_folder = default_model_dir()  # the served target's folder (--model's, below)
    served_names = tuple(args.served_model_name)
    if args.model or args.dtype or args.device or args.max_model_len or args.kv_cache_max_tokens:
        try:  # before tritonserver starts: its log would bury the same error
            overrides, target_folder, name = model_overrides(args.model or "default", args.dtype, args.device,
                                                             args.max_model_len, args.kv_cache_max_tokens)
        except (ValueError, FileNotFoundError) as e:
            ap.error(str(e))
        if embedded:  # the embedded target keeps its draft and head
            overrides["draft_model"] = {k: v for k, v in overrides["draft_model"].items()
                                        if k not in ("draft_model_path", "speculator_path")}
        served_names = served_names or (name,)
    for model, params in (draft_overrides(args.draft_model) if args.draft_model else {}).items():
        overrides.setdefault(model, {}).update(params)
    if paths:
        # the head make speculator trains ("auto") is the embedded target's: not beside another model
        speculator_path = ",".join([*(["auto"] if embedded else []), *paths])
        try:  # before tritonserver starts: draft_model's load would fail later, after the target's
            check_heads_fit(speculator_path, target_folder)
        except ValueError as e:  # a head made for another target (naming both), or a layout none of the loaders reads
            _refuse(f"--speculator / SPECULATORS: {e}")
        overrides.setdefault("draft_model", {})["speculator_path"] = speculator_path
    repo = prepare_repository(overrides, args.model_repository)
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port, log_verbose=args.log_verbose,
                          host=args.host)
    server.start()
    frontend = None
    try:
        try:
            server.wait_ready()
        except RuntimeError as e:  # a model failed to load (e.g. a config parameter out of range)
            print(f"spec_decode.launcher: {str(e).splitlines()[0]} before every model was ready; tritonserver's log "
                  f"above names the model that failed to load and why (look for 'failed to load' and 'config "
                  f"parameter')", file=sys.stderr, flush=True)
            return 1
        openai_line = ""
        if not args.no_openai:
            frontend = OpenAIFrontend(server.grpc_url, args.openai_port, args.host, tokenizer_path(repo),
                                      args.api_key, served_names=served_names).start()
            try:
                frontend.wait_ready()
            except RuntimeError as e:
                print(f"spec_decode.launcher: {e}", file=sys.stderr, flush=True)
                return 1
            openai_line = f"  OpenAI  {frontend.url}/v1{'  (API key required)' if args.api_key else ''}\n"
        print(
            f"\nAll models READY.\n  HTTP    http://{server.http_url}\n  gRPC    {server.grpc_url}\n"
            f"  metrics http://{server.metrics_url}/metrics\n{openai_line}"
            f"  dtype   {served_dtype(repo)}\n"
            f"  speculative_method: {served_methods(repo)}\n{served_speculators(repo)}\nTry:\n"
            f"  .venv/bin/python -m client.generate --url {server.grpc_url} --humaneval 1 --max-tokens 128\n"
            + (_curl_hint(frontend) if frontend is not None and not args.api_key else ""),
            flush=True,
        )
        return exit_status(server.wait())
    except KeyboardInterrupt:
        return 0
    finally:
        if frontend is not None:
            frontend.stop()
        server.stop()


def _port(variable: str):
    """argparse's type for a port flag whose default comes from ``variable``: an int in 1-65535, else an error naming
    the flag's variable too (the value may have come from the environment)."""
    def parse(value: str) -> int:
        try:
            port = int(value)
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise argparse.ArgumentTypeError(f"{value!r} (the flag, or {variable}) is not a TCP port (1-65535)")
        return port

    return parse


def _refuse(message: str) -> NoReturn:
    """Refuse to start: one line on stderr (without argparse's usage, which says nothing of a value from the
    environment) and exit status 2, as argparse's own errors."""
    print(f"python -m spec_decode.launcher: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _curl_hint(frontend: OpenAIFrontend) -> str:
    """The banner's line of a chat request to the OpenAI frontend."""
    body = {"model": frontend.served_name, "max_tokens": 64,
            "messages": [{"role": "user", "content": "Write a haiku about Triton."}]}
    return f"  curl {frontend.url}/v1/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'\n"


def exit_status(code: int) -> int:
    """The launcher's exit status when tritonserver exited by itself (not by Ctrl-C or SIGTERM to the launcher), with
    the reason printed to stderr.

    Args:
        code: ``Popen.returncode`` of tritonserver (negative: killed by that signal).

    Returns:
        Never 0, so that a supervisor (systemd ``Restart=on-failure``, Kubernetes) restarts the whole server: ``code``
        for an exit with a non-zero code, 1 for an exit with 0, 128 + the signal number for a kill.
    """
    if code < 0:
        try:
            why = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            why = f"killed by signal {-code}"
        status = 128 - code
    else:
        why, status = f"exited with code {code}", code or 1
    print(f"tritonserver {why} while serving; the launcher exits with status {status} so that a supervisor restarts "
          f"it", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
