#!/usr/bin/env python3
"""HF transformers greedy decode speed on a saved checkpoint, for a side-by-side table.

Times ``Qwen2ForCausalLM``-style models (anything ``AutoModelForCausalLM`` loads) in the
configurations a user would try, on a fixed random prompt, greedy, EOS ruled out:

- ``eager-dynamic``: ``model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)``
  with the default dynamic cache;
- ``static``: the same with ``cache_implementation="static"``. On CUDA, transformers >= 4.48
  compiles the decode forward by itself in this mode (``generation_config.compile_config``,
  default ``mode="reduce-overhead"``); when that happened, the row says so and a
  ``static:no-compile`` row (``disable_compile=True``) follows;
- ``static+cudagraphs`` (CUDA only): a gpt-fast-style loop. ``StaticCache``, eager prefill,
  then one decode step (forward, EOS mask, argmax) under
  ``torch.compile(mode="reduce-overhead", fullgraph=True)``, with
  ``torch.compiler.cudagraph_mark_step_begin()`` before each step and the returned token
  cloned before the next replay. Token and position inputs are static-address tensors
  updated in place between replays;
- ``static-loop`` and ``static-loop+compile`` (not run by default): the same loop with an
  eager step, and compiled with ``mode="default"`` (no CUDA graphs, works on CPU).

Per configuration: one warm-up run, then the median of ``--repeats`` runs of decode tok/s
(N-1 tokens after the first), time to first token, and the first 16 generated ids. For the
``generate`` configurations the first token is timed by a separate ``max_new_tokens=1`` call
(median), and decode = median(N-token call) - median(1-token call), so that nothing is added
to the loop being timed. A configuration that fails shows its error in the table and the
rest still run; the exit status is 0 when at least one ran.

    python scripts/hf_bench.py --model DIR [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import re
import statistics
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

DEFAULT_CONFIGS = ("eager-dynamic", "static", "static+cudagraphs")
EXTRA_CONFIGS = ("static:no-compile", "static-loop", "static-loop+compile")
ALL_CONFIGS = DEFAULT_CONFIGS + EXTRA_CONFIGS
SHOWN_IDS = 16


def log(msg: str) -> None:
    print(f"[hf_bench] {msg}", file=sys.stderr, flush=True)


def one_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    msg = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# model, prompt, roofline


def load_model(path: str, device: str | torch.device, dtype: torch.dtype, attn: str | None = None):
    """from_pretrained, then ``.to(device, dtype)`` (same path on transformers 4.x and 5.x)."""
    import transformers

    kwargs = {"attn_implementation": attn} if attn else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model = model.to(device=torch.device(device), dtype=dtype)
    model.eval()
    return model


def make_prompt(vocab_size: int, length: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=gen).to(device)


def eos_ids(model) -> list[int]:
    """EOS ids from the generation config (what min_new_tokens suppresses), in vocab range."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, int):
        eos = [eos]
    vocab = model.get_output_embeddings().weight.shape[0]
    return sorted({int(e) for e in eos if 0 <= int(e) < vocab})


