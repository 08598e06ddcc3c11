"""`ringserve` command line: `serve` (the server) and gRPC client subcommands (`generate`, `tokenize`, ...)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from ringserve.formats.cli_env import env_default, env_help, parse_bool
from ringserve.frontend.api.security import (
    SecurityConfigError,
    add_channel_security_arguments,
    channel_security_from_args,
    open_channel,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=env_default("HOST", DEFAULT_HOST),
                        help=f"server address (default {DEFAULT_HOST}) {env_help('HOST')}")
    parser.add_argument("--port", type=int, default=env_default("PORT", DEFAULT_PORT, int),
                        help=f"server port (default {DEFAULT_PORT}) {env_help('PORT')}")
    parser.add_argument("--model", default=env_default("MODEL_NAME", ""),
                        help=f"served model name; empty = the server's default {env_help('MODEL_NAME')}")
    parser.add_argument("--timeout", type=float, default=env_default("TIMEOUT", None, float),
                        help=f"RPC deadline in seconds (default none) {env_help('TIMEOUT')}")
    add_channel_security_arguments(parser)  # --tls, --tls-ca-file, client certificate, --api-key


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument("prompt", help="the prompt; sent as a user chat message unless --raw")
    parser.add_argument("--raw", action="store_true", default=env_default("RAW", False, parse_bool),
                        help=f"send the prompt as plain text, without the chat template {env_help('RAW')}")
    parser.add_argument("--stream", action="store_true", default=env_default("STREAM", False, parse_bool),
                        help=f"print text as it is generated {env_help('STREAM')}")
    parser.add_argument("--max-tokens", type=int, default=env_default("MAX_TOKENS", None, int),
                        help=f"tokens to generate (server default 256) {env_help('MAX_TOKENS')}")
    parser.add_argument("--temperature", type=float, default=env_default("TEMPERATURE", None, float),
                        help=f"0 = greedy (server default 1.0) {env_help('TEMPERATURE')}")
    parser.add_argument("--top-p", type=float, default=env_default("TOP_P", None, float),
                        help=f"nucleus sampling mass in (0, 1] {env_help('TOP_P')}")
    parser.add_argument("--top-k", type=int, default=env_default("TOP_K", None, int),
                        help=f"sample from the k most likely tokens; 0 = off {env_help('TOP_K')}")
    parser.add_argument("--seed", type=int, default=env_default("SEED", None, int),
                        help=f"seed for reproducible sampling {env_help('SEED')}")
    parser.add_argument("--ignore-eos", action="store_true", default=env_default("IGNORE_EOS", False, parse_bool),
                        help=f"keep generating past end-of-sequence tokens {env_help('IGNORE_EOS')}")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end the completion where this text appears (repeat for several)")
    parser.add_argument("--include-stop-str-in-output", action="store_true",
                        help="keep the matched stop text at the end of the completion")
    parser.add_argument("--n", type=int, default=env_default("N", None, int),
                        help="completions to generate; with n > 1 each is printed under a [index] header once all "
                             f"are done {env_help('N')}")
    parser.add_argument("--cache-salt", default=env_default("CACHE_SALT", "", str),
                        help="share prefix-cache blocks only with requests using the same salt "
                             + env_help("CACHE_SALT"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringserve", description="RingServe: an LLM server with a gRPC API.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the server", description="Run the RingServe gRPC server.")
    from ringserve.frontend.launcher import add_serve_arguments

    add_serve_arguments(serve)

    router = commands.add_parser("router", help="route requests over prefill and decode servers",
                                 description="Serve the public API over disaggregated prefill and decode servers.")
    from ringserve.frontend.routing.router import add_router_arguments

    add_router_arguments(router)

    generate = commands.add_parser("generate", help="generate text from a running server",
                                   description="Send one Generate request and print the completion.")
    add_generate_arguments(generate)

    tokenize = commands.add_parser("tokenize", help="show a prompt's token ids",
                                   description="Tokenize a prompt on the server and print the ids.")
    add_connection_arguments(tokenize)
    tokenize.add_argument("prompt")
    tokenize.add_argument("--chat", action="store_true", help="render the prompt as a user chat message first")

    info = commands.add_parser("model-info", help="describe the served model",
                               description="Print the served model's description.")
    add_connection_arguments(info)
    stats = commands.add_parser("stats", help="show engine counters", description="Print the engine's counters.")
    add_connection_arguments(stats)
    return parser


def _address(args: argparse.Namespace) -> str:
    host = args.host
    return f"[{host}]:{args.port}" if ":" in host and not host.startswith("[") else f"{host}:{args.port}"


def _channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to the server with the TLS and API key settings of `args`."""
    return open_channel(_address(args), channel_security_from_args(args))


