"""GGUF quantized blocks next to the float32 weights, for the CPU decoding kernel.

A GGUF model is converted once into float32 Hugging Face weights (`gguf_loader.py`); those are
what every path computes with. On an x86-64 CPU (`ModelConfig.matmul_impl == "cpu_kernel"`)
decoding is bound by reading the weights, so `attach_gguf_blocks` also keeps the file's own
Q4_1 / Q8_0 blocks of every linear layer and of the embedding (uint8 rows, 5 and 8.5 bits a
weight) beside the float32 arrays: `params[...]["q_proj"]["q4_1"]` next to `["kernel"]`,
`params["embed_tokens"]["q8_0"]` next to `["embedding"]`, each with its blocks' scales converted
to float32 once (`"q4_1_scales"`: the kernel reads them with broadcasts). The blocks of q / k / v
and of gate / up, which multiply the same input, are concatenated into one node each
(`params[...]["self_attn"]["qkv_proj"]`, `["mlp"]["gate_up_proj"]`): one kernel call for them.
The kernel dequantises them in registers exactly as the converter did (`kernels/cpu_matmul.cc`),
so a product with the blocks equals the float32 kernel's product with the converted weights bit
for bit; products of more than `ModelConfig.kernel_rows` rows (prefill chunks) use the float32
weights.

Each attached tensor is checked against its float32 counterpart (dequantised and compared
exactly); a mismatch (a stale conversion, a different file) raises and names the tensor.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels.cpu_matmul import QUANT_BLOCK_BYTES, block_scales, quant_kind
from .config import ModelConfig
from .gguf_loader import GGUFModel, _unpermute_rows

# Host arrays become device arrays through jax.device_put, not jnp.asarray: JAX 0.10's jnp.asarray compiles
# a program per shape, about 60 of them at an Engine's start (1-1.5 s, read from the compilation cache).

_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


# Projections of the same input whose blocks are concatenated (along their outputs) into one node,
# so a decoding step makes one kernel call for them (`layers.fused_product`).
_FUSED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def _fuse(group: dict, fused: str, names: tuple[str, ...]) -> dict:
    """`group` with the blocks and scales of `names` (stacked [L, N, ...]) moved into one node
    `fused` [L, sum N, ...], if all of them hold blocks of one kind; else `group` unchanged. The
    float32 kernels stay where they are (prefill and the XLA path use them)."""
    kinds = {quant_kind(group[n]) for n in names}
    if len(kinds) != 1 or None in kinds:
        return group
    kind = kinds.pop()
    keys = (kind, f"{kind}_scales")
    out = dict(group)
    out[fused] = {key: jax.device_put(np.concatenate([np.asarray(group[n][key]) for n in names], axis=1))
                  for key in keys}
    for n in names:
        out[n] = {k: v for k, v in group[n].items() if k not in keys}
    return out


class QuantizedLayoutError(ValueError):
    """GGUF blocks that do not reproduce the loaded float32 weights."""


def _blocks(model: GGUFModel, hf_name: str, cfg: ModelConfig) -> Optional[tuple[str, np.ndarray]]:
    """(kind, uint8 rows [N, K/32 * bytes]) of one HF weight [N, K], or None if its type has no kernel."""
    kind = model.tensor_type(hf_name).lower()
    if kind not in QUANT_BLOCK_BYTES:
        return None
    n, k = model.hf_shape(hf_name)
    if k % 32:
        return None
    t = model._tensors[hf_name]
    rows = np.asarray(t.data).reshape(n, k // 32 * QUANT_BLOCK_BYTES[kind])
    if model.architecture == "llama":  # the converter un-permutes q/k rows; blocks sit inside rows
        if hf_name.endswith("self_attn.q_proj.weight"):
            rows = _unpermute_rows(rows, cfg.num_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            rows = _unpermute_rows(rows, cfg.num_kv_heads)
    return kind, np.ascontiguousarray(rows)


def _dequantize_rows(kind: str, rows: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(rows, GGMLQuantizationType[kind.upper()]).astype(np.float32)


CHECK_ROWS = 24  # rows of each tensor that check="rows" dequantizes


def _sample(n: int) -> np.ndarray:
    """`CHECK_ROWS` row indices spread evenly over [0, n) (all of them when n is smaller)."""
    return np.unique(np.linspace(0, n - 1, min(n, CHECK_ROWS)).round().astype(int))


def _check(name: str, kind: str, rows: np.ndarray, want_nk: np.ndarray, sample: bool = False) -> None:
    if sample and rows.shape[0] == want_nk.shape[0]:
        pick = _sample(rows.shape[0])
        rows, want_nk = rows[pick], want_nk[pick]
    got = _dequantize_rows(kind, rows)
    if got.shape != want_nk.shape or not np.array_equal(got, want_nk):
        raise QuantizedLayoutError(f"GGUF {kind} blocks of {name!r} do not reproduce the loaded float32 weights "
                                   f"(shape {got.shape} vs {want_nk.shape}); the converted model is stale or "
                                   f"from another file")


def attach_gguf_blocks(params, cfg: ModelConfig, gguf_path: str | os.PathLike, *, check: str = "all",
                       log: Optional[Callable[[str], None]] = None,
                       reference: Optional[Callable[[str], np.ndarray]] = None):
    """`params` (stacked layers, as `load_hf_dir` returns them) with the GGUF's quantized blocks
    added beside every float32 weight they reproduce. check: "all" (every row of every tensor),
    "rows" (a spread of `CHECK_ROWS` rows of every tensor: another file's or a misplaced tensor's
    blocks fail it, in a hundredth of the time; what `Engine` uses), "first" (layer 0 and the
    embedding) or "none". `reference` (HF name → the checkpoint's [out, in] weights) is what the
    check compares with where `params` hold a placeholder (`load_hf_dir(omit=...)`, see
    `gguf_kernel_paths`). Returns a new dict; the input is not modified."""
    if check not in ("all", "rows", "first", "none"):
        raise ValueError(f"check must be 'all', 'rows', 'first' or 'none', got {check!r}")
    t0 = time.perf_counter()
    model = GGUFModel(gguf_path)
    out = dict(params)
    layers = {k: dict(v) for k, v in params["layers"].items()}
    n_bytes = 0
    for group, name in _LINEARS:
        per_layer = []
        stacked = None  # the float32 weights [L, K, N] as numpy, taken once (not a jax slice per layer)
        for i in range(cfg.num_layers):
            hf = f"model.layers.{i}.{group}.{name}.weight"
            got = _blocks(model, hf, cfg)
            if got is None:
                per_layer = None
                break
            kind, rows = got
            if check in ("all", "rows") or (check == "first" and i == 0):
                if stacked is None:
                    stacked = np.asarray(params["layers"][group][name]["kernel"])
                if stacked.size:
                    want = stacked[i].T
                elif reference is None:
                    raise ValueError(f"the float32 weights of {hf!r} were not loaded: pass reference= to check them")
                else:
                    want = reference(hf)
                _check(hf, kind, rows, want, sample=check == "rows")
            per_layer.append((kind, rows))
        if not per_layer or len({k for k, _ in per_layer}) != 1:
            continue  # unquantized, or mixed types across layers: the float32 path
        kind = per_layer[0][0]
        sub = dict(layers[group])
        sub[name] = dict(sub[name], **{kind: jax.device_put(np.stack([r for _, r in per_layer])),
                                       f"{kind}_scales": jax.device_put(np.stack([block_scales(r, kind)
                                                                                  for _, r in per_layer]))})
        layers[group] = sub
        n_bytes += sum(r.nbytes for _, r in per_layer) + sub[name][f"{kind}_scales"].nbytes
    for group, fused, names in _FUSED:
        layers[group] = _fuse(layers[group], fused, names)
    out["layers"] = layers
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    got = _blocks(model, head, cfg) if head in model._tensors else None
    if got is not None:
        kind, rows = got
        key = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        want = params[key]["embedding"] if cfg.tie_word_embeddings else np.asarray(params[key]["kernel"]).T
        if check != "none":
            _check(head, kind, rows, np.asarray(want), sample=check == "rows")
        out[key] = dict(params[key], **{kind: jax.device_put(rows),
                                        f"{kind}_scales": jax.device_put(block_scales(rows, kind))})
        n_bytes += rows.nbytes + out[key][f"{kind}_scales"].nbytes
    if log:
        log(f"attached {n_bytes / 2**20:.0f} MiB of GGUF blocks and scales from {os.path.basename(str(gguf_path))} "
            f"in {time.perf_counter() - t0:.1f}s")
    return out


ACTIVATIONS = ("auto", "float32", "int8")


def resolve_activations(activations: str) -> str:
    """"auto" → "int8" where the kernel has int8 rows of x (`kernels.cpu_qx.available()`: AVX512-VNNI
    or AVX2), else "float32"; other choices are checked."""
    from ..kernels import cpu_qx

    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if activations == "auto":
        return "int8" if cpu_qx.available() else "float32"
    if activations == "int8" and not cpu_qx.available():
        raise RuntimeError("activations 'int8' need the CPU kernel with int8 rows of x (AVX512-VNNI or AVX2), "
                           "which this machine lacks")
    return activations


def _map_nodes(params, visit):
    """`params` rebuilt bottom-up (dicts copied, lists and tuples of unrolled layers kept as such,
    arrays shared), each dict replaced by `visit(original, copy)`: the copy already holds its
    children's results, and `visit` may change it and returns what takes the node's place."""

    def walk(node):
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        if not isinstance(node, dict):
            return node
        return visit(node, {k: walk(v) for k, v in node.items()})

    return walk(params)


def regroup_for_int8(params):
    """`params` with every node's GGUF blocks ("q4_1" / "q8_0" and their scales, as
    `attach_gguf_blocks` leaves them, stacked layers and fused projections included) regrouped for
    int8 rows of x ("q4_1x8" / "q8_0x8", `kernels.cpu_qx.regroup`): the kernel's products then round
    each 32-value block of x to int8 and multiply as llama.cpp does, instead of computing the
    converted float32 model exactly. A node whose outputs are not a multiple of 16 keeps its blocks.
    The float32 weights stay (products of more than `ModelConfig.kernel_rows` rows use them; the
    Engine lifts that limit under int8 rows)."""
    from ..kernels.cpu_qx import COLS, regroup

    def visit(node, out):
        kind = quant_kind(node)
        if kind in QUANT_BLOCK_BYTES and node[kind].shape[-2] % COLS == 0:
            del out[kind], out[f"{kind}_scales"]
            out[f"{kind}x8"] = jax.device_put(regroup(np.asarray(node[kind]), f"{kind}x8"))
        return out

    return _map_nodes(params, visit)


def drop_shadowed_kernels(params):
    """`params` (as `regroup_for_int8` leaves them) without the float32 weights that only products
    of more than `ModelConfig.kernel_rows` rows would read: every "kernel" of a node holding GGUF
    blocks, and of the projections whose blocks were fused into a group's "qkv_proj" / "gate_up_proj"
    node, becomes an empty float32 array. For an Engine under int8 rows of x, which lifts that limit
    (every product, prefill chunks included, goes through the blocks): SmolLM2's 425 MB of float32
    layer weights are never read. A product that still asked for them would fail to trace (a shape
    error), never compute with the wrong weights. Embeddings stay (token lookups read them)."""

    def empty(a):  # [K, N] -> [0]; stacked [L, K, N] -> [L, 0] (the layout's leading axis stays)
        if a.size == 0:  # already a placeholder (`load_hf_dir(omit=...)`)
            return a
        return jax.device_put(np.zeros((*a.shape[:-2], 0), a.dtype))

    def strip(node: dict) -> dict:
        return {k: empty(v) if k == "kernel" else v for k, v in node.items()}

    def visit(node, out):
        out.update({n: strip(v) for n, v in out.items() if isinstance(v, dict) and _fused_with_blocks(out, n)})
        return strip(out) if "kernel" in out and quant_kind(out) is not None else out

    return _map_nodes(params, visit)


def _fused_with_blocks(group: dict, name: str) -> bool:
    """Whether projection `name` of a layer group was fused into a node of the group (`_FUSED`) that
    holds GGUF blocks: its products then read those, not its own weights."""
    return any(name in names and isinstance(group.get(fused), dict) and quant_kind(group[fused]) is not None
               for _, fused, names in _FUSED)


def gguf_kernel_paths() -> tuple[tuple[str, ...], ...]:
    """The param paths of the stacked float32 layer weights that GGUF blocks can replace: what an
    Engine under int8 rows of x need not read at all (`load_hf_dir(omit=...)`; the blocks are checked
    against the checkpoint's tensors instead, `attach_gguf_blocks(reference=...)`), provided every
    one of them then holds blocks (`kernels_without_blocks`)."""
    return tuple(("layers", group, name, "kernel") for group, name in _LINEARS)


def kernels_without_blocks(params, paths) -> list[tuple[str, ...]]:
    """Those of `paths` (`gguf_kernel_paths`) whose node holds no GGUF blocks, not even through its
    fused group's node: products would need their float32 weights."""
    missing = []
    for path in paths:
        group, name = params[path[0]][path[1]], path[2]
        if quant_kind(group[name]) is None and not _fused_with_blocks(group, name):
            missing.append(path)
    return missing


DRAFT_ROWS = ("auto", "b16", "i8", "q8_0x8", "q4_1x8", "q8_0", "q4_1", "f16")


def _with_dense_rows(params, rows_for):
    """`params` with `rows_for(kernel)`'s entries merged into every 2-D float32 Dense node (those
    with a "kernel"); `rows_for` returns the entries to add or replace, or {} to leave the node."""

    def visit(node, out):
        w = node.get("kernel")
        if w is not None and getattr(w, "ndim", 0) == 2 and w.dtype == jnp.float32:
            out.update(rows_for(np.asarray(w)))
        return out

    return _map_nodes(params, visit)


def attach_q8_0_rows(params):
    """A draft head quantised for the CPU kernel: every 2-D Dense `kernel` [in, out] (in % 32 == 0)
    becomes GGUF Q8_0 rows [out, in/32 blocks] plus their float32 scales ("q8_0", "q8_0_scales"),
    and the float32 `kernel` is replaced by those rows dequantised, so every path (the kernel's
    few-row products, XLA's larger ones) computes the same quantised head. A quarter of float32's
    bytes, 53% of float16's; drafting only proposes tokens, so the output stays lossless."""
    return _attach_quant_rows(params, "q8_0")


def attach_q4_1_rows(params):
    """`attach_q8_0_rows` with GGUF Q4_1 blocks ("q4_1", "q4_1_scales"): 5 bits a weight (59% of
    Q8_0's bytes), coarser drafts."""
    return _attach_quant_rows(params, "q4_1")


def attach_q8_0x8_rows(params):
    """`attach_q8_0_rows`' blocks regrouped for int8 rows of x (`regroup_for_int8`, "q8_0x8"): the same
    quantised head, multiplied as the target's layers are under `activations="int8"` (each 32-value
    block of a row of x rounded to int8, the products summed exactly in int32; AVX512-VNNI or AVX2).
    A node whose outputs are not a multiple of 16 keeps its Q8_0 blocks."""
    return regroup_for_int8(attach_q8_0_rows(params))


def attach_q4_1x8_rows(params):
    """`attach_q8_0x8_rows` with Q4_1 blocks ("q4_1x8"): the head quantised to Q4_1 (5 bits a
    weight, 62% of int8 tiles' bytes), multiplied on int8 rows of x as the target's Q4_1 layers are."""
    return regroup_for_int8(attach_q4_1_rows(params))


def _attach_quant_rows(params, kind: str):
    from gguf import GGMLQuantizationType, quants

    qt = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}[kind]

    def rows_for(w):
        if w.shape[0] % 32:
            return {}
        blocks = quants.quantize(np.ascontiguousarray(w.T), qt)
        return {"kernel": jax.device_put(np.ascontiguousarray(quants.dequantize(blocks, qt).astype(np.float32).T)),
                kind: jax.device_put(blocks), f"{kind}_scales": jax.device_put(block_scales(blocks, kind))}

    return _with_dense_rows(params, rows_for)


