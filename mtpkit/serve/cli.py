"""The `mtpkit serve` subcommand; the server's machinery is imported only when it runs."""

from __future__ import annotations

from ..builtin import MODEL_HELP


def add_parser(sub) -> None:
    """Register `mtpkit serve`."""
    p = sub.add_parser(
        "serve",
        help="serve a model through an OpenAI-compatible HTTP API with MTP",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) with MTP speculative decoding and "
                    "interleaved scheduling of concurrent requests.",
    )
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--head", help="an MTP head folder (from `mtpkit calibrate`) to use")
    p.add_argument("--served-model-name",
                   help="the name clients send as 'model' (default: the --model argument)")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=1,
                   help="draft tokens per step (default 1, as generate; 0 = no speculation)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="requests decoded concurrently (engine slots, default 8)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait for a slot; more get 429 (default 256)")
    p.add_argument("--max-model-len", type=int,
                   help="context limit, prompt plus output (default: the model's)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per scheduling turn, so that a long prompt "
                        "does not stall running streams (default 256)")
    p.add_argument("--no-packed", action="store_true",
                   help="run each sequence's trunk forward alone instead of one forward for "
                        "all running sequences per step (for comparison)")
    p.add_argument("--compile", choices=["auto", "off", "aoti", "eager"], default="auto",
                   help="requests run the programs `mtpkit generate` runs (auto, the "
                        "default: compiled where `mtpkit warmup` built them, else uncompiled; "
                        "aoti: build any missing before serving; eager: never compiled; off: "
                        "every request on the eager engine)")
    p.add_argument("--no-background-build", action="store_true",
                   help="with --compile auto, do not build missing compiled programs in a "
                        "low-priority background process (`mtpkit warmup`) while serving")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    p.add_argument("--full-draft-vocab", action="store_true",
                   help="draft over the whole vocabulary, not the head's frequent-token subset")
    p.add_argument("--stall-timeout", type=float, default=120.0,
                   help="/health answers 503 when the engine has had work but made no "
                        "progress for this many seconds (default 120)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM (default 10)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body accepted; larger ones get 413 (default 4 MiB)")
    p.add_argument("--default-max-tokens", type=int, default=2048,
                   help="output limit of a request that sets no max_tokens (default 2048; "
                        "0: the rest of the context)")
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a connection has to send a request's headers before it is "
                        "closed (default 30)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections served at once; requests over it get 503 "
                        "(default 1024)")
    p.add_argument("--chat-special-tokens", choices=["text", "parse"], default="text",
                   help="control-token spellings (<|im_start|>) in chat messages: plain text "
                        "(default, so a user cannot forge role markers) or control tokens "
                        "(parse, as vLLM does); /v1/completions prompts always parse them")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    from ..cli import threads_arg

    threads_arg(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(a) -> int:
    from .app import ServeConfig, run

    cfg = ServeConfig(
        model=a.model, head=a.head, served_model_name=a.served_model_name,
        num_draft_tokens=a.num_draft_tokens, host=a.host, port=a.port, api_key=a.api_key,
        max_num_seqs=a.max_num_seqs, max_queue=a.max_queue, max_model_len=a.max_model_len,
        prefill_chunk=a.prefill_chunk, packed=not a.no_packed, compile=a.compile,
        device=a.device, dtype=a.dtype,
        full_draft_vocab=a.full_draft_vocab, stall_timeout=a.stall_timeout,
        shutdown_timeout=a.shutdown_timeout, max_request_bytes=a.max_request_bytes,
        default_max_tokens=a.default_max_tokens, header_timeout=a.header_timeout,
        max_connections=a.max_connections, chat_special_tokens=a.chat_special_tokens,
        log_level=a.log_level, background_build=not a.no_background_build,
        threads=a.threads,
    )
    cfg.validate()
    if a.model is not None:
        from pathlib import Path

        if not Path(a.model).exists():
            raise FileNotFoundError(f"--model {a.model}: no such file or folder")
    return run(cfg)
