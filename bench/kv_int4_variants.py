"""Which 4-bit KV format reaches the issue's 3% (issue 42)? Simulated int4 variants on real SmolLM2.

Each variant is a quantize-dequantize pair applied to the Hadamard-rotated K and V as the generic
path writes them (a float32 cache holding the dequantized rotated rows, queries and outputs
rotated as a quantized cache's are): the perplexity it would give, whatever the readers. Every
variant's stored bytes are counted per 64 values at float16 scales (the issue's 16-bit figure;
float16 is 128 bytes): 36 is 3.56x. Scales and biases are rounded to float16 as stored.

Measured per variant: perplexity over the quality bench's text (``--tokens`` in ``--rows`` chunks,
one prefill forward each, every position read back from the cache), its ratio to the float
cache's, the mean KL divergence of the next-token distribution from the float cache's, the top-1
agreement; then greedy agreement over ``--prompts`` prompts of 64 corpus tokens after the scored
part, ``--new`` greedy tokens each (prefill and decode steps through the generic path): the share
of sequences identical to the float cache's and the share of tokens before the first divergence.

The calibrated variants' per-layer K/V means and key channel scales come from one forward over
``--calibration`` (default /usr/share/common-licenses/GPL-3's first 1,024 tokens).
bench/results/kv_int4_variants.json merges the runs docs/benchmarks.md quotes.

    .venv/bin/python bench/kv_int4_variants.py                 # every variant, perplexity only
    .venv/bin/python bench/kv_int4_variants.py --variant lsq64 --variant q4_0 --greedy ""
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_serving.models import loader, sources
from mlx_serving.models.decoder import layers
from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.kv_cache import PagedKVCache, init_paged_kv_cache, row_blocks
from mlx_serving.models.decoder.kv_quantizer import fit_int4
from mlx_serving.tokenization import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from cpu_decode import default_corpus  # noqa: E402

Quant = Callable[[mx.array], mx.array]  # rotated (..., D) float32 -> dequantized, same shape
F16 = mx.float16

#: Lloyd-Max levels of a unit Gaussian, 16 levels (Max 1960), positive half.
GAUSS16 = (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0691, 2.7326)
#: NF4 (QLoRA, Dettmers et al. 2023): the 16 levels in [-1, 1].
NF4 = (-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
       0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0)


def _f16(x: mx.array) -> mx.array:
    return x.astype(F16).astype(mx.float32)


def _groups(x: mx.array, g: int) -> mx.array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def affine_lsq(bits: int, g: int, shrink: int = 5, refits: int = 2) -> Quant:
    """fit_int4's search at any bit width: [min, max] x (1, 0.95, ...) of least error, Lloyd refits
    of scale and bias; float16 scale and bias (codes rounded for them)."""
    levels = float(2**bits - 1)

    def codes(x: mx.array, s: mx.array, b: mx.array) -> mx.array:
        return mx.clip(mx.round((x - b) / s), 0.0, levels)

    def q(x: mx.array) -> mx.array:
        xg = _groups(x, g)[..., None, :]  # (..., n, 1, g)
        f = mx.array([1.0 - 0.05 * j for j in range(shrink)])[:, None]  # (A, 1)
        lo, hi = xg.min(-1, keepdims=True) * f, xg.max(-1, keepdims=True) * f  # (..., n, A, 1)
        s = mx.maximum((hi - lo) / levels, 1e-7)
        err = ((codes(xg, s, lo) * s + lo - xg) ** 2).sum(-1, keepdims=True)
        best = mx.argmin(err, axis=-2, keepdims=True)
        s, b = mx.take_along_axis(s, best, -2)[..., 0, :], mx.take_along_axis(lo, best, -2)[..., 0, :]
        xg = xg[..., 0, :]
        n = float(g)
        for _ in range(refits):
            c = codes(xg, s, b)
            sq, sx, sqq, sqx = c.sum(-1, keepdims=True), xg.sum(-1, keepdims=True), (c * c).sum(-1, keepdims=True), (
                c * xg).sum(-1, keepdims=True)
            den, num = n * sqq - sq * sq, n * sqx - sq * sx
            fit = num / mx.where(den > 0, den, 1.0)
            ok = (den > 0) & (mx.abs(fit) >= 1e-7)
            s_new = mx.where(ok, fit, s)
            b = mx.where(ok, (sx - s_new * sq) / n, b)
            s = s_new
        s, b = _f16(s), _f16(b)
        return (codes(xg, s, b) * s + b).reshape(x.shape)

    return q


def fit_int4_g(g: int) -> Quant:
    """The shipped writer (:func:`fit_int4`), float16 scales."""
    def q(x: mx.array) -> mx.array:
        w, s, b = fit_int4(x, g, F16)
        return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=g, bits=4)
    return q


def mx_affine(g: int, bits: int = 4) -> Quant:
    """``mx.quantize``'s [min, max] scale and bias, float16 (codes rounded for them)."""
    def q(x: mx.array) -> mx.array:
        levels = float(2**bits - 1)
        xg = _groups(x, g)
        lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
        s, b = _f16(mx.maximum((hi - lo) / levels, 1e-7)), _f16(lo)
        return (mx.clip(mx.round((xg - b) / s), 0, levels) * s + b).reshape(x.shape)
    return q


