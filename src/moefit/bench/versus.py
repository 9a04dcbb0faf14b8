"""``--vs transformers``: the same prompt through transformers.

The checkpoint is loaded with ``AutoModelForCausalLM`` (all of it: transformers has no
budget) in its own dtype on the same device, with the RoPE scaling the bench asked for
(``--rope-scaling linear|yarn --rope-scale F`` become the config's ``rope_parameters``, so
both run the same positions). The bench's longest prompt of a run is

- timed through ``generate`` (greedy, ``max_new_tokens`` = ``min_new_tokens`` = the bench's
  decode tokens, so EOS does not stop it) twice: one new token (the prefill), then all of
  them; the difference is the decode;
- continued greedily by the exact reference, transformers' full forward without a cache
  (``use_cache=False``, the whole sequence again for every token): ``generate``'s cached
  path is itself not exact (on fp32 checkpoints moefit equals the full forward token for
  token while ``generate`` drifts after a few tokens), so the tokens are compared with
  the full forward's (``reference`` in the record names it).

Reported beside the run: both throughputs, moefit's over transformers' (``prefill_tps_ratio``,
``decode_tps_ratio``), and whether the greedy tokens agree (``first_divergence``: the first
index where they differ). A quantized KV cache may legitimately make greedy outputs part
after a while.
"""

from __future__ import annotations

import gc
import importlib.util
import time
from pathlib import Path

import torch

from moefit.errors import InputError

#: checkpoint quantizations transformers loads only with ``accelerate`` installed
#: (``Mxfp4HfQuantizer`` / ``FineGrainedFP8HfQuantizer.validate_environment`` raise
#: ImportError without it; transformers/quantizers/quantizer_mxfp4.py, quantizer_finegrained_fp8.py)
NEEDS_ACCELERATE = ("mxfp4", "fp8")


def accelerate_installed() -> bool:
    """Whether the ``accelerate`` package can be imported (found, not imported)."""
    return importlib.util.find_spec("accelerate") is not None


#: what the greedy tokens are compared with (the record's ``reference``)
REFERENCE = "transformers full forward without a cache"


def check_reference(geom, gguf: bool = False) -> None:
    """Refuse ``--vs transformers`` before anything runs when transformers cannot load
    ``geom``'s checkpoint here: a GGUF file (``gguf``; the comparison loads a checkpoint
    directory), an mxfp4 or fp8 checkpoint without ``accelerate``
    (:data:`NEEDS_ACCELERATE`). Raises InputError naming the fix."""
    if gguf:
        raise InputError("--vs transformers compares with a transformers checkpoint directory "
                         "(config.json + *.safetensors); a GGUF file has none: bench the "
                         "checkpoint the file was made from, or drop --vs")
    method = geom.quant.method
    if method in NEEDS_ACCELERATE and not accelerate_installed():
        raise InputError(f"--vs transformers: transformers loads this {method} checkpoint only with "
                         "the accelerate package, which is not installed; install it (`pip install "
                         "accelerate`) or drop --vs")


class Reference:
    """transformers' model of ``model_dir`` on ``device`` (loaded on first use)."""

    def __init__(self, model_dir: str | Path, device: str, rope: dict | None = None):
        self.model_dir, self.device, self.rope = str(model_dir), device, rope
        self.model = None
        self.error: str | None = None
        self.cache: dict[tuple[int, ...], dict] = {}

    def _load(self):
        if self.model is not None or self.error is not None:
            return self.model
        try:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_dir)
            if self.rope:
                text = getattr(config, "text_config", None) or config
                text.rope_parameters = {**(text.rope_parameters or {}), **self.rope}
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, config=config, dtype="auto").to(self.device).eval()
        except Exception as e:   # any failure to load is reported, not fatal
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return self.model

    def _sync(self):
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, ids: list[int], new_tokens: int) -> dict:
        """Time ``ids`` + ``new_tokens`` greedy tokens through ``generate``, and take the
        same number of greedy tokens from the full forward without a cache (the tokens
        compared); cached per (prompt, count)."""
        key = (len(ids), new_tokens, hash(tuple(ids)))
        if key in self.cache:
            return self.cache[key]
        model = self._load()
        if model is None:
            return {"error": self.error}
        x = torch.tensor([ids], device=self.device)
        mask = torch.ones_like(x)
        kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
        try:
            self._sync()
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            self._sync()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            self._sync()
            total = time.perf_counter() - t0
            exact = self.full_forward(ids, new_tokens)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        timed = out[0, len(ids):].tolist()
        res = {"prompt_tokens": len(ids), "prefill_s": first, "prefill_tps": len(ids) / first,
               "decode_s": max(total - first, 1e-9), "tokens": exact,
               "generate_tokens": timed,
               "decode_tps": (len(timed) - 1) / max(total - first, 1e-9)}
        self.cache[key] = res
        return res

    def full_forward(self, ids: list[int], new_tokens: int) -> list[int]:
        """``new_tokens`` greedy tokens after ``ids``, each from a full forward pass of the
        whole sequence without a cache (``use_cache=False``): the exact reference."""
        model = self._load()
        seq = list(ids)
        for _ in range(new_tokens):
            x = torch.tensor([seq], device=self.device)
            logits = model(x, use_cache=False).logits[0, -1]
            seq.append(int(torch.argmax(logits.float())))
        return seq[len(ids):]

    def close(self) -> None:
        self.model = None
        gc.collect()
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()


def rope_parameters(geom, req) -> dict | None:
    """transformers' ``rope_parameters`` for the request's ``--rope-scaling`` (None: the
    config's own)."""
    if req.rope_scaling in ("linear", "yarn"):
        out = {"rope_type": req.rope_scaling, "factor": float(req.rope_scale)}
        if req.rope_scaling == "yarn":
            out["original_max_position_embeddings"] = req.yarn_orig_ctx or geom.rope.original_window
        return out
    if req.rope_scaling == "none":
        return {"rope_type": "default"}
    return None


def compare(run: dict, ref: dict) -> dict:
    """The ``vs_transformers`` entry of a run from transformers' timings ``ref``."""
    if "error" in ref:
        return {"error": ref["error"]}
    ours, theirs = run["greedy_tokens"], ref["tokens"]
    n = min(len(ours), len(theirs))
    first = next((i for i in range(n) if ours[i] != theirs[i]), None)
    return {
        "reference": REFERENCE, "prompt_tokens": ref["prompt_tokens"], "decode_tokens": n,
        "transformers_prefill_tps": ref["prefill_tps"], "transformers_decode_tps": ref["decode_tps"],
        "prefill_tps_ratio": run["prefill_tps"] / ref["prefill_tps"],
        "decode_tps_ratio": run["decode_tps"] / ref["decode_tps"] if ref["decode_tps"] else 0.0,
        "greedy_agree": first is None and len(ours) == len(theirs),
        "first_divergence": first if first is not None else (n if len(ours) != len(theirs) else None),
    }