def param_bytes(model) -> int:
    """Bytes of unique parameter tensors: a tied embedding/lm_head counts once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # already drops a Parameter shared by two modules
        key = p.data_ptr() or id(p)  # same storage under two Parameters also counts once
        if key in seen:
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    return total


def roofline(model, bandwidth_gbps: float) -> dict:
    nbytes = param_bytes(model)
    seconds = nbytes / (bandwidth_gbps * 1e9)
    return {
        "param_bytes": nbytes,
        "bandwidth_gbps": bandwidth_gbps,
        "ms_per_token_floor": seconds * 1e3,
        "tok_s_ceiling": 1.0 / seconds,
    }


# --------------------------------------------------------------------------------------------
# model.generate configurations


def _forget_compiled(model) -> None:
    for attr in ("_compiled_call", "_last_compile_config", "_cache"):
        model.__dict__.pop(attr, None)


def _compile_config_info(model, extra: dict) -> dict:
    """The compile settings generate used (or would use): passed, last used, config, default."""
    gc = model.generation_config
    info: dict = {
        "disable_compile": extra.get("disable_compile", getattr(gc, "disable_compile", None))
    }
    cc = model.__dict__.get("_last_compile_config") or extra.get("compile_config")
    cc = cc or getattr(gc, "compile_config", None)
    if cc is None and hasattr(model, "_default_compile_config"):
        try:
            cc = model._default_compile_config()
        except Exception:  # private helper; its absence or failure is not an error here
            cc = None
    if cc is None:
        try:
            from transformers import CompileConfig

            cc = CompileConfig()
        except ImportError:
            cc = None
    if cc is not None:
        info["compile_config"] = {
            k: v for k, v in vars(cc).items() if not k.startswith("_") and _jsonable(v)
        }
    return info


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def generate_ids(model, prompt: torch.Tensor, n: int, **extra) -> list[int]:
    eos = eos_ids(model)
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        num_beams=1,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=eos[0] if eos else 0,
        **extra,
    )
    return out[0, prompt.shape[1] :].tolist()


def bench_generate(model, prompt, n: int, repeats: int, **extra) -> dict:
    device = prompt.device
    _forget_compiled(model)
    before = _counters()
    log(f"  warm-up generate({n} tokens)")
    ids = generate_ids(model, prompt, n, **extra)
    auto_compiled = "_compiled_call" in model.__dict__
    generate_ids(model, prompt, 1, **extra)
    totals, firsts = [], []
    for r in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        again = generate_ids(model, prompt, n, **extra)
        sync(device)
        totals.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        generate_ids(model, prompt, 1, **extra)
        sync(device)
        firsts.append(time.perf_counter() - t0)
        log(
            f"  run {r + 1}/{repeats}: {n} tokens {totals[-1] * 1e3:.1f} ms, first {firsts[-1] * 1e3:.1f} ms"
        )
        if again != ids:
            raise RuntimeError("greedy ids changed between warm-up and a timed run")
    total, first = statistics.median(totals), statistics.median(firsts)
    decode = total - first
    after = _counters()
    notes = {"auto_compiled": auto_compiled, **_compile_config_info(model, extra)}
    if auto_compiled:
        notes.update({k: after[k] - before[k] for k in after})
    notes["ttft_from"] = "separate max_new_tokens=1 generate call"
    return {
        "ids": ids,
        "ttft_ms": first * 1e3,
        "total_ms": total * 1e3,
        "decode_tok_s": (n - 1) / decode if decode > 0 and n > 1 else None,
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------
# manual StaticCache loop (gpt-fast style)


def _forward_params(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def make_static_cache(model, max_len: int, device: torch.device, dtype: torch.dtype):
    """``transformers.StaticCache`` across versions, by its constructor's signature.

    Older 4.x: (config, max_batch_size | batch_size, max_cache_len, device, dtype, ...);
    4.57 and 5.x: (config, max_cache_len, ...), allocated on the first update (the prefill).
    """
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        try:
            cfg = cfg.get_text_config(decoder=True)
        except TypeError:
            cfg = cfg.get_text_config()
    candidates = {
        "config": cfg,
        "max_cache_len": max_len,
        "max_batch_size": 1,
        "batch_size": 1,
        "device": device,
        "dtype": dtype,
    }
    kwargs = {k: v for k, v in candidates.items() if k in params}
    return StaticCache(**kwargs)


class StaticLoop:
    """Prefill eagerly into a StaticCache, then run decode steps (eager or compiled)."""

    def __init__(self, model, max_len: int, compile_mode: str | None, fullgraph: bool = True):
        self.model = model
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.cache = make_static_cache(model, max_len, self.device, dtype)
        params = _forward_params(model)
        # 4.x and 5.17: past_key_values; 5.24 calls it `cache`.
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        if self.cache_kw not in params:
            raise RuntimeError("model.forward takes neither past_key_values nor cache")
        # 4.x: the static cache writes at cache_position; 5.17+ keeps its own length tensor
        # (StaticLayer.cumulative_length, a static-address tensor bumped inside the graph).
        self.use_cache_position = "cache_position" in params
        self.keep_kw = next(
            (k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None
        )
        eos = eos_ids(model)
        self.eos = torch.tensor(eos, dtype=torch.long, device=self.device) if eos else None
        # Static-address decode inputs, updated in place between steps (graphs read them
        # where they are instead of copying them in).
        self.tok = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.cpos = torch.zeros((1,), dtype=torch.long, device=self.device)
        for t in (self.tok, self.pos, self.cpos, self.eos):
            if t is not None:
                torch._dynamo.mark_static_address(t)
        self.compile_mode = compile_mode
        self.graphs = compile_mode in ("reduce-overhead", "max-autotune")
        self.fullgraph = fullgraph
        if compile_mode:
            self.step = torch.compile(self._next_token, mode=compile_mode, fullgraph=fullgraph)
        else:
            self.step = self._next_token

    def _next_token(self, ids: torch.Tensor, pos: torch.Tensor, cpos: torch.Tensor) -> torch.Tensor:
        kwargs = {self.cache_kw: self.cache, "use_cache": True, "position_ids": pos}
        if self.use_cache_position:
            kwargs["cache_position"] = cpos
        if self.keep_kw:
            kwargs[self.keep_kw] = 1
        logits = self.model(input_ids=ids, **kwargs).logits[:, -1, :].float()
        if self.eos is not None:
            logits = logits.index_fill(-1, self.eos, float("-inf"))
        return torch.argmax(logits, dim=-1)

    def run(self, prompt: torch.Tensor, n: int) -> tuple[list[int], float, float]:
        """Greedy ids, seconds to the first token, seconds for the other n-1."""
        p = prompt.shape[1]
        sync(self.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.cache.reset()
            positions = torch.arange(p, device=self.device)
            first = self._next_token(prompt, positions.unsqueeze(0), positions)
            out = [first]
            self.tok.copy_(first.view(1, 1))
            self.pos.fill_(p)
            self.cpos.fill_(p)
            sync(self.device)
            t1 = time.perf_counter()
            for _ in range(n - 1):
                if self.graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                nxt = self.step(self.tok, self.pos, self.cpos).clone()
                out.append(nxt)
                self.tok.copy_(nxt.view(1, 1))
                self.pos.add_(1)
                self.cpos.add_(1)
            sync(self.device)
            t2 = time.perf_counter()
        return torch.cat(out).tolist(), t1 - t0, t2 - t1


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


class _SkipReasons(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." lines (an off-by-default artifact
    log, so they are not printed unless TORCH_LOGS=cudagraphs)."""

    LOGGERS = (
        "torch._inductor.cudagraph_utils.__cudagraphs",
        "torch._inductor.scheduler.__cudagraphs",
    )

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage().strip().splitlines()[0][:200]
        if msg not in self.reasons:
            self.reasons.append(msg)

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def bench_static_loop(
    model, prompt, n: int, repeats: int, compile_mode: str | None, fullgraph: bool = True
) -> dict:
    before = _counters()
    loop = StaticLoop(model, prompt.shape[1] + n, compile_mode, fullgraph)
    log(f"  warm-up loop ({n} tokens, step {compile_mode or 'eager'})")
    t = time.perf_counter()
    ids, _, _ = loop.run(prompt, n)
    warm_s = time.perf_counter() - t
    firsts, decodes = [], []
    for r in range(repeats):
        again, first, decode = loop.run(prompt, n)
        firsts.append(first)
        decodes.append(decode)
        log(f"  run {r + 1}/{repeats}: first {first * 1e3:.1f} ms, decode {decode * 1e3:.1f} ms")
        if again != ids:
            raise RuntimeError("greedy ids changed between warm-up and a timed run")
    after = _counters()
    decode = statistics.median(decodes)
    notes = {
        "step": compile_mode or "eager",
        "cache_arg": loop.cache_kw,
        "cache_position": loop.use_cache_position,
        "warmup_s": round(warm_s, 2),
    }
    if compile_mode:
        notes["fullgraph"] = fullgraph
        notes.update({k: after[k] - before[k] for k in after})
    return {
        "ids": ids,
        "ttft_ms": statistics.median(firsts) * 1e3,
        "total_ms": (statistics.median(firsts) + decode) * 1e3,
        "decode_tok_s": (n - 1) / decode if decode > 0 and n > 1 else None,
        "notes": notes,
    }


