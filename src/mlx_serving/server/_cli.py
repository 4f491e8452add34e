"""``mlx-serving serve``: its options and how it starts (FastAPI and uvicorn imported only when it runs).

The models load on a thread after the server started listening (``/health`` answers 503 until they
are ready); ``--workers 1`` serves each model through a started handle (``Serving.start``), more
through a ``ServingPool`` of that many worker processes: the app holds either as a ``Client``. A
checkpoint that ships sentence-transformers' pooling files (or a GGUF file that declares llama.cpp's
``pooling_type``) is served as a text-embedding model (``/v1/embeddings``), any other as a
text-generation one; ``--model A --model B`` serves both side by side, each under its
``--served-model-name``. With ``--load-on-demand`` (implied by a ``--keep-alive`` other than never,
or by a ``--max-loaded-models`` below the number of models) each model loads at its first request.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import logging
import math
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._keep_alive import NEVER, parse_keep_alive
from ._malloc import tune_malloc

if TYPE_CHECKING:
    from ..serving import Client, Serving
    from ..tokenization import Tokenizer
    from ._models import Lazy, ServedModel

__all__ = ["API_KEY_ENV", "add_engine_arguments", "add_parser", "engine_options", "run"]

API_KEY_ENV = "MLX_SERVING_API_KEY"
_log = logging.getLogger("mlx_serving.server")
_SERVE_MAX_NEW_TOKENS = 256  # --max-new-tokens' default (capped at half of --max-len)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``mlx-serving`` command's subparsers."""
    p = subparsers.add_parser(
        "serve", formatter_class=formatter_class, help="OpenAI-compatible HTTP server (needs mlx-serving[server])",
        description="Serve models over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/responses, "
                    "/v1/embeddings, /v1/models) and vLLM's /tokenize and /detokenize, with /health, Prometheus /metrics and a chat "
                    "page at /. Needs the 'server' extra.")
    p.add_argument("--model", action="append", default=None, metavar="MODEL",
                   help="a checkpoint directory, a .gguf file, a Hugging Face repo id org/name[@revision], a packaged "
                        "model's name or seeded:<family>-<preset> (repeatable: one served model each; a checkpoint with "
                        "sentence-transformers' 1_Pooling/config.json, or a .gguf with a pooling_type, is served for "
                        "/v1/embeddings; default: "
                        "smollm2-135m-instruct, fetched and converted on first use; docs/models.md)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="the model's id in the API, one per --model (default: the repo id, the directory's or "
                        "file's name, or the packaged model's name)")
    p.add_argument("--embedding-max-len", type=int, default=None, metavar="TOKENS",
                   help="tokens per input of an embedding model (one that ships sentence-transformers' "
                        "1_Pooling/config.json; default: its max_seq_length, else 512)")
    p.add_argument("--embedding-batch", type=int, default=None, metavar="N",
                   help="most inputs per forward of an embedding model (per worker) (default: 32, or --max-queue "
                        "when smaller)")
    p.add_argument("--load-on-demand", action="store_true",
                   help="load each model at its first request, not at start (implied by a --keep-alive other "
                        "than never, or by a --max-loaded-models below the number of models)")
    p.add_argument("--keep-alive", type=_keep_alive, default=None, metavar="DURATION",
                   help="how long a model loaded on demand stays loaded once idle: seconds or a duration (30s, 5m, "
                        "1h30m); -1 or never: until evicted (default); a request's keep_alive field overrides it")
    p.add_argument("--max-loaded-models", type=_at_least_one, default=None, metavar="N",
                   help="most models loaded at once; past it the least recently used idle one is unloaded "
                        "(default: all of them)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes per model: 1 = a started serving in this process, N > 1 = a ServingPool")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set, else none)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default max_tokens of a request that gives none, capped per request to what its prompt "
                        f"leaves of --max-len (default: {_SERVE_MAX_NEW_TOKENS}, or half of --max-len when smaller)")
    p.add_argument("--max-len", type=int, default=2048, help="KV-cache positions per sequence (prompt + new tokens)")
    add_engine_arguments(p, rows=True)
    p.add_argument("--max-queue", type=int, default=512,
                   help="rows waiting (per worker) before requests are refused with 503 + Retry-After")
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="sampling defaults of a request that names none: 'auto' (vLLM's): the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), "
                        "else OpenAI's (temperature 1, top_p 1); 'vllm': OpenAI's, ignoring the file")
    p.add_argument("--temperature", type=float, default=None,
                   help="default temperature of a request that gives none, over --generation-config (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None,
                   help="default top_p of a request that gives none, over --generation-config")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take before it is withdrawn (504; default: no limit)")
    p.add_argument("--stuck-after", type=float, default=60.0,
                   help="/health answers 503 when a model holds rows without progress for this many seconds")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                   help="an origin (https://host:port, or *) whose web pages may call the API (CORS; repeatable; "
                        "default: none)")
    p.add_argument("--shutdown-grace", type=_seconds(0), default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, seconds open streams may go on before each is ended with an error "
                        "event and [DONE]")
    p.add_argument("--client-timeout", type=_seconds(0, open_low=True), default=30.0, metavar="SECONDS",
                   help="seconds a client may take to send a request's headers or body; a connection that sends "
                        "no request for that long is closed")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's and the server's log level")
    p.set_defaults(run=run)
    return p


