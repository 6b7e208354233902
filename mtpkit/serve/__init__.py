"""`mtpkit serve`: an OpenAI-compatible HTTP server over the MTP engine.

    protocol.py   request validation and OpenAI-shaped responses and errors
    scheduler.py  one engine pool shared by every request: slots, turns, chunked prefill
    prometheus.py /metrics text with vLLM's metric names
    app.py        the FastAPI application, SSE streaming, startup and shutdown
    cli.py        the `mtpkit serve` subcommand
"""