def _bench_compiled_loop(model, prompt, n, repeats, mode) -> dict:
    try:
        return bench_static_loop(model, prompt, n, repeats, mode, fullgraph=True)
    except Exception as exc:
        reason = one_line(exc)
        log(f"  fullgraph=True failed ({reason}); retrying with fullgraph=False")
        traceback.print_exc(file=sys.stderr)
        _reset_compiler()
        try:
            res = bench_static_loop(model, prompt, n, repeats, mode, fullgraph=False)
        except Exception as again:
            raise RuntimeError(
                f"fullgraph=True: {reason} | fullgraph=False: {one_line(again)}"
            ) from again
        res["notes"]["fullgraph_error"] = reason
        return res


# --------------------------------------------------------------------------------------------
# driver


def _reset_compiler() -> None:
    try:
        torch._dynamo.reset()
    except Exception as exc:  # best effort between configurations
        log(f"torch._dynamo.reset failed: {one_line(exc)}")


def run_config(name: str, model, prompt: torch.Tensor, n: int, repeats: int) -> dict:
    """Run one configuration; never raises (errors come back in the result)."""
    device = prompt.device
    result: dict = {"config": name, "ok": False}
    log(f"== {name}")
    skips = _SkipReasons()
    try:
        with skips:
            res = _dispatch(name, model, prompt, n, repeats)
        if skips.reasons:
            res["notes"]["cudagraph_skip_reasons"] = skips.reasons
        result.update(res)
        result["ok"] = True
        result["first_ids"] = res["ids"][:SHOWN_IDS]
    except Exception as exc:
        result["error"] = one_line(exc)
        if str(exc) != "needs CUDA":
            traceback.print_exc(file=sys.stderr)
        log(f"  failed: {result['error']}")
    finally:
        _forget_compiled(model)
        _reset_compiler()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _dispatch(name: str, model, prompt, n: int, repeats: int) -> dict:
    if name == "eager-dynamic":
        return bench_generate(model, prompt, n, repeats)
    if name == "static":
        return bench_generate(model, prompt, n, repeats, cache_implementation="static")
    if name == "static:no-compile":
        return bench_generate(
            model, prompt, n, repeats, cache_implementation="static", disable_compile=True
        )
    if name == "static-loop":
        return bench_static_loop(model, prompt, n, repeats, None)
    if name == "static-loop+compile":
        return _bench_compiled_loop(model, prompt, n, repeats, "default")
    if name == "static+cudagraphs":
        if prompt.device.type != "cuda":
            raise RuntimeError("needs CUDA")
        return _bench_compiled_loop(model, prompt, n, repeats, "reduce-overhead")
    raise ValueError(f"unknown configuration {name!r} (known: {', '.join(ALL_CONFIGS)})")