def attach_b16_rows(params):
    """A draft head rounded to bfloat16 for the CPU kernel's AVX512-BF16 products: every 2-D Dense
    `kernel` [in, out] (in even, at most 16384) gains its bfloat16 values packed in 64-column tiles
    ("b16", `kernels.cpu_matmul.pack_b16`: each tile's weights contiguous, so a cold head streams
    from memory at full speed), and the float32 `kernel` is replaced by those values, so XLA's
    products use the same weights. Half of float32's bytes; the rows of x are rounded to bfloat16 as
    well, so drafts are approximate (the output stays lossless: drafts are only proposals)."""
    from ..kernels.cpu_matmul import B16_MAX_K, pack_b16, unpack_b16

    def rows_for(w):
        if w.shape[0] % 2 or w.shape[0] > B16_MAX_K:  # left to XLA's float32 product
            return {}
        packed = pack_b16(w)
        return {"kernel": jax.device_put(unpack_b16(packed, w.shape[1])), "b16": jax.device_put(packed)}

    return _with_dense_rows(params, rows_for)


def attach_i8_rows(params):
    """A draft head quantised to int8 for the CPU kernel's AVX512-VNNI products: every 2-D Dense
    `kernel` [in, out] (in % 16 == 0, at most 16384) gains int8 values with one scale per output
    column, packed in 64-column tiles ("i8", "i8_scales": `kernels.cpu_matmul.pack_i8`), and the
    float32 `kernel` is replaced by those values dequantised, so XLA's products use the same weights.
    A quarter of float32's bytes; the kernel rounds each row of x to int8 too, so drafts are
    approximate (the output stays lossless: drafts are only proposals)."""
    from ..kernels.cpu_matmul import I8_MAX_K, pack_i8, unpack_i8

    def rows_for(w):
        if w.shape[0] % 16 or w.shape[0] > I8_MAX_K:  # left to XLA's float32 product
            return {}
        packed, scales = pack_i8(w)
        return {"kernel": jax.device_put(unpack_i8(packed, scales, w.shape[1])), "i8": jax.device_put(packed),
                "i8_scales": jax.device_put(scales)}

    return _with_dense_rows(params, rows_for)


