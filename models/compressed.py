"""compressed-tensors checkpoints (what llm-compressor writes): the schemes this engine runs as stored,
and the engine backends built from the stored tensors.

Contract:
- `checkpoint_format(hf_config, path)` reads config.json's `quantization_config` with compressed-tensors'
  own parsers and returns a `CheckpointFormat` saying, for each decoder projection, which engine format
  it is stored in ("bf16", "fp8", "nvfp4", "2:4", "2:4+fp8"); None when the config has no
  `quantization_config`. Anything the engine cannot run as stored (another quant_method, int / group /
  asymmetric schemes, static or non-per-token FP8 activations, a quantised embedding or LM head, a
  quantised KV cache, transforms, other sparsity formats) raises ModelLoadError naming the scheme or
  field: a config is never silently dropped.
- `model_for(cfg, fmt, device, dtype)` builds the model a checkpoint loads into without allocating a
  dense weight for any Linear the checkpoint stores in another format.
- `build_backend(kind, parts, dtype, device, where)` builds the backend of one engine Linear from the
  stored tensors of the checkpoint projections it fuses (q, k, v or gate, up, in row order), without
  dequantising: values and scales are the stored ones, bit for bit.

Mapping, per kind:
- fp8: `weight` e4m3 [N, K] and `weight_scale` [N, 1] (channel) or [1] (tensor), as Fp8Weight(qweight,
  scale [N] fp32); a per-tensor scale becomes a per-channel vector of its value, so q, k, v with
  different tensor scales fuse exactly. Activations: dynamic per-token FP8, the engine's own.
- nvfp4: `weight_packed` uint8 [N, K/2] (low nibble = even K, the engine's order), `weight_scale` e4m3
  [N, K/16], `weight_global_scale` fp32. compressed-tensors decompresses w = e2m1 * (scale / global):
  the global scale is a divisor. The engine's kernels multiply by a tensor scale, so theirs is the
  fp32 reciprocal, and the backend keeps the divisor too so that its `dequantize` divides as
  compressed-tensors does (bit for bit in fp32; the kernels' scale differs from 1/global by at most half
  an fp32 ulp). One tensor scale per engine weight: q, k, v (or gate, up) with different global scales
  are refused (llm-compressor gives fused projections one global scale). Run as W4A16.
- 2:4 (sparsity_config with structure 2:4 and format "dense"): the dense stored tensor, checked to be
  2:4 and compressed exactly (compress_24); with fp8 the e4m3 values are compressed the same way.
- 2:4 in format "sparse-24-bitmask" (what compressed-tensors <= 0.14 wrote; later versions read it no
  more): `weight` is stored as `shape` [[N], [K]], `compressed` [N, K/2] (the kept values in row order,
  e4m3 with fp8) and `bitmask` uint8 [N, K/8] (their positions, 2 of every 4, packed as compressed-
  tensors' pack_bitmasks packs them). The dense tensor is rebuilt with compressed-tensors'
  unpack_bitmasks and then takes the dense form's path, so the values are the stored ones, bit for bit
  (a pruned position comes back as +0: the layout keeps no zero's sign).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("microengine.loader")

# The decoder projections of HF's Llama, by the engine Linear that fuses them (rows in this order).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# The tensors each stored kind has per projection (local names, as compressed-tensors writes them).
STORED_TENSORS = {
    "bf16": ("weight",), "2:4": ("weight",),
    "fp8": ("weight", "weight_scale"), "2:4+fp8": ("weight", "weight_scale"),
    "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
}
# What the sparse-24-bitmask layout stores in place of a 2:4 projection's `weight`.
BITMASK_TENSORS = ("shape", "compressed", "bitmask")


def _error(msg: str):
    from models.loader import ModelLoadError
    return ModelLoadError(msg)


class CheckpointFormat:
    """What a compressed-tensors checkpoint stores: {HF projection name: kind}, whether its 2:4
    projections are in the sparse-24-bitmask layout, and the engine formats that `--weights` /
    `--sparse-ffn` then stand for."""

    def __init__(self, kinds: dict[str, str], bitmask: bool = False):
        self.kinds = kinds
        self.bitmask = bitmask

    def kind(self, hf_name: str) -> str:
        return self.kinds[hf_name]

    def tensors(self, hf_name: str) -> tuple[str, ...]:
        """The local names of the tensors the checkpoint stores for a projection."""
        kind = self.kinds[hf_name]
        if self.bitmask and kind.startswith("2:4"):
            return BITMASK_TENSORS + tuple(t for t in STORED_TENSORS[kind] if t != "weight")
        return STORED_TENSORS[kind]

    @property
    def weights(self) -> str:
        """The `--weights` this checkpoint holds: fp8 / nvfp4 where any projection is, else bf16."""
        found = {k.replace("2:4+", "").replace("2:4", "bf16") for k in self.kinds.values()}
        found.discard("bf16")
        return found.pop() if found else "bf16"

    @property
    def sparse_ffn(self) -> bool:
        return any(k.startswith("2:4") for k in self.kinds.values())

    def describe(self) -> str:
        return self.weights + (" with 2:4-sparse layers" if self.sparse_ffn else "")


def _describe_args(args) -> str:
    if args is None:
        return "none"
    text = f"{args.type}{args.num_bits} {args.strategy}"
    if args.group_size:
        text += f" group {args.group_size}"
    if not args.symmetric:
        text += " asymmetric"
    if args.type == "float" or args.dynamic is not None:
        text += " dynamic" if args.dynamic else " static"
    return text


def _kind_of_scheme(scheme, fmt: str | None, group: str, where: str) -> str:
    """"fp8" or "nvfp4" for a scheme the engine runs as stored; else a ModelLoadError naming it."""
    w, a = scheme.weights, scheme.input_activations
    name = (f"{where}: quantization_config.config_groups.{group} (weights {_describe_args(w)}, "
            f"input activations {_describe_args(a)}, format {fmt})")
    if scheme.output_activations is not None:
        raise _error(f"{name}: output activation quantisation is not supported")
    if w is None:
        raise _error(f"{name}: activation-only quantisation is not supported")
    if w.type == "float" and w.num_bits == 8 and w.symmetric and w.strategy in ("channel", "tensor") \
            and not w.dynamic and w.group_size is None:
        if a is None or not (a.type == "float" and a.num_bits == 8 and a.symmetric
                             and a.strategy == "token" and a.dynamic is True):
            raise _error(f"{name}: FP8 weights run here with dynamic per-token FP8 activations only")
        if fmt != "float-quantized":
            raise _error(f"{name}: FP8 weights are read in the float-quantized format only")
        return "fp8"
    if w.type == "float" and w.num_bits == 4 and w.symmetric and w.strategy == "tensor_group" \
            and w.group_size == 16:
        if fmt != "nvfp4-pack-quantized":
            raise _error(f"{name}: NVFP4 weights are read in the nvfp4-pack-quantized format only")
        if a is not None:
            # The checkpoint also asks for NVFP4 activations; this engine runs NVFP4 as W4A16.
            log.warning("%s: NVFP4 activation quantisation is not applied: run as W4A16", name)
        return "nvfp4"
    raise _error(f"{name}: this scheme is not supported (supported: FP8 weights per channel or "
                 "tensor with dynamic per-token FP8 activations; NVFP4 weights)")


def checkpoint_format(hf: dict, path: str, num_layers: int) -> CheckpointFormat | None:
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    where = f"{path}/config.json"
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise _error(f"{where}: quantization_config.quant_method {method!r} is not supported "
                     "(only compressed-tensors checkpoints load as stored)")
    try:
        from compressed_tensors.config import SparsityCompressionConfig
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.utils.match import is_match
    except ImportError as e:
        raise _error(f"{where}: a compressed-tensors checkpoint needs the package compressed-tensors "
                     f"({e})") from e
    for field in ("kv_cache_scheme", "transform_config", "moe_sparsity_config"):
        if qc.get(field):
            raise _error(f"{where}: quantization_config.{field} is not supported")
    quant_fields = {k: v for k, v in qc.items() if k not in ("sparsity_config", "transform_config", "version")}
    try:
        quant = QuantizationConfig.model_validate({"config_groups": {}, **quant_fields})
    except Exception as e:
        raise _error(f"{where}: quantization_config is not a valid compressed-tensors config ({e})") from e
    if quant.config_groups and str(quant.quantization_status.value) != "compressed":
        raise _error(f"{where}: quantization_config.quantization_status is "
                     f"{quant.quantization_status.value!r}; only 'compressed' checkpoints load as stored")
    sparsity = None
    if qc.get("sparsity_config"):
        sc = dict(qc["sparsity_config"])
        try:
            sparsity = SparsityCompressionConfig.load_from_registry(sc.get("format"), **sc)
        except Exception as e:
            raise _error(f"{where}: quantization_config.sparsity_config is not valid ({e})") from e
        if sparsity.sparsity_structure != "2:4":
            raise _error(f"{where}: quantization_config.sparsity_config.sparsity_structure "
                         f"{sparsity.sparsity_structure!r} is not supported (only 2:4)")
        if sparsity.format not in ("dense", "sparse-24-bitmask"):
            raise _error(f"{where}: quantization_config.sparsity_config.format {sparsity.format!r} is not "
                         "supported (2:4 weights load from the dense and sparse-24-bitmask formats)")
    bitmask = sparsity is not None and sparsity.format == "sparse-24-bitmask"

    linear, embedding = torch.nn.Linear(1, 1, device="meta"), torch.nn.Embedding(1, 1, device="meta")

    def groups_of(name, module):
        return [g for g, s in quant.config_groups.items()
                if is_match(name, module, s.targets, quant.ignore or [])]

    for name, module in (("model.embed_tokens", embedding), ("lm_head", linear)):
        if groups_of(name, module):
            raise _error(f"{where}: {name} is quantised ({', '.join(groups_of(name, module))}); "
                         "only decoder projections load quantised (add it to `ignore`)")
    if bitmask and is_match("lm_head", linear, sparsity.targets, sparsity.ignore or []):
        raise _error(f"{where}: lm_head is stored in the sparse-24-bitmask format; only decoder projections "
                     "load 2:4 (add it to the sparsity_config's `ignore`)")
    kinds = {}
    for i in range(num_layers):
        for parts in FUSED_PROJECTIONS.values():
            for part in parts:
                name = f"model.layers.{i}.{part}"
                groups = groups_of(name, linear)
                if len(groups) > 1:
                    raise _error(f"{where}: {name} matches several config_groups ({', '.join(groups)})")
                kind = "bf16"
                if groups:
                    scheme = quant.config_groups[groups[0]]
                    kind = _kind_of_scheme(scheme, scheme.format or quant.format, groups[0], where)
                if sparsity is not None and is_match(name, linear, sparsity.targets, sparsity.ignore or []):
                    if kind == "nvfp4":
                        raise _error(f"{where}: {name} is NVFP4 and 2:4-sparse: not supported together")
                    kind = "2:4+fp8" if kind == "fp8" else "2:4"
                kinds[name] = kind
    return CheckpointFormat(kinds, bitmask)


def fused_kind(fmt: CheckpointFormat, layer: int, fused: str) -> str:
    """The kind of an engine Linear: its parts must agree (one backend per Linear)."""
    parts = [f"model.layers.{layer}.{p}" for p in FUSED_PROJECTIONS[fused]]
    kinds = {fmt.kind(p) for p in parts}
    if len(kinds) > 1:
        raise _error(f"{', '.join(parts)} are stored as {', '.join(sorted(kinds))}: the engine fuses "
                     "them into one weight, which needs one format")
    return kinds.pop()


def model_for(cfg, fmt: CheckpointFormat, device, dtype, tp=None):
    """The LlamaForCausalLM a checkpoint loads into: the Linears it holds dense (its bf16 projections, the
    LM head) get their dense weights; the others keep a meta placeholder (no memory) until
    `build_backend` gives them their backends."""
    from engine.formats import DenseWeight
    from engine.linear import deferred_weights
    from models.llama import LlamaForCausalLM
    with deferred_weights():
        model = LlamaForCausalLM(cfg, device=device, dtype=dtype, tp=tp)
    dense = [model.lm_head] if model.lm_head is not None else []
    for i, layer in enumerate(model.layers):
        dense += [layer.get_submodule(f) for f in FUSED_PROJECTIONS if fused_kind(fmt, i, f) == "bf16"]
    for lin in dense:
        lin.backend = DenseWeight(torch.empty(lin.out_features, lin.in_features, device=device, dtype=dtype))
    return model


def _checked(t: torch.Tensor, dtype, shape, what: str) -> torch.Tensor:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise _error(f"{what}: stored as {t.dtype} {tuple(t.shape)}, the config says {dtype} {tuple(shape)}")
    return t


def _per_channel_scale(scale: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """weight_scale [N, 1] / [N] (channel) or [1] / [] (tensor) -> fp32 [N] (exact: a widening)."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(n).clone()
    if scale.numel() != n or (scale.dim() == 2 and scale.shape[1] != 1):
        raise _error(f"{what}: shape {tuple(scale.shape)} is neither per channel ({n}) nor per tensor")
    return scale.float().reshape(n)