def run_all(model, prompt, n: int, repeats: int, configs: list[str]) -> list[dict]:
    results = []
    for name in configs:
        res = run_config(name, model, prompt, n, repeats)
        results.append(res)
        if (
            name == "static"
            and res["ok"]
            and res["notes"].get("auto_compiled")
            and "static:no-compile" not in configs
        ):
            results.append(run_config("static:no-compile", model, prompt, n, repeats))
    return results


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _note_text(res: dict) -> str:
    notes = res.get("notes", {})
    parts = []
    if "auto_compiled" in notes:
        if notes["auto_compiled"]:
            mode = notes.get("compile_config", {}).get("mode", "?")
            parts.append(f"generate compiled the forward (mode={mode})")
        elif notes.get("disable_compile"):
            parts.append("disable_compile=True")
        else:
            parts.append("not compiled")
    if notes.get("step") and notes["step"] != "eager":
        parts.append(f"step {notes['step']}, fullgraph={notes.get('fullgraph')}")
        if "fullgraph_error" in notes:
            parts.append(f"fullgraph error: {notes['fullgraph_error']}")
    for reason in notes.get("cudagraph_skip_reasons", []):
        parts.append(reason)
    if "unique_graphs" in notes:
        parts.append(
            f"graphs {notes['unique_graphs']}, breaks {notes['graph_breaks']}, "
            f"cudagraph skips {notes['cudagraph_skips']}"
        )
    if "warmup_s" in notes and notes.get("step") != "eager":
        parts.append(f"warm-up {notes['warmup_s']} s")
    return "; ".join(parts)