def resolve_draft_rows(rows: str) -> str:
    """"auto" → "q4_1x8" where the kernel has int8 rows of x (AVX512-VNNI or AVX2), else "b16" where
    it has AVX512-BF16, else "q8_0"; other choices are checked. A step reads the head from memory
    (the target's pass evicts it), so its bytes decide. Stop 76, the Zen 4 VM, one process, 8 + 8
    held-out prompts in turns (`python -m eagle_jax.bench turns`): EAGLE-3 at its packaged 3-token
    tree 1.523x plain decoding with Q4_1 blocks on int8 rows (5 bits a weight) against 1.428x
    with int8 tiles (i8, 8 bits; the default where the CPU has AVX512-VNNI from stop 73), tau
    2.169 / 2.172; the kernels' AVX2 build against q8_0x8 (its default from stop 63): 1.173x /
    1.161x at its 2-token tree, 1.342x / 1.228x at 3 tokens."""
    from ..kernels import cpu_qx
    from ..kernels.cpu_matmul import b16_available, i8_available

    if rows not in DRAFT_ROWS:
        raise ValueError(f"draft rows must be one of {DRAFT_ROWS}, got {rows!r}")
    if rows == "auto":
        return "q4_1x8" if cpu_qx.available() else "b16" if b16_available() else "q8_0"
    if rows == "b16" and not b16_available():
        raise RuntimeError("draft rows 'b16' need the CPU kernel built with AVX512-BF16, which this machine lacks")
    if rows == "i8" and not i8_available():
        raise RuntimeError("draft rows 'i8' need the CPU kernel built with AVX512-VNNI, which this machine "
                           "lacks")
    if rows in ("q8_0x8", "q4_1x8") and not cpu_qx.available():
        raise RuntimeError(f"draft rows {rows!r} need the CPU kernel's int8 rows of x (AVX512-VNNI or AVX2), "
                           "which this machine lacks")
    return rows