def _compress_2_4(w: torch.Tensor, what: str):
    """Sparse24Tensor of a stored dense tensor that must hold a 2:4 pattern (float8 compressed through
    fp32: e4m3 -> fp32 -> e4m3 is exact)."""
    from engine.formats.sparse24 import Sparse24Tensor, compress_24, is_24_sparse
    wide = w.float() if w.dtype == torch.float8_e4m3fn else w
    if w.shape[1] % 8 or not is_24_sparse(wide):
        raise _error(f"{what}: the sparsity_config says 2:4 but the stored weight is not 2:4 along K")
    t = compress_24(wide)
    return Sparse24Tensor(t.values.to(w.dtype), t.meta, t.shape)


def _from_bitmask(p: dict[str, torch.Tensor], n: str, kind: str, in_features: int) -> dict[str, torch.Tensor]:
    """A projection's sparse-24-bitmask tensors as the dense form's: `weight` rebuilt (the kept values
    at the bitmask's positions, zeros elsewhere, as compressed-tensors decompressed it); weight_scale as
    stored."""
    from compressed_tensors.utils import unpack_bitmasks
    p = dict(p)
    shape, values, bitmask = (p.pop(t) for t in BITMASK_TENSORS)
    if shape.is_floating_point() or shape.numel() != 2 or shape.flatten()[1] != in_features:
        raise _error(f"{n}.shape: {shape.flatten().tolist()}, the config.json shapes say [N, {in_features}]")
    rows, fp8 = int(shape.flatten()[0]), kind == "2:4+fp8"
    if not values.is_floating_point() or (values.dtype == torch.float8_e4m3fn) != fp8:
        raise _error(f"{n}.compressed: stored as {values.dtype}, the config says "
                     f"{'FP8' if fp8 else 'unquantised'} 2:4 weights")
    _checked(values, values.dtype, (rows, in_features // 2), f"{n}.compressed")
    _checked(bitmask, torch.uint8, (rows, (in_features + 7) // 8), f"{n}.bitmask")
    mask = unpack_bitmasks(bitmask, [rows, in_features])
    # compressed-tensors marks exactly 2 of every 4 (a zero too where fewer are nonzero): K/2 per row.
    if in_features % 4 or not (mask.reshape(rows, -1, 4).sum(-1) == 2).all():
        raise _error(f"{n}.bitmask: does not mark 2 of every 4 weights along K (not a 2:4 bitmask)")
    p["weight"] = torch.zeros(rows, in_features, dtype=values.dtype)
    p["weight"][mask] = values.flatten()
    return p


def build_backend(kind: str, parts: list[dict[str, torch.Tensor]], names: list[str], in_features: int,
                  dtype: torch.dtype, device, bitmask: bool = False):
    """The engine backend of one Linear from its parts' stored tensors ({local name: tensor}, rows in
    order). `names`: the parts' checkpoint names, for messages. bitmask: the checkpoint's 2:4
    projections are in the sparse-24-bitmask format."""
    if bitmask and kind.startswith("2:4"):
        parts = [_from_bitmask(p, n, kind, in_features) for p, n in zip(parts, names)]
    if kind == "fp8" or kind == "2:4+fp8":
        qweight = torch.cat([_checked(p["weight"], torch.float8_e4m3fn, (p["weight"].shape[0], in_features),
                                      f"{n}.weight") for p, n in zip(parts, names)])
        scale = torch.cat([_per_channel_scale(p["weight_scale"], p["weight"].shape[0], f"{n}.weight_scale")
                           for p, n in zip(parts, names)])
        qweight, scale = qweight.to(device), scale.to(device)
        if kind == "fp8":
            from engine.formats.fp8 import Fp8Weight
            return Fp8Weight(qweight, scale, dtype)
        from engine.formats.sparse24 import Sparse24Fp8Weight
        return Sparse24Fp8Weight(_compress_2_4(qweight, " / ".join(names)), scale, dtype)
    if kind == "nvfp4":
        from engine.formats.nvfp4 import BLOCK, Nvfp4Tensor, Nvfp4Weight, for_device
        if in_features % BLOCK:
            raise _error(f"{names[0]}: K={in_features} is not a multiple of {BLOCK}")
        packed, block_scale = [], []
        for p, n in zip(parts, names):
            rows = p["weight_packed"].shape[0]
            packed.append(_checked(p["weight_packed"], torch.uint8, (rows, in_features // 2), f"{n}.weight_packed"))
            block_scale.append(_checked(p["weight_scale"], torch.float8_e4m3fn, (rows, in_features // BLOCK),
                                        f"{n}.weight_scale"))
        globals_ = [_checked(p["weight_global_scale"].reshape(-1), torch.float32, (1,), f"{n}.weight_global_scale")
                    for p, n in zip(parts, names)]
        if any(not torch.equal(g, globals_[0]) for g in globals_):
            raise _error(f"{', '.join(names)}: weight_global_scale differs ({', '.join(str(g.item()) for g in globals_)}); "
                         "the engine fuses them into one NVFP4 weight with one tensor scale")
        global_scale = globals_[0].reshape(())
        t = Nvfp4Tensor(torch.cat(packed), torch.cat(block_scale), (1.0 / global_scale).float(),
                        (sum(x.shape[0] for x in packed), in_features))
        return Nvfp4Weight(for_device(t.to(device), torch.device(device)), dtype,
                           global_scale=global_scale.to(device))
    if kind == "2:4":
        from engine.formats.sparse24 import Sparse24Weight
        w = torch.cat([_checked(p["weight"], p["weight"].dtype, (p["weight"].shape[0], in_features), f"{n}.weight")
                       for p, n in zip(parts, names)])
        if w.dtype == torch.float8_e4m3fn or not w.is_floating_point():
            raise _error(f"{names[0]}.weight: stored as {w.dtype}, the config says a dense 2:4 weight")
        return Sparse24Weight(_compress_2_4(w.to(device=device, dtype=dtype), " / ".join(names)))
    raise ValueError(f"no backend for kind {kind!r}")


__all__ = ["CheckpointFormat", "FUSED_PROJECTIONS", "STORED_TENSORS", "build_backend", "checkpoint_format",
           "fused_kind", "model_for"]