def q4_0(g: int = 32) -> Quant:
    """llama.cpp's q4_0: one float16 scale per ``g``, d = (the value of largest magnitude) / -8,
    codes round(x / d) + 8 clipped to 0..15."""
    def q(x: mx.array) -> mx.array:
        xg = _groups(x, g)
        idx = mx.argmax(mx.abs(xg), axis=-1, keepdims=True)
        d = _f16(mx.take_along_axis(xg, idx, -1) / -8.0)
        d = mx.where(d == 0, 1.0, d)
        c = mx.clip(mx.round(xg / d) + 8, 0, 15)
        return ((c - 8) * d).reshape(x.shape)
    return q


def codebook(levels: tuple[float, ...], g: int, init: str, refits: int = 3,
             grid: tuple[float, ...] = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2)) -> Quant:
    """Non-uniform 4-bit levels ``c_j`` (16, a table the readers would look up): ``x ~ s * c`` per
    group of ``g`` (one float16 ``s``). ``s`` starts at the group's RMS (``init`` "rms") or
    absmax / max|c| ("absmax") times the ``grid`` factor of least error, then ``refits`` Lloyd
    steps (nearest level, least-squares ``s``)."""
    table = mx.array(sorted(levels), dtype=mx.float32)
    mids = (table[1:] + table[:-1]) / 2

    def nearest(y: mx.array) -> mx.array:
        return table[(y[..., None] > mids).sum(-1)]

    def q(x: mx.array) -> mx.array:
        xg = _groups(x, g)
        if init == "rms":
            base = mx.sqrt((xg * xg).mean(-1, keepdims=True))
        else:
            base = mx.abs(xg).max(-1, keepdims=True) / float(max(abs(v) for v in levels))
        s_all = (mx.maximum(base, 1e-7) * mx.array(grid))[..., None]  # (..., n, A, 1)
        xs = xg[..., None, :]
        err = ((nearest(xs / s_all) * s_all - xs) ** 2).sum(-1, keepdims=True)
        s = mx.take_along_axis(s_all, mx.argmin(err, axis=-2, keepdims=True), -2)[..., 0, :]
        for _ in range(refits):
            c = nearest(xg / s)
            s_new = (c * xg).sum(-1, keepdims=True) / mx.maximum((c * c).sum(-1, keepdims=True), 1e-12)
            s = mx.where(mx.abs(s_new) >= 1e-7, s_new, s)
        s = _f16(s)
        return (nearest(xg / s) * s).reshape(x.shape)

    return q


def gauss16() -> tuple[float, ...]:
    return tuple(sorted([-v for v in GAUSS16] + list(GAUSS16)))


def float_kv(x: mx.array) -> mx.array:
    return x


