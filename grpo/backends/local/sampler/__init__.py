"""The local backend's sampler: batched, KV-cached sampling of many requests at once.

The worker hands `sample_batch` (``loop.py``) every pending request for one set of
weights; all their sequences decode together. Results do not depend on what else is in the batch:

- Each sequence owns its random stream: sample ``i`` of a request with seed ``s`` draws
  its uniforms from ``numpy.random.default_rng([s, i])`` and picks a token by inverse CDF
  of the (filtered) distribution, so no draw depends on another sequence.
- Attention never reads another row: prompts are left-padded into one tensor; in the
  prefill a row attends over a span fixed by its own prompt length (rounded up to
  `SPAN_BUCKET`, the extra positions masked), rows with equal spans in one masked call;
  in the decode every row attends in one call, the positions before its prompt carrying
  a -inf bias (exact zeros in its softmax).
- Linear layers compute each row on its own when a call has a multiple of
  `ROW_MULTIPLE` rows, so every call is padded to one.

So a request with an explicit seed samples the same tokens alone or batched with any
other requests, with one thread or several, and log-probs equal to 1e-5; bit for bit
where the BLAS computes a row independently of the row count (docs/DESIGN.md,
"Reproducibility"; the tests check it).

Speed: for the architectures `_DecodeStep` knows (Qwen3, Qwen2, Llama), prefill and
decode run plain tensor ops over the weights with the active LoRA merged in, built once
per sampler weights and reused by every batch until other weights are sampled; other
architectures run the Hugging Face forward with the adapter. benchmarks/README.md has
the sampler's tokens/s against its compute limit.

Semantics (documented for users of the local backend):

- Log-probs are those of the distribution actually sampled from: logits / temperature,
  then top-k, renormalised, then top-p (keep the smallest head whose mass reaches p),
  renormalised. At temperature 1 with no top-k/top-p they equal a training forward's.
  Temperature 0 is greedy (first maximal token) with log-prob 0 (a point mass).
- A sequence stops at the model's end-of-turn token (``<|im_end|>``/EOS; kept in
  ``tokens``, dropped from ``text``), at a stop token id (kept in tokens and text), at a
  stop string (the token completing it is kept; ``text`` is the decode of the tokens, so
  it includes the stop string), all with ``stop_reason="stop"``; or after ``max_tokens``
  with ``stop_reason="length"``.
- ``text`` is ``tokenizer.decode(tokens, skip_special_tokens=False)`` minus a trailing
  end-of-turn token.
- Prompt log-probs use the raw (temperature 1) distribution; the first entry is None.

Modules: ``validation`` (requests to ``SampleSpec``), ``attention`` (the prefill's per-row
KV cache and attention, also the Hugging Face path's decode), ``merged`` (the merged step),
``decode`` (its decode step: one attention call per layer, the batch shrinking as rows
finish), ``choice`` (random streams and token choice), ``loop`` (prefill, the decode loop,
responses).
"""
