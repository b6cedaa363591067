"""Command line: `sparsejax COMMAND` (also `python -m sparsejax`); `sparsejax COMMAND --help`
lists a command's options with their defaults."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import traceback

from sparsejax.arguments import (KV_DTYPE_CHOICES, KV_DTYPE_HELP, nonnegative_float,
                                 positive_int, ratio)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help; an option defaulting to None says in its own help
    what it falls back to."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


# ---- generate -------------------------------------------------------------------------------
def _registry_options():
    """flag -> (Option, the methods that take it), over `methods.REGISTRY`."""
    from sparsejax import methods as M

    options: dict = {}
    for name, spec in M.REGISTRY.items():
        for option in spec.options:
            options.setdefault(option.flag, (option, []))[1].append(name)
    return options


def add_method_args(p: argparse.ArgumentParser) -> None:
    """--method, the budget, --resa, --no-calibration and every registered method's options."""
    from sparsejax import methods as M

    g = p.add_argument_group("method")
    g.add_argument("--method", default="dense", choices=list(M.REGISTRY),
                   help="; ".join(f"{n}: {s.summary}" for n, s in M.REGISTRY.items()))
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--budget-ratio", type=ratio, default=0.1,
                        help="tokens attended to, as a share of the context so far (the prompt "
                        "and the tokens generated)")
    budget.add_argument("--budget-tokens", type=positive_int, default=None,
                        help="tokens attended to (default: --budget-ratio)")
    g.add_argument("--resa", type=nonnegative_float, default=None, metavar="LAMBDA",
                   help="wrap the method in RESA with this λ (default: no RESA)")
    g.add_argument("--no-calibration", action="store_true",
                   help="ignore the gates and calibration shipped beside the model: the "
                   "papers' layer choices scaled to its depth, random Lychee heads")
    for flag, (option, names) in _registry_options().items():
        g.add_argument(flag, type=option.type, nargs=option.nargs, default=None,
                       help=f"{', '.join(names)}: {option.help} (default: from the budget, the "
                       "shipped calibration or the scaled defaults)")


def method_options(args) -> dict:
    """{flag: value} of the method options given; ValueError for one --method does not take."""
    given = {}
    for flag, (option, names) in _registry_options().items():
        value = getattr(args, option.flag[2:].replace("-", "_"))
        if value is not None and args.method not in names:
            raise ValueError(f"{flag} applies to --method {' / '.join(names)}, not "
                             f"--method {args.method}")
        if value is not None:
            given[flag] = value
    return given


def method_from_args(args, model, model_dir=None):
    """The method `args` name, at its budget (--budget-tokens tokens, or --budget-ratio of
    the context so far), for this model."""
    from sparsejax import methods as M

    spec = M.REGISTRY[args.method]
    given = method_options(args)
    try:
        fitted = M.fitted_beside(model_dir, model, calibrated=not args.no_calibration)
    except ValueError as e:
        raise ValueError(f"{e} (--no-calibration runs without the shipped files)") from None
    budget = (M.TopK(args.budget_tokens) if args.budget_tokens else M.Ratio(args.budget_ratio))
    method = spec.at_budget(model.config, budget, fitted)
    overrides = {o.field: given[o.flag] for o in spec.options if o.flag in given}
    if overrides:
        method = dataclasses.replace(method, **{
            k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})
    if args.resa is not None:
        method = M.RESA(method, lam=args.resa)
    try:
        method.to_plan(model.config)
    except ValueError as e:
        raise ValueError(f"{e} (leave out {', '.join(given) or 'the method options'} to run "
                         "the layer choices made for this model)") from None
    return method


SEED_RANGE = (-(1 << 63), (1 << 63) - 1)     # what jax.random.key takes


def check_sampling_args(args) -> None:
    """Refuse sampling flags that would do nothing, and a seed the PRNG cannot take."""
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise ValueError(f"--seed {args.seed}: expected an integer in [-2**63, 2**63 - 1]")
    if args.temperature == 0:
        given = [f"{flag} {value}" for flag, value in (("--top-k", args.top_k),
                                                       ("--top-p", args.top_p))
                 if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} only shape sampling, and --temperature 0 "
                             "(the default) decodes greedily: add --temperature (e.g. 0.7) or "
                             "leave them out")