def attach_f16_rows(params):
    """Beside every 2-D Dense `kernel` [in, out] whose float32 values are all float16 numbers (a head
    stored in float16), keep them as float16 rows [out, in] ("f16"): `KernelDense` then reads half
    the bytes for the same float32 products (the kernel widens them exactly). A kernel that float16
    cannot hold exactly is left alone."""

    def rows_for(w):
        h = w.astype(np.float16)
        if w.shape[0] % 16 or not np.array_equal(h.astype(np.float32), w):
            return {}
        return {"f16": jax.device_put(np.ascontiguousarray(h.T))}

    return _with_dense_rows(params, rows_for)


def attach_draft_rows(params, rows: str):
    """The compact rows a draft head keeps for the CPU kernel: "b16" (`attach_b16_rows`), "i8"
    (`attach_i8_rows`), "q8_0x8" (`attach_q8_0x8_rows`), "q4_1x8" (`attach_q4_1x8_rows`), "q8_0"
    (`attach_q8_0_rows`), "q4_1"
    (`attach_q4_1_rows`), "f16" (`attach_f16_rows`: the stored float16 values, exactly) or "auto"
    (`resolve_draft_rows`)."""
    rows = resolve_draft_rows(rows)
    return {"b16": attach_b16_rows, "i8": attach_i8_rows, "q8_0x8": attach_q8_0x8_rows, "q4_1x8": attach_q4_1x8_rows,
            "q8_0": attach_q8_0_rows,
            "q4_1": attach_q4_1_rows, "f16": attach_f16_rows}[rows](params)