def _optional_bytes(text: str) -> int | None:
    """An argparse type: a byte count, or "none"."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count or 'none'") from None


#: The engine's flags, each named after its ``GenerationOptions`` field (its ``dest``), vLLM's name
#: first where vLLM has one: ``(flags, argparse keywords)``; the default is the field's.
_ENGINE_FLAGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--prefill-chunk",), dict(type=int, help="prompt tokens per sequence per engine step (chunked prefill)")),
    (("--max-num-batched-tokens", "--max-step-tokens"), dict(
        dest="max_step_tokens", type=int, metavar="TOKENS",
        help="per-step token budget shared by decode rows and prefill chunks; waiting prompts start while it has "
             "room (default: 2048 where shapes are bucketed, a GPU; 512 on the CPU; else none)")),
    (("--kv-cache-memory-bytes", "--kv-cache-bytes"), dict(
        dest="kv_cache_bytes", type=int, metavar="BYTES",
        help="KV-cache budget in bytes (default: --kv-cache-fraction, else 1 GiB on the CPU, half the available "
             "memory on a GPU)")),
    (("--kv-cache-fraction",), dict(
        type=float, metavar="FRACTION",
        help="KV-cache budget as a fraction of available memory (default: 1 GiB on the CPU, half on a GPU)")),
    (("--kv-cache-dtype",), dict(
        choices=("auto", "float32", "float16", "bfloat16", "int8", "int4"),  # kv_cache.KV_CACHE_DTYPES (not imported: mlx)
        help="what the KV blocks hold: auto (the activation dtype; float16 under the native CPU decode step), "
             "float32, float16 or bfloat16 (half a float32 cache), int8 or int4 (quantized K/V: more blocks in the budget, "
             "approximate; on the CPU no slower, on a GPU much slower today: keep auto there)")),
    (("--enable-prefix-caching",), dict(
        dest="prefix_caching", action=argparse.BooleanOptionalAction,
        help="reuse the KV blocks of cached prompt prefixes")),
    (("--block-size",), dict(type=int, help="tokens per KV block")),
    (("--buffer-cache-bytes",), dict(
        type=_optional_bytes, metavar="BYTES",
        help="bound on MLX's buffer cache of freed buffers ('none': MLX's own)")),
    (("--decode-path",), dict(
        choices=("fused", "matmul", "native", "sdpa"),  # decode_backends.DECODE_PATHS (not imported: mlx)
        help="how one-token rows run (default: the fused CUDA kernels where they run and fit, else native "
             "where it applies, else matmul; native: the CPU decode step with int8-activation products, "
             "approximate; matmul: the exact float path)")),
    (("--compile-decode",), dict(
        action=argparse.BooleanOptionalAction,
        help="run decode steps through compiled graphs (default: with the fused decode path only)")),
    (("--bucket-shapes",), dict(
        action=argparse.BooleanOptionalAction,
        help="pad steps to shape buckets, all built at start (default: on a GPU, off on the CPU)")),
    (("--pack-prefill",), dict(
        action=argparse.BooleanOptionalAction,
        help="run a multi-row prefill as one packed row (default: the runner decides)")),
    (("--max-causal-groups",), dict(type=int, help="most causal groups of one packed prefill's attention")),
    (("--speculative-config",), dict(
        metavar="JSON",
        help='speculative decoding as vLLM names it, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": '
             'DRAFT, "num_speculative_tokens": 4}\' (default: off; docs/generation.md)')),
)


#: The flags of an engine serving many sequences (``serve``), before :data:`_ENGINE_FLAGS`.
_ROWS_FLAGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--max-batch", "--max-num-seqs"), dict(
        dest="max_batch", type=int, help="most sequences decoding at once (per worker)")),
    (("--policy", "--scheduling-policy"), dict(
        choices=("fcfs", "priority"),
        help="scheduling: first come first served, or by each request's priority (lower first)")),
)


def _dest(names: tuple[str, ...], kw: dict[str, Any]) -> str:
    return str(kw.get("dest", names[0].lstrip("-").replace("-", "_")))


def add_engine_arguments(p: argparse.ArgumentParser, *, rows: bool) -> None:
    """Add the text-generation engine's flags (docs/generation.md) to ``p``, each with its
    ``GenerationOptions`` default; ``rows``: with ``--max-batch`` / ``--max-num-seqs`` and
    ``--policy`` (``serve``; ``generate`` and ``chat`` run one sequence). :func:`engine_options`
    reads them back."""
    from ..models.text_generation import GenerationOptions

    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(GenerationOptions)}  # a factory's: the device's default (buffer_cache_bytes)
    for names, kw in (_ROWS_FLAGS if rows else ()) + _ENGINE_FLAGS:
        dest = _dest(names, kw)
        p.add_argument(*names, **{"dest": dest, "default": defaults[dest], **kw})


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``GenerationOptions`` fields set by the flags :func:`add_engine_arguments` added to the
    parser of ``args``, by name."""
    dests = [_dest(names, kw) for names, kw in _ROWS_FLAGS + _ENGINE_FLAGS]
    return {dest: getattr(args, dest) for dest in dests if hasattr(args, dest)}