def cmd_generate(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sparsejax
    from sparsejax import sharding
    from sparsejax.evaluation import speed_note

    method_options(args)                      # before loading anything
    check_sampling_args(args)
    mesh = sharding.tensor_parallel_mesh(args.tp)
    model_dir = args.model or sparsejax.embedded_model_path()
    model = sparsejax.from_pretrained(model_dir, dtype={"auto": "auto", "bf16": jnp.bfloat16,
                                                        "f32": jnp.float32}[args.dtype], mesh=mesh)
    tok = sparsejax.load_tokenizer(model_dir)
    ids = np.asarray([tok(args.prompt)["input_ids"]], np.int32)
    method = method_from_args(args, model, model_dir)
    kw = dict(max_new_tokens=args.max_new_tokens, method=method, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              draft_tokens=args.draft_tokens, kv_dtype=args.kv_dtype)
    jax.block_until_ready(sparsejax.generate(model, ids, **kw).tokens)     # compile, warm up
    t0 = time.perf_counter()
    out = sparsejax.generate(model, ids, **kw)
    jax.block_until_ready(out.tokens)
    seconds = time.perf_counter() - t0
    n = int(out.num_generated[0])
    print(tok.decode(np.asarray(out.tokens[0, :n]), skip_special_tokens=True))
    lossless = ("" if args.draft_tokens is None else f"; lossless, {int(out.accepted[0])} of "
                f"{int(out.drafted[0])} drafted tokens accepted")
    print(f"[{n} tokens in {seconds:.3f} s: {n / seconds:.1f} tokens/s; method {method!r}"
          f"{lossless}; prompt {ids.shape[1]} tokens, compiled for "
          f"{sparsejax.bucket_length(ids.shape[1])}; {jax.default_backend()}]", file=sys.stderr)
    if speed_note():
        print(speed_note(), file=sys.stderr)
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt with any method")
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or Hub id (default: the embedded model)")
    p.add_argument("--prompt", required=True, help="the text to complete")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0,
                   help="0 is greedy; above, sampled")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="sample among the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=ratio, default=None,
                   help="sample from the nucleus of this mass (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dtype", choices=["auto", "bf16", "f32"], default="auto",
                   help="compute dtype; auto: the checkpoint's (config.json torch_dtype, else f32)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="auto", help=KV_DTYPE_HELP)
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallel over this many devices (README: Several GPUs)")
    p.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N",
                   help="lossless mode: the method drafts N tokens per round and dense "
                   "attention verifies them, so the output is dense's (default: off)")
    add_method_args(p)
    p.set_defaults(func=cmd_generate)


# ---- the program ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from sparsejax import demo, evaluation
    from sparsejax.train import calibrate, gates, pretrain

    parser = argparse.ArgumentParser(prog="sparsejax", description=__doc__,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    add_generate_parser(sub)
    for module in (demo, evaluation, calibrate, gates, pretrain):
        module.add_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
    return parser


class _StderrHandler(logging.Handler):
    """The `sparsejax` logger's records on whatever sys.stderr is at the time."""

    def emit(self, record):
        print(self.format(record), file=sys.stderr, flush=True)


_LOG_HANDLER = _StderrHandler()


def _debug(argv: list[str]) -> tuple[bool, list[str]]:
    """--debug anywhere on the line (or SPARSEJAX_DEBUG=1): failures show their traceback."""
    flag = "--debug" in argv
    return flag or os.environ.get("SPARSEJAX_DEBUG", "") not in ("", "0"), \
        [a for a in argv if a != "--debug"]


def _failure(command: str, e: BaseException) -> tuple[str, int]:
    """(one line, exit status) for a failure: 2 for bad input, 1 for the environment (files,
    disk, memory) or an internal error."""
    from sparsejax.files import strerror_of
    from sparsejax.train.checkpoints import CheckpointSaveError

    prefix = f"sparsejax {command}: error: "
    if isinstance(e, (ValueError, CheckpointSaveError)):
        return prefix + " ".join(str(e).split("\n")), 2
    if isinstance(e, OSError):
        return prefix + strerror_of(e), 1
    if isinstance(e, MemoryError):
        return prefix + "out of memory (a smaller --batch, --context or model?)", 1
    text = " ".join(str(e).split("\n"))[:300]
    if "RESOURCE_EXHAUSTED" in text or "os error 28" in text or "No space left" in text:
        return prefix + f"out of space or memory: {text}", 1
    return prefix + f"{type(e).__name__}: {text} (internal error: run with --debug or " \
        "SPARSEJAX_DEBUG=1 for the traceback)", 1


STOPPED = ("interrupted by {signal}: stopped; no output was written or replaced after the "
           "signal (files already there are as they were)")


def main(argv=None) -> int:
    """Run a command; returns its exit status (2 for a usage or input error, 1 for a file,
    disk or internal error, 128 + the signal when SIGINT or SIGTERM stopped it). Every failure
    is one line on stderr (with --debug or SPARSEJAX_DEBUG=1, also its traceback). A stopped
    run writes nothing: outputs already there are left as they were. Run as the program
    (argv None), it then exits at once, skipping the interpreter's teardown, which can crash
    while XLA threads are still compiling."""
    from sparsejax import files

    log = logging.getLogger("sparsejax")
    if _LOG_HANDLER not in log.handlers:     # progress on stderr; results stay on stdout
        log.addHandler(_LOG_HANDLER)
        log.setLevel(logging.INFO)
    as_program = argv is None
    debug, argv = _debug(sys.argv[1:] if argv is None else list(argv))
    command = next((a for a in argv if not a.startswith("-")), "")

    def stop(e: files.Interrupted):
        print(f"sparsejax {command}: {STOPPED.format(signal=e.name)}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        os._exit(e.status)

    def stopped(e: files.Interrupted) -> int:
        files.mark_handled()
        if as_program:
            stop(e)
        print(f"sparsejax {command}: {STOPPED.format(signal=e.name)}", file=sys.stderr)
        return e.status

    try:
        with files.handle_signals(on_timeout=stop if as_program else None):
            try:
                parser = build_parser()
                try:
                    args = parser.parse_args(argv)
                except SystemExit as e:    # argparse has printed the usage error (or the help)
                    return e.code
                return args.func(args)
            except files.Interrupted as e:
                return stopped(e)
            except Exception as e:     # noqa: BLE001 (the one place failures become messages)
                line, status = _failure(command, e)
                if debug:
                    traceback.print_exc()
                print(line, file=sys.stderr)
                return status
    except files.Interrupted as e:     # while the handling was set up or taken down, or while
        return stopped(e)              # a failure above was reported: stopped all the same