def per_channel(tokens: int, inner: Quant) -> Quant:
    """KIVI's keys (Liu et al. 2024): each channel quantized over ``tokens`` consecutive tokens
    (``inner`` along the token axis), in the model's basis (the rotation after). Only a write of a
    whole number of such groups (the prefill of the scored chunks) is quantized; a shorter one
    (a decode step) stays float, as KIVI's float residual window."""
    def q(x: mx.array) -> mx.array:
        n, h, d = x.shape
        if n % tokens:
            return x
        g = x.reshape(n // tokens, tokens, h, d).transpose(0, 2, 3, 1)
        return inner(g).transpose(0, 3, 1, 2).reshape(n, h, d)
    return q


@dataclasses.dataclass
class SimCache(PagedKVCache):
    """A float32 cache holding the rotated K/V after ``qk`` / ``qv`` (quantize then dequantize); the
    queries and outputs rotated as a quantized cache's."""

    qk: Quant = float_kv
    qv: Quant = float_kv
    #: Per layer ``(Hkv, D)``, in the model's basis: a fixed key subtracted before quantizing and not
    #: added back (attention is unchanged: ``q . mu`` shifts a query's every score alike), a value
    #: one subtracted and added back (exact: the softmax weights sum to 1; a model would fold it
    #: into o_proj's bias), and per-channel key scales ``a`` (keys stored as ``a * k``, queries read
    #: as ``q / a``: the same scores). Empty: none.
    mu_k: list[mx.array] = dataclasses.field(default_factory=list)
    mu_v: list[mx.array] = dataclasses.field(default_factory=list)
    scale_k: list[mx.array] = dataclasses.field(default_factory=list)
    #: When set, every layer's K, V rows ``(N, Hkv, D)`` and queries ``(B, H, T, D)`` are appended
    #: here (calibration).
    record: list[dict[str, list[mx.array]]] | None = None
    #: Quantize keys in the model's basis (then rotate), not the rotated one.
    k_model_basis: bool = False
    _calls: int = 0

    def write(self, i: int, k: mx.array, v: mx.array, rows: mx.array) -> None:
        k, v = k.astype(mx.float32), v.astype(mx.float32)
        if self.record is not None:
            self.record[i]["k"].append(k)
            self.record[i]["v"].append(v)
        if self.mu_k:
            k = k - self.mu_k[i]
        if self.scale_k:
            k = k * self.scale_k[i]
        mu_v = self.mu_v[i] if self.mu_v else mx.zeros_like(v[0])
        kr = mx.hadamard_transform(self.qk(k)) if self.k_model_basis else self.qk(mx.hadamard_transform(k))
        vr = self.qv(mx.hadamard_transform(v - mu_v)) + mx.hadamard_transform(mu_v)
        self.keys[i][rows], self.values[i][rows] = kr.astype(self.keys[i].dtype), vr.astype(self.values[i].dtype)

    def rotate(self, x: mx.array) -> mx.array:
        """Called twice per layer by the generic path's attention: its queries, then its output."""
        layer, is_query = (self._calls // 2) % len(self.keys), self._calls % 2 == 0
        self._calls += 1
        if is_query and self.record is not None:
            self.record[layer]["q"].append(x.astype(mx.float32))
        if is_query and self.scale_k:
            a = self.scale_k[layer]  # (Hkv, D); query head h reads KV head h // (H / Hkv)
            x = x / mx.repeat(a, x.shape[1] // a.shape[0], axis=0)[None, :, None, :].astype(x.dtype)
        return mx.hadamard_transform(x)


@dataclasses.dataclass(frozen=True)
class Variant:
    """Bytes per 64 values (K and V averaged, float16 scales), the K and V quantizers, and whether
    K and V are centred by the calibrated per-layer means and keys scaled per channel
    (:class:`SimCache`'s ``mu_k`` / ``mu_v`` / ``scale_k``)."""

    nbytes: int
    qk: Quant
    qv: Quant
    center_k: bool = False
    center_v: bool = False
    scale_k: bool = False
    k_model_basis: bool = False
    ppl_only: bool = False


#: Calibrated per layer ``(Hkv, D)``: the mean K, the mean V, the query-aware key scales.
CALIB: dict[str, list[mx.array]] = {"mu_k": [], "mu_v": [], "scale_k": []}


def calibrate(state: layers.State, ids: np.ndarray) -> None:
    """Set :data:`CALIB` from one forward of ``ids`` (one row): per layer the mean K and V, and
    ``a = (E[q_c^2] / Var[k_c]) ** (1/4)`` per channel (queries summed over each KV head's group;
    geometric mean 1), which minimizes the score error ``E[(q . dk)^2]`` of an error isotropic in
    the rotated basis (Cauchy-Schwarz)."""
    n = len(ids)
    cache = sim_cache(state, -(-n // 16), Variant(128, float_kv, float_kv))
    cache.record = [{"k": [], "v": [], "q": []} for _ in state.layers]
    z = mx.zeros((1,), mx.int32)
    mx.eval(layers.forward(state, cache, Rows(mx.array(ids[None].astype(np.int32)), z, mx.full((1,), n, mx.int32), n,
                                              mx.full((1,), n - 1, mx.int32), mx.array(row_blocks(1, n)))))
    for rec in cache.record:
        k, v = mx.concatenate(rec["k"]), mx.concatenate(rec["v"])  # (N, Hkv, D)
        q = mx.concatenate(rec["q"], axis=2)[0]  # (H, N, D)
        hkv = k.shape[1]
        qe = (q * q).mean(1).reshape(hkv, -1, q.shape[-1]).sum(1)  # (Hkv, D)
        mu = k.mean(0)
        ke = ((k - mu) ** 2).mean(0)
        a = (qe / mx.maximum(ke, 1e-12)) ** 0.25
        a = a / mx.exp(mx.log(a).mean(-1, keepdims=True))
        CALIB["mu_k"].append(mu)
        CALIB["mu_v"].append(v.mean(0))
        CALIB["scale_k"].append(a)
    mx.eval(*(x for xs in CALIB.values() for x in xs))


def sim_cache(state: layers.State, num_blocks: int, var: Variant) -> SimCache:
    base = init_paged_kv_cache(state, num_blocks, 16, "auto")
    return SimCache(base.keys, base.values, 16, qk=var.qk, qv=var.qv, mu_k=CALIB["mu_k"] if var.center_k else [],
                    mu_v=CALIB["mu_v"] if var.center_v else [], scale_k=CALIB["scale_k"] if var.scale_k else [], k_model_basis=var.k_model_basis)


def _logp(logits: mx.array) -> np.ndarray:
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def scored(state: layers.State, chunks: np.ndarray, var: Variant) -> np.ndarray:
    """Next-token log-probabilities ``(rows, n - 1, vocab)`` of ``chunks`` ``(rows, n)``."""
    rows, n = chunks.shape
    cache = sim_cache(state, rows * -(-n // 16), var)
    z = mx.zeros((rows,), mx.int32)
    batch = Rows(mx.array(chunks.astype(np.int32)), z, mx.full((rows,), n, mx.int32), n, z,
                 mx.array(row_blocks(rows, n)), gather=mx.arange(rows * n, dtype=mx.int32))
    return _logp(layers.forward(state, cache, batch)).reshape(rows, n, -1)[:, :-1]


def greedy(state: layers.State, prompts: np.ndarray, new: int, var: Variant) -> np.ndarray:
    """``new`` greedy tokens ``(P, new)`` after each of ``prompts`` ``(P, L)``: one prefill forward,
    then one-token decode steps, all through the generic path."""
    p, n = prompts.shape
    table = mx.array(row_blocks(p, n + new))
    cache = sim_cache(state, int(table.size), var)
    z = mx.zeros((p,), mx.int32)
    rows = Rows(mx.array(prompts.astype(np.int32)), z, mx.full((p,), n, mx.int32), n, mx.full((p,), n - 1, mx.int32),
                table)
    tok = mx.argmax(layers.forward(state, cache, rows), axis=-1)
    out = [tok]
    for pos in range(n, n + new - 1):
        step = Rows(tok[:, None].astype(mx.int32), mx.full((p,), pos, mx.int32), mx.ones((p,), mx.int32), pos + 1,
                    z, table)
        tok = mx.argmax(layers.forward(state, cache, step), axis=-1)
        mx.eval(tok)
        out.append(tok)
    return np.array(mx.stack(out, axis=1))


def variants() -> dict[str, Variant]:
    """The variants by name (:class:`Variant`)."""
    lsq, g16 = fit_int4_g(64), gauss16()
    cb32 = codebook(g16, 32, init="rms")
    nf4 = codebook(NF4, 32, init="absmax")
    return {
        "float": Variant(128, float_kv, float_kv),
        "mx_affine64 (mx.quantize, the first int4)": Variant(36, mx_affine(64), mx_affine(64)),
        "lsq64 (shipped: fit_int4)": Variant(36, lsq, lsq),
        "lsq64 K only (V float)": Variant(82, lsq, float_kv),
        "lsq64 V only (K float)": Variant(82, float_kv, lsq),
        "q4_0 g32 (llama.cpp's)": Variant(36, q4_0(32), q4_0(32)),
        "gauss-LM codebook g32, scale only (rms grid + LS)": Variant(36, cb32, cb32),
        "NF4 g32, scale grid + LS": Variant(36, nf4, nf4),
        "lsq K5 / V3 g64": Variant(36, affine_lsq(5, 64), affine_lsq(3, 64)),
        "lsq K5 / V4 g64 (40 bytes, 3.2x, over budget)": Variant(40, affine_lsq(5, 64), lsq),
        "centred lsq64 (K and V means)": Variant(36, lsq, lsq, True, True),
        "centred-K lsq64": Variant(36, lsq, lsq, True, False),
        "centred NF4 g32": Variant(36, nf4, nf4, True, True),
        "query-scaled centred-K lsq64": Variant(36, lsq, lsq, True, False, True),
        "query-scaled centred lsq64": Variant(36, lsq, lsq, True, True, True),
        "query-scaled centred NF4 g32": Variant(36, nf4, nf4, True, True, True),
        "KIVI K per channel over 64 tokens (lsq), V lsq64 (prefill only)": Variant(
            36, per_channel(64, affine_lsq(4, 64)), lsq, k_model_basis=True, ppl_only=True),
        "KIVI K per channel over 64 tokens, rotated basis, V lsq64 (prefill only)": Variant(
            36, per_channel(64, affine_lsq(4, 64)), lsq, ppl_only=True),
        "lsq g32 scale+bias (3.2x, over budget)": Variant(40, affine_lsq(4, 32), affine_lsq(4, 32)),
        "lsq 5-bit g64 (2.9x, over budget)": Variant(44, affine_lsq(5, 64), affine_lsq(5, 64)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", help="a name prefix (repeatable; default: all)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--greedy", action="append", help="a name prefix whose greedy agreement is measured "
                    "(repeatable; default: none, '' for all)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--calibration", type=Path, default=Path("/usr/share/common-licenses/GPL-3"),
                    help="text whose first --calib-tokens tokens give the centred variants' means")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_int4_variants.json")
    args = ap.parse_args()
    resolved = sources.resolve(None)
    state = loader.load(resolved.path)
    state = dataclasses.replace(state, attention=None)  # the generic path: every write through SimCache.write
    ids = np.array(Tokenizer.from_dir(resolved.path).encode(default_corpus().read_text()))
    n = args.tokens // args.rows
    chunks = ids[: n * args.rows].reshape(args.rows, n)
    prompts = ids[n * args.rows: n * args.rows + 64 * args.prompts].reshape(args.prompts, 64)
    all_v = variants()
    chosen = [k for k in all_v if k == "float" or not args.variant or any(k.startswith(p) for p in args.variant)]
    tok = Tokenizer.from_dir(resolved.path)
    calibrate(state, np.array(tok.encode(args.calibration.read_text()))[: args.calib_tokens])
    ref = scored(state, chunks, all_v["float"])
    ref_nll = -np.take_along_axis(ref, chunks[:, 1:, None], -1)[..., 0]
    ref_top = ref.argmax(-1)
    ref_greedy = greedy(state, prompts, args.new, all_v["float"]) if args.greedy is not None else None
    results = {"model": resolved.name, "calibration": str(args.calibration), "tokens_scored": int(ref_nll.size), "loadavg_start": os.getloadavg(),
               "ppl_float": float(np.exp(ref_nll.mean())), "variants": {}}
    print(json.dumps({k: results[k] for k in ("tokens_scored", "ppl_float", "loadavg_start")}), flush=True)
    for name in chosen[1:]:
        var = all_v[name]
        c0 = time.process_time()
        lp = scored(state, chunks, var)
        nll = -np.take_along_axis(lp, chunks[:, 1:, None], -1)[..., 0]
        kl = float((np.exp(ref) * (ref - lp)).sum(-1).mean())
        wanted = args.greedy is not None and any(name.startswith(p) for p in args.greedy)
        g = greedy(state, prompts, args.new, var) if wanted and not var.ppl_only else None
        before = None if g is None else [next((j for j in range(args.new) if a[j] != b[j]), args.new)
                                         for a, b in zip(ref_greedy if ref_greedy is not None else g, g)]
        r = {"bytes_per_64": var.nbytes, "ratio_vs_float16": 128 / var.nbytes, "ppl": float(np.exp(nll.mean())),
             "ppl_ratio": float(np.exp(nll.mean() - ref_nll.mean())),
             "ppl_ratio_second_half": float(np.exp(nll[:, n // 2:].mean() - ref_nll[:, n // 2:].mean())),
             "kl": kl, "top1_agreement": float((lp.argmax(-1) == ref_top).mean()),
             "greedy_identical": None if before is None else float(np.mean([b == args.new for b in before])),
             "greedy_tokens_before_divergence": None if before is None else float(np.mean(before)) / args.new,
             "cpu_s": time.process_time() - c0, "loadavg": os.getloadavg()[0]}
        results["variants"][name] = r
        print(json.dumps({"variant": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}),
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
