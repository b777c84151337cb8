"""`python -m jaxgdn.serve`: an OpenAI-compatible server (FastAPI + uvicorn) over the jaxgdn engine.

  python -m jaxgdn.serve                                   # the shipped checkpoint on 127.0.0.1:8000
  python -m jaxgdn.serve --model DIR --num-speculative-tokens 1 --port 8000
  # PD as two processes: the decode server fetches each prompt's state from the prefill server
  python -m jaxgdn.serve --role prefill --port 8100
  python -m jaxgdn.serve --role decode --prefill-url http://127.0.0.1:8100 --port 8000

Endpoints: /v1/completions, /v1/chat/completions (stream=true for server-sent events), /v1/models, /health,
/metrics (Prometheus). Clients: the `openai` package (base_url http://HOST:PORT/v1), lm-evaluation-harness's
local-completions model, `python -m jaxgdn.bench serve --http URL`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..engine_args import add_engine_args, engine_config

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxgdn.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or preset (qwen3.5-0.8b = random weights, token-id "
                                    "prompts only); default: the checkpoint shipped in checkpoints/")
    ap.add_argument("--served-model-name", help="the model name clients send (default: the directory's or preset's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                    help="both (default): one server does everything (with --pd: two workers in this process); "
                         "prefill: serve /v1/prefill (prompt in, PD handoff bytes out) for a decode server; "
                         "decode: serve the OpenAI endpoints, prefilling on --prefill-url")
    ap.add_argument("--prefill-url", help="with --role decode: the prefill server's base URL (without it the decode "
                                          "server prefills prompts itself)")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="abort a request after this many seconds (HTTP 408; default: never)")
    ap.add_argument("--prefill-timeout", type=float, default=600.0,
                    help="with --prefill-url: seconds to wait for the prefill server's handoff before the request "
                         "fails with HTTP 504 (default %(default)s; --request-timeout bounds it too)")
    ap.add_argument("--max-waiting", type=int, default=4096,
                    help="requests queued beyond the running ones before new ones get HTTP 429 (default %(default)s)")
    ap.add_argument("--max-request-bytes", type=int, default=None,
                    help="refuse (HTTP 413) a request body larger than this, before parsing it (default: room for 16 "
                         "prompts of --max-model-len tokens, at least 1 MiB)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGINT/SIGTERM, seconds to let requests in flight finish before they are aborted")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(ap)
    return ap.parse_args(argv)


def build_state(args):
    """The engine(s) the role needs (every step program compiled unless --no-precompile), started behind an
    AsyncEngine, and the app's ServerState. Role "both" runs its engine in a process of its own
    (`engine_process`), so HTTP work never competes with it for the GIL; a PD role steps its worker in a
    thread of the server."""
    from .app import ServerState

    model = args.model
    if model is None:
        from ..generate import default_checkpoint

        model = default_checkpoint()
        if model is None:
            raise ValueError("no --model given and no checkpoint shipped in checkpoints/")
    if args.role == "both":
        from ..model.config import PRESETS
        from ..model.tokenizer import load_tokenizer
        from .engine_process import EngineClient

        front = EngineClient(str(model), engine_config(args),
                             max_waiting=args.max_waiting, log_level=args.log_level)
        tokenizer = None if str(model) in PRESETS else load_tokenizer(model)
    else:
        from ..llm import LLM
        from .async_engine import AsyncEngine

        llm = LLM(str(model), engine_config(args), role=args.role)
        front, tokenizer = AsyncEngine(llm.engine, llm.prefill_worker, max_waiting=args.max_waiting).start(), llm.tokenizer
    return ServerState(front=front, model_name=args.served_model_name or Path(str(model)).name,
                       tokenizer=tokenizer, role=args.role,
                       prefill_url=args.prefill_url if args.role == "decode" else None,
                       request_timeout=args.request_timeout, prefill_timeout=args.prefill_timeout,
                       max_request_bytes=args.max_request_bytes)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("jaxgdn").setLevel(args.log_level.upper())  # its handler is jaxgdn's own; uvicorn logs apart
    if args.prefill_url and args.role != "decode":
        print("jaxgdn.serve: --prefill-url needs --role decode", file=sys.stderr)
        return 2
    import uvicorn

    from ..model.checkpoint import CheckpointError
    from ..model.config import ConfigError
    from .app import build_app

    try:
        state = build_state(args)
    except (CheckpointError, ConfigError, ValueError, RuntimeError) as e:
        print(f"jaxgdn.serve: {e}", file=sys.stderr)
        return 2
    logging.getLogger("jaxgdn.serve").info("serving %s (role %s) on http://%s:%d", state.model_name, args.role,
                                           args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    state.on_engine_death = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.engine_died:
        print(f"jaxgdn.serve: exiting with status 1: the engine stopped ({state.front.error})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