def _generate_request(args: argparse.Namespace) -> object:
    from ringserve.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(model=args.model)
    if args.raw:
        request.text = args.prompt
    else:
        request.messages.messages.add(role="user", content=args.prompt)
    sampling = request.sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    sampling.ignore_eos = args.ignore_eos
    sampling.stop.extend(args.stop)
    sampling.include_stop_str_in_output = args.include_stop_str_in_output
    if args.n is not None:
        sampling.n = args.n
    request.cache_salt = args.cache_salt
    return request


def run_generate(args: argparse.Namespace) -> int:
    from ringserve.v1 import generation_pb2_grpc as pb_grpc

    with _channel(args) as channel:
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(_generate_request(args), timeout=args.timeout)
        several = (args.n or 1) > 1
        pieces: dict[int, list[str]] = {}
        try:
            for response in call:
                if args.stream and not several:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                else:
                    pieces.setdefault(response.index, []).append(response.text)
        except KeyboardInterrupt:
            call.cancel()  # the server aborts the request in the engine
            print(file=sys.stderr)
            return 130
        if several:
            sys.stdout.write("\n".join(f"[{index}]\n{''.join(pieces[index])}" for index in sorted(pieces)))
        elif not args.stream:
            sys.stdout.write("".join(pieces.get(0, [])))
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    from ringserve.v1 import generation_pb2 as pb
    from ringserve.v1 import generation_pb2_grpc as pb_grpc

    request = pb.TokenizeRequest(model=args.model)
    if args.chat:
        request.messages.messages.add(role="user", content=args.prompt)
    else:
        request.text = args.prompt
    with _channel(args) as channel:
        response = pb_grpc.GenerationStub(channel).Tokenize(request, timeout=args.timeout)
    print(" ".join(str(token_id) for token_id in response.token_ids))
    return 0


def run_model_info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format
    from ringserve.v1 import generation_pb2 as pb
    from ringserve.v1 import generation_pb2_grpc as pb_grpc

    with _channel(args) as channel:
        stub = pb_grpc.GenerationStub(channel)
        if args.command == "stats":
            message = stub.GetEngineStats(pb.EngineStatsRequest(model=args.model), timeout=args.timeout)
        else:
            message = stub.GetModelInfo(pb.ModelInfoRequest(model=args.model), timeout=args.timeout)
    print(json_format.MessageToJson(message, always_print_fields_with_no_presence=True,
                                    preserving_proto_field_name=True))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ValueError as exc:  # a RINGSERVE_* variable that does not parse
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from ringserve.frontend.launcher import run_serve

        sys.exit(run_serve(args))
    if args.command == "router":
        from ringserve.frontend.routing.router import run_router

        sys.exit(run_router(args))
    runners = {"generate": run_generate, "tokenize": run_tokenize, "model-info": run_model_info,
               "stats": run_model_info}
    try:
        return runners[args.command](args)
    except SecurityConfigError as exc:
        print(f"ringserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        print(f"ringserve {args.command}: {code.name}: {details}", file=sys.stderr)
        if code == grpc.StatusCode.UNAVAILABLE:
            print(f"  is a server running at {_address(args)}? start one with `ringserve serve`", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