def print_table(report: dict, out=None) -> None:
    out = out or sys.stdout
    meta = report["meta"]
    print(
        f"HF transformers {meta['transformers']} / torch {meta['torch']} on {meta['device_name']}, "
        f"{meta['dtype']}, attn {meta['attn_implementation']}, prompt {meta['prompt_tokens']}, "
        f"{meta['new_tokens']} new tokens, median of {meta['repeats']}",
        file=out,
    )
    results = report["configs"]
    ref = next((r for r in results if r["ok"]), None)
    width = max([len(r["config"]) for r in results] + [20])
    print(f"{'config':<{width}}  {'decode tok/s':>12}  {'TTFT ms':>8}  {'ids':>5}  notes", file=out)
    for r in results:
        if not r["ok"]:
            print(f"{r['config']:<{width}}  {'error: ' + r['error']}", file=out)
            continue
        same = "ref" if r is ref else ("same" if r["ids"] == ref["ids"] else "DIFF")
        print(
            f"{r['config']:<{width}}  {_fmt(r['decode_tok_s'], '12.1f')}  "
            f"{_fmt(r['ttft_ms'], '8.2f')}  {same:>5}  {_note_text(r)}",
            file=out,
        )
    roof = report.get("roofline")
    if roof:
        print(
            f"{'roofline':<{width}}  {roof['tok_s_ceiling']:12.1f}  {'':>8}  {'':>5}  "
            f"{roof['param_bytes'] / 1e6:.1f} MB of weights / {roof['bandwidth_gbps']:g} GB/s "
            f"= {roof['ms_per_token_floor']:.3f} ms/token",
            file=out,
        )
    for r in results:
        if r["ok"]:
            print(f"ids {r['config']}: {' '.join(map(str, r['first_ids']))}", file=out)


DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="HF transformers greedy decode speed (generate and a CUDA-graph loop) "
        "on a saved checkpoint.",
    )
    ap.add_argument("--model", required=True, help="folder written by save_pretrained")
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available"
    )
    ap.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="default: float16 on cuda, float32 on cpu",
    )
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per run (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    ap.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma list of {', '.join(ALL_CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)})",
    )
    ap.add_argument(
        "--attn-implementation", default=None, help="e.g. sdpa, eager (default: model's)"
    )
    ap.add_argument(
        "--roofline-bandwidth",
        type=float,
        default=4300.0,
        metavar="GBPS",
        help="memory bandwidth in GB/s for the weights-read tok/s ceiling (default 4300, H200 ~4.8 TB/s peak)",
    )
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.tokens < 2:
        ap.error("--tokens must be >= 2")
    if args.prompt_tokens < 1 or args.repeats < 1:
        ap.error("--prompt-tokens and --repeats must be >= 1")
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_list if c not in ALL_CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {', '.join(ALL_CONFIGS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("float16" if device.type == "cuda" else "float32")
    log(f"loading {args.model} on {device} as {dtype_name}")
    model = load_model(args.model, device, DTYPES[dtype_name], args.attn_implementation)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = make_prompt(vocab, args.prompt_tokens, args.seed, device)
    meta = {
        "model": os.path.abspath(args.model),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "seed": args.seed,
        "eos_ids_masked": eos_ids(model),
        "prompt_ids": prompt[0].tolist(),
    }
    with torch.no_grad():
        results = run_all(model, prompt, args.tokens, args.repeats, args.config_list)
    report = {
        "meta": meta,
        "roofline": roofline(model, args.roofline_bandwidth),
        "configs": results,
    }
    print_table(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        text = json.dumps(report, indent=1)
        # Lists of numbers on one line each (ids, prompt).
        text = re.sub(
            r"\[\n\s*(-?\d[-\d,.\s]*?)\n\s*\]",
            lambda m: "[" + " ".join(m.group(1).split()) + "]",
            text,
        )
        with open(args.json, "w") as f:
            f.write(text + "\n")
        log(f"wrote {args.json}")
    return 0 if any(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