def run(args: argparse.Namespace) -> int:
    """Start the server and block until it stops (Ctrl-C or SIGTERM). Returns the exit status: 0,
    2 for a bad option, a missing extra or models that failed to load."""
    tune_malloc()
    try:
        import uvicorn

        from ._app import create_app
        from ._timeouts import client_timeout_protocol
        from ._shutdown import DrainingServer
    except ImportError as exc:
        print(f"mlx-serving: error: 'serve' needs the server extra: pip install -e '.[server]' from the "
              f"repository clone, or pip install 'mlx-serving[server]' ({exc})",
              file=sys.stderr)
        return 2
    models = _model_specs(args)
    options = _generation_options(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    host = args.host or "127.0.0.1"
    if api_key is None and not _is_loopback(host):
        _log.warning("serving on %s without an API key: anyone who can reach it can use it (--api-key)", host)
    failed: list[BaseException] = []
    server: list[Any] = []

    def load_failed(exc: BaseException) -> None:
        failed.append(exc)
        server[0].should_exit = True

    embedding = _embedding_options(args)
    load = functools.partial(_load, options=options, workers=args.workers, max_queue=args.max_queue,
                             embedding=embedding)
    keep_alive = None if args.keep_alive in (None, NEVER) else args.keep_alive
    on_demand = args.load_on_demand or keep_alive is not None or len(models) > (args.max_loaded_models or len(models))
    app = create_app(_on_demand(models, load) if on_demand else functools.partial(load, models), api_key=api_key,
                     request_timeout=args.request_timeout, stuck_after=args.stuck_after, on_load_error=load_failed,
                     allowed_origins=tuple(args.allowed_origins or ()), shutdown_grace=args.shutdown_grace,
                     client_timeout=args.client_timeout, keep_alive=keep_alive,
                     max_loaded_models=args.max_loaded_models)
    config = uvicorn.Config(app, host=host, port=args.port, log_level=args.log_level,
                            http=client_timeout_protocol(args.client_timeout),
                            timeout_graceful_shutdown=math.ceil(args.shutdown_grace) + 5)
    server.append(DrainingServer(config, app.state.drain))  # whole responses get the shutdown grace too
    server[0].run()
    if failed:
        print(f"mlx-serving: error: loading the models failed: {failed[0]}", file=sys.stderr)
        return 2
    return 0


def _seconds(low: float, open_low: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds >= ``low`` (> ``low`` when ``open_low``)."""
    def seconds(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (open_low and value == low):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds {'>' if open_low else '>='} {low:g}")
        return value
    return seconds


def _keep_alive(text: str) -> float:
    """An argparse type: ``parse_keep_alive(text)`` (seconds, or NEVER)."""
    try:
        return parse_keep_alive(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("keep_alive", "--keep-alive")) from None


def _at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def _on_demand(models: list[tuple[str, str | None]], load: Callable[..., dict[str, Any]]) -> dict[str, Lazy]:
    """``{name: Lazy}``: each model loaded alone by ``load(models)`` at its first request."""
    from ._models import Lazy

    return {name: Lazy(functools.partial(_load_one, load, name, spec)) for name, spec in models}


def _load_one(load: Callable[..., dict[str, Any]], name: str, spec: str | None) -> Any:
    """``load([(name, spec)])``'s one model."""
    return load([(name, spec)])[name]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: may resolve anywhere
        return False


def _model_specs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``[(name, model or None for the default)]``; ValueError for bad --served-model-name use."""
    paths: list[str | None] = list(args.model) if args.model else [None]
    names = args.served_model_name or []
    if names and len(names) != len(paths):
        raise ValueError(f"give one --served-model-name per --model ({len(paths)}), got {len(names)}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    specs = [(names[i] if names else _default_name(p), p) for i, p in enumerate(paths)]
    if len({n for n, _ in specs}) != len(specs):
        raise ValueError(f"served model names must be unique, got {[n for n, _ in specs]}")
    return specs


def _default_name(model: str | None) -> str:
    """The API id of ``model`` when --served-model-name gives none (before it is resolved)."""
    from ..models.sources import DEFAULT_MODEL

    if model is None:
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_file():
        return path.stem
    return path.resolve().name if path.is_dir() else model


def _generation_options(args: argparse.Namespace) -> dict[str, Any]:
    from ..models.text_generation import GenerationOptions
    from ..models.text_generation._options import default_max_new_tokens

    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(args.max_len, _SERVE_MAX_NEW_TOKENS)
    given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None}
    options = dict(max_new_tokens=max_new_tokens, max_len=args.max_len, **given, **engine_options(args))
    GenerationOptions(**options)  # a bad option fails before the server starts
    options["generation_config"] = args.generation_config  # resolved per model: _sampling_defaults
    if args.max_queue < args.max_batch:
        raise ValueError(f"--max-queue ({args.max_queue}) must be >= --max-batch ({args.max_batch})")
    return options


_EMBEDDING_BATCH = 32  # --embedding-batch's default (capped at --max-queue)


def _embedding_options(args: argparse.Namespace) -> dict[str, Any]:
    """The text-embedding options of ``--embedding-max-len`` / ``--embedding-batch`` (checked
    before the server starts)."""
    from ..models.text_embedding import EmbeddingOptions

    if args.embedding_batch is not None and args.max_queue < args.embedding_batch:
        raise ValueError(f"--max-queue ({args.max_queue}) must be >= --embedding-batch ({args.embedding_batch})")
    batch = args.embedding_batch if args.embedding_batch is not None else min(_EMBEDDING_BATCH, args.max_queue)
    options: dict[str, Any] = {"batch_size": batch}
    if args.embedding_max_len is not None:
        options["max_len"] = args.embedding_max_len
    EmbeddingOptions(**options)
    return options


def _load(models: list[tuple[str, str | None]], options: dict[str, Any], workers: int, max_queue: int,
          embedding: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build and start every model's client (on the app's loading thread): a text-embedding
    serving for a checkpoint that ships sentence-transformers' pooling files
    (``text_embedding.is_embedding_model``) or a GGUF file that declares a pooling type
    (``text_embedding.gguf_pooling``), text generation otherwise."""
    from ..models.sources import resolve
    from ..models.text_embedding import gguf_pooling, is_embedding_model
    from ._models import ServedModel

    served: dict[str, ServedModel] = {}
    t0 = time.monotonic()
    try:
        for name, spec in models:
            model = resolve(spec)
            pooling = gguf_pooling(spec)
            embed = pooling is not None or is_embedding_model(model.path)
            task = "embedding" if embed else "generation"
            print(f"mlx-serving: model {name!r}: {model.origin} ({model.path}), {_architecture(model.path, options)}, "
                  f"{task}", file=sys.stderr, flush=True)
            if embed:
                emb_options = {"pooling": pooling, **(embedding or {})}
                served[name] = _embedding_model(model.path, emb_options, workers, max_queue)
                detail = _describe_embedding(served[name].max_model_len, embedding or {}, workers)
            else:
                served[name] = _generation_model(model.path, options, workers, max_queue)
                detail = _describe(served[name].client, options, workers)
            print(f"mlx-serving: model {name!r} ready: {detail}", file=sys.stderr, flush=True)
    except BaseException:
        for m in served.values():
            m.client.close()
        raise
    print(f"mlx-serving: ready in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return served


#: OpenAI's sampling defaults (and vLLM's without a generation_config.json): what a request naming
#: none gets unless the model's file or a flag says otherwise.
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0}


def _sampling_defaults(path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the model's sampling defaults (``--generation-config``: "auto" reads
    ``path``'s generation_config.json, "vllm" does not; then OpenAI's; flags given win)."""
    from ..models.text_generation._options import sampling_defaults

    options = dict(options)
    mode = options.pop("generation_config", "auto")
    found = sampling_defaults(path) if mode == "auto" else {}
    return {**OPENAI_SAMPLING, **found, **options}


def _generation_model(path: Path, options: dict[str, Any], workers: int, max_queue: int) -> ServedModel:
    """A started text-generation client (a handle, or a pool of ``workers``) as a ServedModel."""
    from ..models import text_generation
    from ..tokenization import Tokenizer
    from ._models import ServedModel

    tokenizer = Tokenizer.from_dir(path)  # for /tokenize; the serving's own when in process
    options = _sampling_defaults(path, options)
    client = _start(text_generation.from_mlx4bit, path, tokenizer, options, workers, max_queue)
    return ServedModel(client, options["max_len"], tokenizer)


def _start(factory: Callable[..., Serving], path: Path, tokenizer: Tokenizer, options: dict[str, Any],
           workers: int, max_queue: int) -> Client:
    """``factory(path, tokenizer, **options)`` started in process, or a ServingPool of ``workers``
    processes each calling ``factory(path, **options)``."""
    from ..serving import Serving, ServingPool

    if workers > 1:
        return ServingPool(functools.partial(factory, path, **options), workers=workers, max_queue=max_queue)
    return Serving.start(factory(path, tokenizer, **options), max_queue=max_queue)


def _embedding_model(path: Path, options: dict[str, Any], workers: int, max_queue: int) -> ServedModel:
    """A started text-embedding client as a ServedModel (``task`` "embed", ``max_model_len`` its
    tokens per input)."""
    from ..models import text_embedding
    from ..tokenization import Tokenizer
    from ._models import ServedModel

    tokenizer = Tokenizer.from_dir(path)
    max_len = text_embedding.settings_for(path, **options).max_len  # checks the options first
    client = _start(text_embedding.from_mlx4bit, path, tokenizer, options, workers, max_queue)
    return ServedModel(client, max_len, tokenizer, task="embed")


def _describe_embedding(max_len: int | None, options: dict[str, Any], workers: int) -> str:
    where = f"{workers} worker processes" if workers > 1 else "in process"
    return f"embedding, max_len {max_len}, batch_size {options.get('batch_size', 32)} per worker, {where}"


def _architecture(path: Path, options: dict[str, Any]) -> str:
    """``family qwen3, 4-bit weights (groups of 64), bfloat16 checkpoint, compute dtype float32, on cpu``
    from the checkpoint's config.json (checked as the loader checks it) and the options."""
    import mlx.core as mx

    from ..models._checkpoint import COMPUTE_DTYPES, compute_dtype, read_config_files
    from ..models.families import read_config

    config = read_config(path)
    quant = config.quantization
    weights = f"{quant.default.bits}-bit weights (groups of {quant.default.group_size})" if quant else "dense weights"
    raw = read_config_files(path)[0]  # a JSON object: read_config refused anything else
    stored = raw.get("torch_dtype") if isinstance(raw, dict) else None
    stored = stored if isinstance(stored, str) and stored in COMPUTE_DTYPES else None
    compute = str(compute_dtype(None, COMPUTE_DTYPES[stored or "float32"])).removeprefix("mlx.core.")
    if stored is None and mx.default_device() != mx.cpu:
        compute = "the checkpoint's"
    checkpoint = f", {stored} checkpoint" if stored else ""
    return f"family {config.model_type}, {weights}{checkpoint}, compute dtype {compute}, on {mx.default_device().type.name}"


def _describe(client: Client, options: dict[str, Any], workers: int) -> str:
    """``max_len 2048, max_batch 32, KV cache 4096 blocks x 16 tokens (int8) per worker, in process``
    (the cache's ``kv_cache_dtype`` as asked, ``auto`` included; the ``decode_path`` when one is asked)."""
    blocks = int(client.stats().backend.get("blocks_total", 0))
    dtype = options.get("kv_cache_dtype") or "auto"
    cache = f"KV cache {blocks} blocks x {options['block_size']} tokens ({dtype})" if blocks else "slot KV cache"
    if options.get("decode_path"):
        cache += f", decode_path {options['decode_path']}"
    where = f"{workers} worker processes" if workers > 1 else "in process"
    return f"max_len {options['max_len']}, max_batch {options['max_batch']}, {cache} per worker, {where}"
