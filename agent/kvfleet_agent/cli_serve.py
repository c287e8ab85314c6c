"""`kvfleet-agent serve`: its flags (vLLM's spellings too, where the meaning matches) and the process it starts."""

from __future__ import annotations

import argparse
import logging
import os

import jinja2

from kvfleet_contract.metrics import METRICS_COMPAT_ENV, METRICS_COMPAT_VIEWS


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The serve subcommand's own flags (the engine's are added beside them by the caller)."""
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="Hugging Face model directory (vLLM's positional spelling of --model)")
    serve.add_argument("--model", default=None, help="Hugging Face model directory (or the positional MODEL)")
    serve.add_argument("--served-model-name", default=None, help="name clients use (default: the directory name)")
    serve.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="a directory with tokenizer.json, tokenizer_config.json (and its chat template) to use "
                            "instead of the model's, as vLLM; its EOS ids join the model's")
    serve.add_argument("--chat-template", default=None,
                       help="a jinja chat template replacing the checkpoint's: a file path, or the template itself "
                            "(backslash escapes such as \\n decoded, as vLLM)")
    serve.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                       help="request defaults, as vLLM: 'auto' takes temperature, top_p, top_k, min_p, "
                            "repetition_penalty (for requests that omit them) and a max_new_tokens cap from the "
                            "model's generation_config.json, DIR from that directory's; 'vllm': kvfleet's built-in "
                            "defaults (temperature 1, no cuts, no penalties)")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM compatibility: kvfleet never logs individual requests")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    serve.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free port, -1: off)")
    serve.add_argument("--max-queue-length", type=int, default=256,
                       help="waiting requests beyond which new ones get 429 / RESOURCE_EXHAUSTED")
    serve.add_argument("--drain-grace-period", type=float, default=30.0,
                       help="seconds accepted requests may take to finish after SIGTERM")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes and gRPC Generation calls "
                            "(/health, /ready, /metrics stay open); prefer the KVFLEET_API_KEY environment "
                            "variable, which process listings do not show")
    serve.add_argument("--max-logprobs", type=int, default=20,
                       help="the most alternatives per token a request may ask for (logprobs, top_logprobs, "
                            "prompt_logprobs), as vLLM")
    serve.add_argument("--metrics-compat", default="kvfleet", metavar="{kvfleet,vllm}",
                       help="the families /metrics serves: kvfleet's only, or vllm: vLLM's vllm:* families (named "
                            "and labelled as vLLM's) beside them (default from KVFLEET_METRICS_COMPAT)")
    conn = serve.add_argument_group("connections")
    conn.add_argument("--max-connections", type=int, default=1024,
                      help="open connections per front end (HTTP, gRPC); HTTP answers more with 503")
    conn.add_argument("--keep-alive-timeout", type=float, default=75.0,
                      help="seconds a connection may sit without a request before it is closed")
    conn.add_argument("--header-timeout", type=float, default=20.0,
                      help="seconds from a request's first byte to its complete head (slow clients are closed)")
    conn.add_argument("--body-timeout", type=float, default=60.0,
                      help="seconds for a request body to arrive whole (else 408)")


def model_of(a: argparse.Namespace) -> str:
    """The model directory, from the positional MODEL or --model (KVFLEET_MODEL sets --model's default)."""
    if a.model_tag is not None and a.model is not None and a.model_tag != a.model:
        raise ValueError(f"the model is given twice, as MODEL ({a.model_tag}) and --model ({a.model}): give one")
    model = a.model_tag or a.model
    if not model:
        raise ValueError("the model is required: kvfleet-agent serve MODEL (or --model MODEL, or KVFLEET_MODEL)")
    return str(model)


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's contents, else the value itself with backslash escapes decoded."""
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except OSError as e:
        # As vLLM: a value with none of a template's characters was meant as a path, so say that it failed.
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path but cannot be read ({e.strerror}); "
                             "give a readable file or the template itself") from None
        # Characters past Latin-1 become \\uXXXX first, so that decoding the escapes gives them back unchanged.
        template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template {value}: the file is not UTF-8 text ({e.reason})") from None
    try:  # syntax only: rendering needs messages, and a template may refuse some on purpose
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template has a jinja syntax error at line {e.lineno}: {e.message}") from None
    return template


def metrics_compat_of(a: argparse.Namespace) -> str:
    """--metrics-compat, checked before the model loads (an empty KVFLEET_METRICS_COMPAT means kvfleet)."""
    value = a.metrics_compat or "kvfleet"
    if value not in METRICS_COMPAT_VIEWS:
        # Named both ways: the value may have come from the environment (a pod spec) rather than the command line.
        raise ValueError(f"--metrics-compat {value!r} (or {METRICS_COMPAT_ENV}) must be one of "
                         f"{', '.join(METRICS_COMPAT_VIEWS)}: kvfleet serves kvfleet's families only, vllm adds "
                         "vLLM's vllm:* families")
    return str(value)


def run_serve(a: argparse.Namespace, engine_options: dict[str, object]) -> int:
    """Check the flags, then serve until SIGTERM; returns the process's exit code."""
    import asyncio

    from kvfleet_agent.config import EngineConfig
    from kvfleet_agent.server.connections import ConnectionLimits
    from kvfleet_agent.server.lifecycle import ServeOptions, serve
    from kvfleet_agent.server.request_defaults import load_request_defaults

    for name, value, low in (("--max-queue-length", a.max_queue_length, 0),
                             ("--drain-grace-period", a.drain_grace_period, 0), ("--max-logprobs", a.max_logprobs, 0)):
        if value < low:
            raise ValueError(f"{name}={value} must be >= {low}")
    model = model_of(a)
    if a.tokenizer is not None and not os.path.isfile(os.path.join(a.tokenizer, "tokenizer.json")):
        raise ValueError(f"--tokenizer {a.tokenizer}: that directory has no tokenizer.json; name one that has, or "
                         "leave --tokenizer out (the model's)")
    metrics_compat = metrics_compat_of(a)
    defaults = load_request_defaults(a.generation_config or "auto", model)  # a bad file fails before the model loads
    chat_template = None
    if a.chat_template is not None:
        chat_template = load_chat_template(a.chat_template)
        if not os.path.isfile(os.path.join(a.tokenizer or model, "tokenizer.json")):
            raise ValueError(f"--chat-template needs a tokenizer, and {a.tokenizer or model} has no tokenizer.json")
    if a.api_key == "":
        logging.getLogger("kvfleet_agent").warning("the API key is set but empty: the API is open to all")
    limits = ConnectionLimits(a.max_connections, a.keep_alive_timeout, a.header_timeout, a.body_timeout)
    opts = ServeOptions(a.served_model_name or os.path.basename(os.path.normpath(model)), a.host, a.port,
                        None if a.grpc_port < 0 else a.grpc_port, a.max_queue_length, a.drain_grace_period,
                        api_key=a.api_key or None, limits=limits, max_logprobs=a.max_logprobs,
                        chat_template=chat_template, metrics_compat=metrics_compat, request_defaults=defaults)
    return asyncio.run(serve(EngineConfig.from_kwargs(model, tokenizer=a.tokenizer, **engine_options), opts))
