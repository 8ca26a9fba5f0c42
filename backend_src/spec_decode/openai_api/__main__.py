"""``python -m spec_decode.openai_api``: serve the OpenAI-compatible API in front of a running Triton's ``generate``.

The launcher starts it beside tritonserver (``OPENAI_PORT``, default 9000, on the launcher's HOST); run by hand it
needs Triton's gRPC address. docs/openai.md lists the routes and parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PORT = 9000


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, load the tokenizer, serve until interrupted.

    Returns:
        0 after Ctrl-C or SIGTERM; 2 for a bad argument (argparse).
    """
    ap = argparse.ArgumentParser(prog="python -m spec_decode.openai_api", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--grpc-url", default=os.environ.get("TRITON_GRPC_URL", "127.0.0.1:8001"),
                    help="Triton's gRPC endpoint, host:port")
    ap.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", DEFAULT_PORT)))
    ap.add_argument("--tokenizer", default="default",
                    help="the target's model folder (its tokenizer and chat template); 'default': the embedded target")
    ap.add_argument("--served-model-name", action="append", default=[],
                    help="a name clients may send as 'model' (repeatable; default: the tokenizer folder's name)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                    help="require 'Authorization: Bearer KEY' on /v1 routes (default: OPENAI_API_KEY; empty: none)")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    ap.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    ap.add_argument("--http", choices=("httptools", "h11"), default="httptools",
                    help="uvicorn's HTTP/1.1 parser: httptools (C, the default) or h11 (pure Python)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the event loop: uvloop (the default) or the standard library's asyncio")
    args = ap.parse_args(argv)

    import uvicorn

    from ..engine.model_loading import load_tokenizer, resolve_model_path
    from .app import Served, build_app, served_name
    from .triton import TritonGenerate

    path = resolve_model_path(args.tokenizer)
    if path is None:
        ap.error("--tokenizer: give the target's model folder (or 'default')")
    served = Served(TritonGenerate(args.grpc_url), load_tokenizer(path),
                    tuple(args.served_model_name) or (served_name(path),), api_key=args.api_key or None,
                    max_body_bytes=args.max_body_bytes)
    uvicorn.run(build_app(served), host=args.host, port=args.port, log_level="warning", access_log=args.access_log,
                http=args.http, loop=args.loop, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
