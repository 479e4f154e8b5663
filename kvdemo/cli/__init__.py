"""Command line: `python -m kvdemo COMMAND ...`, a thin argparse layer over the functions the pages use.

This package holds the parser and `main`; one module per command group (needle, drift, memory,
documents, bench, ppl, ...) holds its handler and text formatter, so the domain modules compute and return data.

Every command prints JSON with --json (human-readable text otherwise). A mistake a user can make
(bad precision string, missing file, unknown model) prints one line on stderr and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..precision import parse_precision, parse_precision_list


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="embedded (default), a Hugging Face id, a folder or a .gguf")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--json", action="store_true", help="print JSON")


def _load(args):
    from ..models import load_model

    return load_model(args.model, device=args.device, dtype=args.dtype)


def _prefill_mode_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--prefill-mode",
        default=default,
        choices=["exact", "chunked"],
        help="exact: the prompt computed at full precision, stored quantized; chunked: chunk by chunk, each "
        f"chunk attending over earlier chunks already quantized (default {default})",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def cmd_info(args) -> dict:
    return _load(args).info()


def cmd_memory(args):
    from ..measured import measure_memory
    from ..texts import prose_ids

    specs = parse_precision_list(args.precision)
    lm = _load(args)
    if args.tokens > lm.max_context:
        raise ValueError(f"--tokens {args.tokens} exceeds the model's context ({lm.max_context})")
    return measure_memory(lm, prose_ids(lm, args.tokens), specs)


def cmd_generate(args) -> dict:
    from ..runner import chat_ids, compare

    spec = parse_precision(args.precision)
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ValueError(f"prompt file not found: {args.prompt_file}")
        from ..documents import extract_bytes

        prompt = extract_bytes(path.read_bytes(), path.name).text
    else:
        prompt = args.prompt
    if not prompt or not prompt.strip():
        raise ValueError("give a prompt with --prompt TEXT or --prompt-file F")
    lm = _load(args)
    ids = chat_ids(lm, [{"role": "user", "content": prompt}])
    if len(ids) + args.max_new_tokens > lm.max_context:
        raise ValueError(f"prompt ({len(ids)} tokens) + new tokens exceed the model's context ({lm.max_context})")
    return compare(lm, ids, [spec], args.max_new_tokens, prefill_mode=args.prefill_mode)


def _text_generate(out: dict) -> str:
    lines = [f"model: {out['model']}  prompt: {out['prompt_tokens']} tokens"]
    for r in out["results"]:
        lines.append(
            f"\n== {r['precision']}: {r['decode_tok_s']:.2f} tok/s decode, prefill {r['prefill_s']:.2f} s, "
            f"first divergence: {r['first_divergence']}\n{r['text']}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvdemo", description="KV-cache quantization, measured.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="model name, layers, kv heads, head_dim, context, device, dtype")
    _model_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("memory", help="prefill real text and measure the live cache at each precision")
    _model_args(p)
    p.add_argument("--precision", default="full,int8,k8v4,int4,int2")
    p.add_argument("--tokens", type=_positive_int, default=4096)
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("generate", help="full precision and a quantized cache side by side")
    _model_args(p)
    p.add_argument("--precision", default="int4")
    p.add_argument("--prompt", default="")
    p.add_argument("--prompt-file", default="")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    _prefill_mode_arg(p, "chunked")
    p.set_defaults(func=cmd_generate, text=_text_generate)

    p = sub.add_parser("needle", help="needle-in-a-haystack grid: full precision vs quantized")
    _model_args(p)
    p.add_argument(
        "--precision",
        default="full,int8,int4,int2",
        help="KV precisions; llama.cpp:<type> (f16, q8_0, q5_1, q5_0, q4_1, iq4_nl, q4_0) runs llama.cpp's own "
        "cache on the same GGUF file and prompts, against its f16 row",
    )
    p.add_argument("--lengths", default="1024,2048,4096", help="haystack lengths in tokens")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle depths in percent")
    p.add_argument("--kind", default="passkey", choices=["passkey", "multikey", "custom"])
    p.add_argument("--haystack-file", default="", help="your own document as the haystack")
    p.add_argument("--needle", default="", help="custom needle sentence")
    p.add_argument("--question", default="", help="custom question")
    p.add_argument("--answer", default="", help="custom expected answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the grid with seeds seed .. seed+repeats-1 (new needles at the same cells); found rates "
        "come with a 95%% interval over all runs",
    )
    p.add_argument(
        "--codebooks",
        default="",
        help="a codebook file (kvdemo calibrate --out) for the nuq precisions, in place of the model's own",
    )
    p.add_argument("--out", default="", help="folder for needle.json and needle.csv")
    _prefill_mode_arg(p, "chunked")
    p.set_defaults(func=_lazy("needle", "run_cli"), text=_lazy("needle", "format_text"))

    p = sub.add_parser("probe", help="the needle grid asked of OpenAI-compatible endpoints, side by side")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="NAME=BASE_URL,MODEL[,KEY_ENV] (repeat for each endpoint); KEY_ENV names the environment variable "
        "holding the key, never the key itself",
    )
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths in (estimated) tokens")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle depths in percent")
    p.add_argument("--kind", default="passkey", choices=["passkey", "multikey", "custom"])
    p.add_argument("--document", default="", help="your own document as the haystack")
    p.add_argument("--needle", default="", help="custom needle sentence")
    p.add_argument("--question", default="", help="custom question")
    p.add_argument("--answer", default="", help="custom expected answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="run the grid with seeds seed .. seed+repeats-1")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight per endpoint")
    p.add_argument("--timeout-s", type=float, default=120.0, help="seconds one request may take")
    p.add_argument(
        "--retries", type=int, default=3, help="retries of a request on 429, 5xx, timeouts, lost connections"
    )
    p.add_argument(
        "--backoff-s", type=float, default=1.0, help="first retry's wait, doubled each retry (or Retry-After)"
    )
    p.add_argument("--max-tokens", type=_positive_int, default=32, help="answer tokens asked for")
    p.add_argument(
        "--logprobs",
        default="chat",
        choices=["chat", "echo", "off"],
        help="where the answer's log-prob is read: chat (the reply's tokens, found answers only), echo (the "
        "completions API echoes the prompt and the true answer: teacher-forced, hit or miss), off",
    )
    p.add_argument(
        "--echo-template",
        default="plain",
        help="with --logprobs echo, the prompt as text: plain (user: ...\n\nassistant:), chatml, or your model's "
        "template with {prompt} where the needle's user message goes",
    )
    p.add_argument(
        "--llamacpp",
        default="",
        help="also start llama.cpp's own server on loopback once per KV cache type (e.g. f16,q4_0), probe them as "
        "endpoints llama.cpp-<type>, and check each served answer against llama.cpp in-process",
    )
    p.add_argument("--llamacpp-model", default="", help="the GGUF file those servers run (default: the embedded model)")
    p.add_argument("--out", default="", help="write the report: a .json file (the .csv beside it) or a folder")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_lazy("probe", "run_cli"), text=_lazy("probe", "format_text"))

    p = sub.add_parser("drift", help="attention-score drift of quantized vs full precision")
    _model_args(p)
    p.add_argument("--precision", default="int8,int4,int2")
    p.add_argument("--tokens", type=_positive_int, default=2048)
    p.add_argument("--document", default="", help="a document to use instead of the bundled prose")
    p.add_argument("--new-tokens", type=_positive_int, default=16, help="generated tokens for the logit-KL curve")
    _prefill_mode_arg(p, "chunked")
    p.set_defaults(func=_lazy("drift", "run_cli"), text=_lazy("drift", "format_text"))

    p = sub.add_parser("prefill-modes", help="one needle cell and one drift run, prompt stored exact vs chunked")
    _model_args(p)
    p.add_argument("--precision", default="int4,int2", help="quantized precisions")
    p.add_argument("--tokens", type=_positive_int, default=8000, help="prompt length of the needle and drift runs")
    p.add_argument("--kind", default="passkey", choices=["passkey", "multikey"])
    p.add_argument("--depth", type=float, default=50.0, help="needle depth in percent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=_positive_int, default=16, help="drift: generated tokens")
    p.add_argument("--document", default="", help="drift: a document instead of the bundled prose")
    p.add_argument("--out", default="", help="also write the JSON to this file")
    p.set_defaults(func=_lazy("prefill_modes", "run_cli"), text=_lazy("prefill_modes", "format_text"))

    p = sub.add_parser(
        "ppl", help="perplexity of held-out text (or yours), every token attending over the stored cache"
    )
    _model_args(p)
    p.add_argument(
        "--precision",
        default="int8,k8v4,int4,int2",
        help="KV precisions (full always runs first); llama.cpp:<type> or llama.cpp:<key>/<value> (f16, q8_0, q5_1, "
        "q5_0, q4_1, iq4_nl, q4_0) scores llama.cpp's own cache on the same GGUF file and tokens, against its f16 row",
    )
    p.add_argument("--tokens", type=_positive_int, default=4096, help="text length; scored: [tokens/2, tokens)")
    p.add_argument("--prefix", type=_positive_int, default=1024, help="tokens stored exactly before scoring starts")
    p.add_argument(
        "--document",
        default="",
        help="score your own text (txt, md, pdf, docx, html; the text alone, no chat template) instead of the "
        "held-out prose; it needs at least --tokens tokens",
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="the methods grid (int / +pre-RoPE / nuq / +1%% outliers / Hadamard / NVFP4 at 4, 3, 2 bits), the live "
        "memory and decode speed of the new formats, written as ablation.json (ignores --precision)",
    )
    p.add_argument(
        "--kv-split",
        action="store_true",
        help="where each --precision's loss sits: also its keys alone and its values alone (the other part at "
        "int8), both at int8, and the same mean bits with a bit moved between keys and values; written as "
        "ppl_kv_split.json",
    )
    p.add_argument(
        "--codebooks",
        default="",
        help="a codebook file (kvdemo calibrate --out) for the nuq precisions, in place of the model's own",
    )
    p.add_argument(
        "--out",
        default="",
        help="also write the report: into this folder as ppl.json (ablation.json with --ablation, ppl_kv_split.json "
        "with --kv-split), or to this .json",
    )
    p.set_defaults(func=_lazy("ppl", "run_cli"), text=_lazy("ppl", "format_text"))

    p = sub.add_parser("calibrate", help="fit the model's nuq codebooks (KVQuant) and save them where nuq caches look")
    p.add_argument(
        "--model",
        default="embedded",
        help="embedded (default), a Hugging Face id, a folder, a .gguf, or random / random:<config> (random weights)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument(
        "--tokens",
        type=_positive_int,
        default=None,
        help="calibration tokens (default 2048, or all of a shorter document)",
    )
    p.add_argument(
        "--text",
        dest="calibration_text",  # `text` is the subcommand's formatter (set_defaults below)
        default="prose",
        help="prose (the bundled text, default), a document of your own (txt, md, pdf, docx, html), or held-out: the "
        "text kvdemo ppl scores (an oracle fit, to tell the calibration's limits from the format's; needs --out)",
    )
    p.add_argument("--out", default="", help="the file to write (default: <cache dir>/codebooks/<model>.safetensors)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_lazy("calibrate", "run_cli"), text=_lazy("calibrate", "format_text"))

    p = sub.add_parser("headroom", help="KV bytes/token and concurrent sequences per precision on a GPU budget")
    p.add_argument("--model-config", default="llama-3.1-8b", help="a reference config name or 'loaded'")
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="custom GPU size in GB (overrides --gpu)")
    p.add_argument("--gpus", type=_positive_int, default=1)
    p.add_argument("--context", type=_positive_int, default=32768)
    p.add_argument("--users", type=_positive_int, default=None, help="for max context per user")
    p.add_argument("--weight-bits", type=int, default=16, choices=[16, 8, 4])
    p.add_argument("--reserve-gb", type=float, default=None, help="memory kept free (activations, runtime)")
    p.add_argument("--precision", default="full,fp8,int8,k8v4,int4,int2")
    p.add_argument("--measure", action="store_true", help="admit real caches into --budget-gb and count them")
    p.add_argument("--budget-gb", type=float, default=None, help="with --measure: the memory budget (GB)")
    p.add_argument(
        "--measure-model",
        default="random",
        help="with --measure: random (small Llama-style), random:<config>, embedded, a hub id or a folder",
    )
    p.add_argument("--batch-sizes", default="1,2,4,8", help="with --measure: decode tokens/s at these batch sizes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("memory", "run_headroom_cli"), text=_lazy("memory", "format_headroom"))

    p = sub.add_parser("scale", help="prefill long prompts at each precision and measure peak memory and time")
    p.add_argument("--tokens", default="16384,32768,65536", help="prompt lengths")
    p.add_argument("--precision", default="full,int4")
    p.add_argument(
        "--model",
        default="random",
        help="random (small Llama-style, random weights), random:<config>, embedded, a hub id or a folder",
    )
    p.add_argument("--mode", default="chunked", choices=["chunked", "exact"], help="prefill mode")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--out", default="", help="also write scale.json into this folder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("scale", "run_cli"), text=_lazy("scale", "format_text"))

    p = sub.add_parser("extract", help="text of a txt/md/pdf/docx/html file, as the app reads it")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_lazy("documents", "run_cli"), text=None)

    p = sub.add_parser("bench", help="kvdemo vs transformers' QuantizedCache, measured in one run")
    _model_args(p)
    p.add_argument("--out", default="reports")
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests); the same as --sizes quick")
    p.add_argument("--sizes", default="full", choices=["full", "1k", "quick"], help="kvdemo.results.bench.SIZES")
    p.add_argument("--only", default="", help="comma-separated contenders (default: every one available)")
    p.add_argument(
        "--precision",
        default="",
        help="kvdemo precisions to run (as kvdemo-<precision>) in place of the presets; llama.cpp:<type> or "
        "llama.cpp:<key>/<value> (f16, q8_0, q5_1, q5_0, q4_1, iq4_nl, q4_0) adds llama.cpp's own cache on the same "
        "GGUF file and tokens, read against its f16 row",
    )
    p.set_defaults(func=_lazy("bench", "run_cli"), text=_lazy("bench", "format_text"))

    p = sub.add_parser("findings", help="the claims about KV quantization, measured: findings.json/.html/.pdf")
    _model_args(p)
    p.add_argument("--precision", default="", help="KV precisions (default: every preset and the claims' variants)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (minutes on 2 cores; tests)")
    p.add_argument("--out", default="reports/findings", help="folder for findings.json, .html, .pdf")
    p.add_argument("--model-config", default="", help="capacity: a reference config (default llama-3.1-8b)")
    p.add_argument("--gpu", default="", help="capacity: a GPU preset (default h100-80gb)")
    p.add_argument("--gpus", type=_positive_int, default=None)
    p.add_argument("--context", type=_positive_int, default=None, help="capacity: tokens per sequence (default 32768)")
    p.add_argument("--no-pdf", action="store_true", help="skip the Chromium-printed PDF")
    p.add_argument("--no-cache", action="store_true", help="measure everything again (ignore cached results)")
    p.add_argument("--sizes", default="full", choices=["full", "medium", "quick"], help="kvdemo.findings.run.SIZES")
    p.add_argument("--tokens", type=_positive_int, default=None, help="text length (default: the model's context)")
    p.add_argument("--shard", default="0/1", help="k/N: measure every N-th unit (parallel processes, one cache)")
    p.add_argument("--reverse", action="store_true", help="take the shard's units from the last (a second process)")
    p.add_argument("--from-cache", action="store_true", help="report what the cache holds; measure nothing")
    p.add_argument(
        "--rejudge",
        default="",
        metavar="FINDINGS_JSON",
        help="judge a written report's measurements again with this code and write its files; measure nothing",
    )
    p.set_defaults(func=_lazy("findings", "run_cli"), text=_lazy("findings", "format_text"))
    return parser


def _lazy(module: str, name: str):
    """The function `name` of kvdemo.cli.<module>, imported only when the command runs."""

    def call(*args):
        import importlib

        return getattr(importlib.import_module(f"kvdemo.cli.{module}"), name)(*args)

    return call


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = args.func(args)
    except (ValueError, FileNotFoundError) as err:  # ModelLoadError, DocumentError are ValueErrors
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (MemoryError, torch.OutOfMemoryError):
        print("error: out of memory: try fewer tokens or a lower precision (int4, int2)", file=sys.stderr)
        return 2
    if isinstance(out, str):
        print(out)
    elif getattr(args, "json", False) or getattr(args, "text", None) is None:  # a typed result prints its JSON
        print(json.dumps(out.to_json() if hasattr(out, "to_json") else out, indent=2, default=str))
    else:
        print(args.text(out))
    return 0
