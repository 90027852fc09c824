"""Command line: ``kvledger generate`` (offline), ``kvledger serve`` (HTTP server)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from .compat import check_feature
from .config import (
    PAIR,
    SWITCH,
    TRISTATE,
    EngineConfig,
    Flag,
    LaunchSettings,
    ServerConfig,
    declared,
    value_type,
)
from .errors import KVLedgerError


def _add(p: argparse.ArgumentParser, group, f: dataclasses.Field, flag: Flag) -> None:
    """One declared setting's flag(s) (``config.setting``): its default is the field's own."""
    opts = flag.options(f.name)
    if flag.kind == SWITCH:
        group.add_argument(*opts, dest=f.name, action="store_true", default=f.default, help=flag.help)
    elif flag.kind == PAIR:  # --enable-x / --disable-x
        m = group.add_mutually_exclusive_group()
        m.add_argument(opts[0], dest=f.name, action="store_true", help=flag.help)
        m.add_argument(opts[1], dest=f.name, action="store_false", help=flag.help2)
        p.set_defaults(**{f.name: f.default})
    elif flag.kind == TRISTATE:  # --disable-x -> True, --enable-x -> False, neither: the default (None)
        m = group.add_mutually_exclusive_group()
        m.add_argument(opts[0], dest=f.name, action="store_const", const=True, default=f.default, help=flag.help)
        m.add_argument(opts[1], dest=f.name, action="store_const", const=False, help=flag.help2)
    else:
        group.add_argument(
            *opts,
            dest=f.name,
            type=flag.type or value_type(f),
            default=f.default,
            choices=flag.choices,
            nargs=flag.nargs,
            metavar=flag.metavar,
            help=flag.help,
        )


def _add_declared(p: argparse.ArgumentParser, section: str, cls: type) -> None:
    group = p.add_argument_group(f"{section} settings", (cls.__doc__ or "").strip().splitlines()[0])
    for f, flag in declared(cls):
        _add(p, group, f, flag)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig setting (SGLang's names), generated from the settings' declarations
    (``config.setting``): name, type, default, help, section."""
    for section in EngineConfig.SECTIONS:
        _add_declared(p, section, type(getattr(EngineConfig(), section)))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings from the flags, checked before anything starts (a bad one: exit 2)."""
    names = EngineConfig.section_of()
    values = {k: v for k, v in vars(args).items() if k in names}
    cfg = EngineConfig.from_flat(**values)
    from .launch.validate import (
        check_settings,  # (lazily: the engine's packages load torch; --help needs none)
    )

    check_settings(cfg)
    if cfg.model.chat_template:  # read and tried here, before anything starts (a bad one: exit 2)
        from .model.chat_templates import read_chat_template  # (lazily: the model package loads torch)

        read_chat_template(cfg.model.chat_template)
    return cfg


def _generate(args: argparse.Namespace) -> int:
    from .launch import Engine

    cfg = engine_config(args)
    eng = Engine(**cfg.flat())
    prompt = args.prompt
    if eng.tokenizer is not None and getattr(eng.tokenizer, "chat_template", None) and not args.raw:
        prompt = eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    shown = ""
    for chunk in eng.generate(prompt, sp, stream=True):
        sys.stdout.write(chunk["text"][len(shown) :])
        sys.stdout.flush()
        shown = chunk["text"]
    meta = chunk["meta_info"]
    print(f"\n[{meta['completion_tokens']} tokens, finish: {meta['finish_reason']['type']}]", file=sys.stderr)
    eng.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.dp_size > 1:
        return _serve_dp(args, engine_config(args))
    names = EngineConfig.section_of()
    values = EngineConfig.from_flat(**{k: v for k, v in vars(args).items() if k in names})
    if values.parallel.node_rank > 0:  # another machine of a multi-node group: its TP ranks, no HTTP
        from .parallel.node import run_node

        return run_node(engine_config(args))
    fields = {f.name for f in dataclasses.fields(ServerConfig)} - {"engine"}
    server = {k: v for k, v in vars(args).items() if k in fields}
    values.check()  # the values alone (a bad one: exit 2, nothing started)
    ServerConfig(**server, engine=values).check()
    # The engine process first: it imports torch and loads the model while this process checks what
    # needs torch and the disk, imports the HTTP stack and loads the tokenizer (server/early_engine.py).
    from .server.early_engine import EarlyEngine, StartInterrupted

    early = EarlyEngine.start(values, args.log_level)
    try:
        engine = engine_config(args)  # a refused setting: the engine is stopped, exit 2
        from .server.run import serve

        return serve(ServerConfig(**server, engine=engine), early)
    except StartInterrupted:
        logging.getLogger("kvledger.server").warning("start-up interrupted by a signal: stopping the engine")
        early.stop()
        return 0
    except BaseException:
        early.stop()
        raise


def _serve_dp(args: argparse.Namespace, engine: EngineConfig) -> int:
    """``--dp-size N``: N replicas of this command behind SGLang's router (server/dp_launcher.py)."""
    from .server.dp_launcher import serve_dp

    check_feature(engine, engine.model.device, "dp")
    raw = args.raw_argv[args.raw_argv.index("serve") + 1 :]
    return serve_dp(
        raw,
        args.host,
        args.port,
        args.dp_size,
        args.router_policy,
        args.num_threads,
        args.api_key,
        args.grace_period_s,
        args.session_journal,
        args.max_body_bytes,
        engine.flat()["max_sessions"],
        args.body_timeout_s,
        args.allowed_origins,
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig setting, then the launcher's (``--dp-size``, ``--router-policy``),
    generated from their declarations (``config.setting``)."""
    _add_declared(p, "server", ServerConfig)
    _add_declared(p, "launch", LaunchSettings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion offline (no server)")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--log-level", default="warning")
    add_engine_args(g)
    g.set_defaults(func=_generate)
    b = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (JSON report, PNG plot)")
    from .bench import add_bench_args, cli_main

    add_bench_args(b)
    b.set_defaults(func=cli_main)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible and SGLang-compatible HTTP API")
    add_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except KVLedgerError as e:
        print(f"kvledger: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
