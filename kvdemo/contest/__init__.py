"""The benchmark: kvdemo's packed KV cache in a contest with transformers' own caches, on one model, text and
machine (`python -m kvdemo bench`).

Answers "why not just use transformers' ``cache_implementation="quantized"``?" with numbers measured
side by side in one run (`python -m kvdemo bench --json --out reports/`, docs/benchmark.md). Contenders:

- ``full``: transformers' `DynamicCache` with SDPA attention (the honest baseline, model dtype);
- ``kvdemo-int8``, ``kvdemo-k8v4``, ``kvdemo-k4v8``, ``kvdemo-int4``, ``kvdemo-int2``, ``kvdemo-fp8``:
  `QuantizedKVCache` at those presets (kvdemo/precision.py), read by the "kvdemo" attention
  (kvdemo/attention.py); k8v4 against k4v8 says end to end which half (keys or values) is sensitive;
- ``kvdemo-int4:ktoken:g64``: transformers' own scheme (4-bit, keys and values per token in groups of 64
  channels, residual 128) in kvdemo's implementation, so the gap to ``hf-quanto-int4`` splits into what
  the scheme costs and what the implementation costs;
- ``kvdemo-int3``, ``kvdemo-nuq4:o1``, ``kvdemo-nuq3:o1``, ``kvdemo-nuq2:o1:s1``, ``kvdemo-int4:hadamard``,
  ``kvdemo-nvfp4``: the methods beyond uniform codes (KVQuant's nuq with outliers and the fp16 first token,
  3-bit, Hadamard rotation, NVFP4; kvdemo/precision.py), in the same harness;
- ``hf-quanto-int4`` / ``-int2`` and ``hf-hqq-int4`` / ``-int2``: transformers `QuantizedCache` with the
  optimum-quanto / HQQ backend at its defaults (group 64 along head_dim for keys and values, residual
  128; it dequantizes the whole cache at every step and re-quantizes all of it when the residual
  fills), and ``hf-fp8`` (its fp8 backend: one per-tensor scale, frozen after the first update).
- ``llama.cpp:<type>`` (asked for with ``--precision``, kvdemo/engines.py's grammar): llama.cpp's own KV cache,
  run by llama.cpp on the model's GGUF file and the same token ids (`llamacpp_rows`), each read against
  ``llama.cpp:f16``, which comes with them.

Measured per contender (`kvdemo.results.bench.BenchSizes` holds the sizes; `QUICK` is a tiny version for tests):

- cache bytes right after a prefill of real prose at each context length (tensors actually stored:
  packed codes, scales, zero points, residual, sinks), and the ratio to a 16-bit cache of the tokens;
- perplexity of held-out real text (a book the other texts never use): the first ``ppl_prefix``
  tokens are prefilled exactly (the same exact keys/values are stored into every contender's cache),
  then the rest is fed in chunks of `DECODE_MAX_QUERIES` (16) tokens, as decoding would, so every
  scored token attends over the *stored* (quantized) past; ``ppl[N]`` is the perplexity of the
  tokens at positions [N/2, N), and ``ppl_delta[N]`` its difference from ``full``; ``logit_kl[N]`` is
  KL(full || contender) of the next-token distributions, averaged over every ``kl_every``-th of those
  positions;
- needle retrieval (kvdemo.needle's RULER-style multikey prompts in real prose): teacher-forced
  log-probability of the answer on a small grid of prompt lengths x needle depths; the context's exact
  states are stored in two updates, its first floor(T / R) * R tokens and then the rest (R: the residual
  length every contender shares), so every quantized contender holds the same tokens quantized and the
  same last T mod R tokens exact; the question arrives afterwards and attends over the stored cache (a
  document cached before the user asks);
- prefill seconds at each context (runner.prefill, as the app prefills), and decode tokens/s at each
  context: warm (after untimed warm-up steps), ``rounds`` rounds of ``new_tokens`` steps interleaved
  across contenders. ``new_tokens`` is a multiple of the shared residual length, so every round holds
  each quantized contender's flushes (kvdemo quantizing its residual window, transformers re-quantizing
  its whole cache) as steady decoding would; the flushes inside the window are counted and reported.
  Reduced by medians (tok/s: median round; speed ratios: median of per-round ratios), so a burst of
  load on a shared machine spoils a round, not the comparison;
- ``setup_s``: the one-time cost of a contender's first call (first tiny run minus an identical second
  one), e.g. importing optimum-quanto and building its C++ extension, reported apart from the speeds.

References: transformers `QuantizedCache` (cache_utils.py; KIVI, arXiv 2402.02750), optimum-quanto,
HQQ (Badri & Shaji 2023), users' latency reports (transformers issue 34096).

The package: `contenders` (who runs, how each cache is built, its bytes), `decode` (timed greedy decoding,
side by side), `llamacpp_rows` (llama.cpp's rows, phase by phase), `run` (`run_bench`, the whole run). The report is `kvdemo.results.bench.BenchReport`.
"""
