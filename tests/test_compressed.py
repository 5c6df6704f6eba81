"""compressed-tensors checkpoints load as stored: checkpoints written in the test by compressed-tensors
itself from a tiny random Llama; the engine's weights equal compressed-tensors' own decompression bit
for bit, logits match transformers reading the same checkpoint, and what cannot run is refused."""
import json
import os
import shutil

import pytest
import torch

from tests.numerics import rel_err

ct = pytest.importorskip("compressed_tensors")

CPU = torch.device("cpu")
IDS = list(range(5, 300, 7))


def _tiny_llama(hidden_size=96, intermediate_size=192, num_attention_heads=6):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=2, num_attention_heads=num_attention_heads, num_key_value_heads=2,
                      max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _prune_ffn_24(model):
    from engine.formats.sparse24 import prune_24
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.copy_(prune_24(lin.weight))


def _save(model, path, preset=None, tensor_scales=False, sparse=False):
    """Quantise `model` with compressed-tensors (scales from its own qparam helpers, as an observer
    computes them) and save it compressed, with the tokenizer. preset: a compressed-tensors scheme name."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStrategy,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from models.loader import preset_tokenizer
    if preset is not None:
        scheme = preset_name_to_scheme(preset, ["Linear"])
        if tensor_scales:
            scheme.weights.strategy = QuantizationStrategy.TENSOR
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
        with torch.no_grad():
            for _, m in model.named_modules():
                s = getattr(m, "quantization_scheme", None)
                if s is None:
                    continue
                w, args = m.weight.float(), s.weights
                if args.strategy == QuantizationStrategy.TENSOR_GROUP:
                    gs = _fused_global_scale(model, m, generate_gparam)
                    m.weight_global_scale.copy_(gs)
                    blocks = w.reshape(w.shape[0], -1, 16)
                    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
                else:
                    dims = (1,) if args.strategy == QuantizationStrategy.CHANNEL else (0, 1)
                    scale, _ = calculate_qparams(w.amin(dims, keepdim=True), w.amax(dims, keepdim=True), args)
                m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    model.save_pretrained(path)
    if preset is not None:
        compressor.update_config(path)
    if sparse:
        _edit_config(path, lambda q: q.setdefault("quantization_config", {"quant_method": "compressed-tensors"})
                     .update(sparsity_config={"format": "dense", "sparsity_structure": "2:4",
                                              "targets": ["re:.*mlp.*"], "ignore": []}))
    preset_tokenizer(os.environ.get("MICROENGINE_TOKENIZER")).save_pretrained(path)   # (the GPU machine's copy)


def _bitmask_24(w):
    """compressed-tensors <= 0.14's Sparse24BitMaskCompressor (sparse24_bitmask_compress; 0.15 dropped
    it): of each 4 consecutive weights the 2 largest |w| are kept (e4m3 ranked by its bytes read as
    int8, as it did), their values in row order and their positions packed by pack_bitmasks."""
    from compressed_tensors.utils import pack_bitmasks
    fp8 = w.dtype == torch.float8_e4m3fn
    top2 = (w.view(torch.int8) if fp8 else w).reshape(-1, 4).abs().topk(2, dim=1).indices
    mask = torch.zeros(w.numel() // 4, 4, dtype=torch.bool).scatter_(1, top2, True).reshape(w.shape)
    values = w.view(torch.int8)[mask].view(w.dtype) if fp8 else w[mask]
    return {"shape": torch.tensor(list(w.shape)).reshape(-1, 1), "compressed": values.reshape(w.shape[0], -1),
            "bitmask": pack_bitmasks(mask)}


def _bitmask_copy(src, dst):
    """The dense-form 2:4 checkpoint `src` in the sparse-24-bitmask format: its FFN weights (the
    sparsity_config's targets) compressed, weight_scale as stored, and the config compressed-tensors'
    Sparse24BitMaskConfig writes."""
    from compressed_tensors.config import Sparse24BitMaskConfig
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    for key in [k for k in sd if ".mlp." in k and k.endswith(".weight")]:
        sd.update({f"{key.removesuffix('.weight')}.{t}": v for t, v in _bitmask_24(sd.pop(key)).items()})
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = Sparse24BitMaskConfig(targets=["re:.*mlp.*"], ignore=["lm_head"], global_sparsity=0.5)
    _edit_config(dst, lambda c: c["quantization_config"].update(sparsity_config=config.model_dump()))


def _fused_global_scale(model, module, generate_gparam):
    """One NVFP4 global scale for q, k, v (and for gate, up): the smallest of theirs, as llm-compressor
    fuses them (vLLM, like this engine, runs each fused projection with one)."""
    for layer in model.model.layers:
        for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                      (layer.mlp.gate_proj, layer.mlp.up_proj), (layer.self_attn.o_proj,), (layer.mlp.down_proj,)):
            if any(module is g for g in group):
                return torch.stack([generate_gparam(g.weight.float().amin(), g.weight.float().amax())
                                    for g in group]).amin(0)
    raise AssertionError("not a decoder projection")


def _edit_config(path, edit):
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    edit(cfg)
    cfg_path.write_text(json.dumps(cfg))


def _ct_decompressed(path):
    """{projection: fp32 weight} as compressed-tensors decompresses each stored projection (in fp32)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file
    qc = QuantizationConfig.model_validate(
        {"config_groups": {}, **json.loads((path / "config.json").read_text())["quantization_config"]})
    args = next((g.weights for g in qc.config_groups.values()), None)
    sd = load_file(str(path / "model.safetensors"))
    out = {}
    for key in sd:
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight_packed"):
            packed = sd[key]
            q = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            out[module] = dequantize(q, sd[module + ".weight_scale"].float(), args=args,
                                     global_scale=sd[module + ".weight_global_scale"], dtype=torch.float32)
        elif key.endswith(".weight_scale") and module + ".weight" in sd:
            scale = sd[key].float()
            out[module] = dequantize(sd[module + ".weight"].float(), scale, args=args, dtype=torch.float32)
    return out


def _dense_copy(src, dst, only=None):
    """`src` with its quantised projections as compressed-tensors' decompressed weights (fp32) and no
    quantization_config; or, `only` given, those whose names hold it, then in the config's `ignore`
    (the sparsity_config dropped)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    decompressed = {m: w for m, w in _ct_decompressed(src).items() if only is None or only in m}
    sd = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
          if k.rsplit(".", 1)[0] not in decompressed}
    sd.update({m + ".weight": w for m, w in decompressed.items()})
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})

    def edit(c):
        if only is None:
            return c.pop("quantization_config")
        q = c["quantization_config"]
        q.pop("sparsity_config")
        q["ignore"] = q.get("ignore", []) + sorted(decompressed)
    _edit_config(dst, edit)


def _engine_weights(model, fused, layer):
    from models.compressed import FUSED_PROJECTIONS
    lin = model.layers[layer].get_submodule(fused)
    return lin.backend, [f"model.layers.{layer}.{p}" for p in FUSED_PROJECTIONS[fused]]


def _check_bit_exact(path, loaded, backend_name, ref=None):
    """Every decoder Linear of `loaded` (a LoadedModel, or an LLM's engine) holds the backend
    `backend_name` (one name, or {fused projection: name}) and dequantises to `ref` ({projection: fp32
    weight}; by default compressed-tensors' decompression of the checkpoint at `path`) bit for bit."""
    from models.compressed import FUSED_PROJECTIONS
    ref = _ct_decompressed(path) if ref is None else ref
    backend_names = backend_name if isinstance(backend_name, dict) else dict.fromkeys(FUSED_PROJECTIONS, backend_name)
    for i in range(len(loaded.model.layers)):
        for fused in FUSED_PROJECTIONS:
            backend, names = _engine_weights(loaded.model, fused, i)
            assert backend.name == backend_names[fused], (i, fused, backend.name)
            expected = torch.cat([ref[n] for n in names])
            got = backend.dequantize().float()
            assert torch.equal(got, expected), (i, fused, (got - expected).abs().max())


def _transformers(path, ffn_activations=True):
    """transformers running the checkpoint at `path` in fp32 on the CPU (compressed-tensors decompresses
    its weights as it loads, and quantises activations as the scheme says). ffn_activations=False: the
    FFN takes its activations unquantised, as the engine's 2:4+fp8 backend does on the CPU (its
    reference kernel: only sm_90's torchao kernel takes them per-token FP8)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if not ffn_activations:
        for name, m in hf.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if ".mlp." in name and scheme is not None:
                m.quantization_scheme = scheme.model_copy(update={"input_activations": None})
    return hf


def _transformers_layers(hf, run):
    """run() on transformers' model, and what each of its decoder layers took and gave at each call:
    (run()'s result, [[input [T, hidden] per call] per layer], [[output] per layer])."""
    ins, outs = [[] for _ in hf.model.layers], [[] for _ in hf.model.layers]

    def record(i):
        def hook(module, args, kwargs, out):
            ins[i].append((args[0] if args else kwargs["hidden_states"])[0])
            outs[i].append((out[0] if isinstance(out, tuple) else out)[0])
        return hook
    handles = [layer.register_forward_hook(record(i), with_kwargs=True) for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            return run(), ins, outs
    finally:
        for h in handles:
            h.remove()


def _fed_transformers_inputs(llm, ins, run):
    """run() on the engine with each decoder layer given, call by call, the input transformers' layer
    took (`ins`, as _transformers_layers records it) in the engine's form: layer 0 the embeddings, a
    later layer the residual stream with a zero to add to it. Returns run()'s result and each layer's
    outputs (the residual stream after it) per call."""
    layers = llm.engine.model.layers
    calls, outs = [iter(x) for x in ins], [[] for _ in layers]

    def feed(i):
        def hook(module, args):
            h = next(calls[i])
            assert h.shape == args[0].shape, (i, h.shape, args[0].shape)      # the same steps and tokens
            return (h, None, *args[2:]) if i == 0 else (torch.zeros_like(h), h, *args[2:])
        return hook

    def keep(i):
        def hook(module, args, out):
            outs[i].append(out[0] + out[1])
        return hook
    handles = [layer.register_forward_pre_hook(feed(i)) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    assert all(next(c, None) is None for c in calls), "transformers' model ran more steps"
    return result, outs


# With per-token FP8 activations, two computations of one layer from the same input now and then round
# an activation to neighbouring e4m3 codes (their inputs a summation order apart): the row of that
# token (and, a little, the later rows that attend to it) then parts by up to an e4m3 step of that
# element times its weights. Fed layer by layer (_matches_transformers), such a parting stays in the
# layer where it happened. Measured on the embedded model's FP8 checkpoint, 40 sets of 48 random
# tokens and 8 greedy steps each (in brackets: another 40): up to 6 (9) of a layer's 71 rows (48, then
# 16 + 7 in the generation) parted by more than 1e-4 of its largest change, by at most 3.9e-2; the
# logits by more than 1e-4 of the largest at up to 2 of 48 positions, by at most 5.0e-3 (9.8e-3); a
# step's log-probabilities by more than 1e-4 at up to 1 of 8 steps, by at most 6.6e-4 (7.9e-3). So a
# quarter of the rows may part, by up to 0.2 of the largest change or logit, or 0.1 in log-probability.
FLIPPED_ROWS, FLIPPED_BOUND, FLIPPED_LOGPROB = 1 / 4, 0.2, 0.1


def _rows_close(err, tol, flipped, bound, what):
    """err: an error per row (token, or step). All within `tol`, or all but a fraction `flipped` of
    them, those within `bound`."""
    over = int((err > tol).sum())
    assert over <= flipped * err.numel() and err.max() <= (bound if flipped else tol), \
        f"{what}: {over} of {err.numel()} rows over {tol}, the largest error {err.max().item():.2e}"


def _matches_transformers(llm, hf, ids, tol, lp_tol, fed=False, flipped=0.0, steps=8):
    """The engine against transformers running the same checkpoint: the logits of `ids`, per position,
    within `tol` of transformers' largest; the greedy continuation of ids[:16] transformers' generate's,
    but where they part at a near-tie within 2 * lp_tol (tests/ties.py), the log-probabilities of the
    engine's top 2 within `lp_tol` of transformers' at every step up to there.
    fed: each engine decoder layer is given transformers' input to that layer (_fed_transformers_inputs)
    in the forward and at every step of the generation, so that each layer's computation is compared on
    its own, not carried on through the layers after it; each layer's output rows are compared too
    (within `tol` of the largest change the layer makes), and the contexts are transformers' at every
    step. (The engine's prefix cache must not hold the prompt: its prefill would skip it.)
    flipped: the fraction of the rows (positions, steps) that may part by a rounding of per-token FP8
    activations (FLIPPED_ROWS), by up to FLIPPED_BOUND (FLIPPED_LOGPROB; near-ties within twice that).
    Returns the largest errors (logits, layers, log-probabilities), for the record."""
    from ties import parting

    from engine import SamplingParams
    prompt = ids[:16]
    p = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=2)

    def generate():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    layer_err = None
    if fed:
        ref, ins, ref_outs = _transformers_layers(hf, lambda: hf(torch.tensor([ids])).logits[0])
        got, outs = _fed_transformers_inputs(llm, ins, lambda: llm.logits(ids))
        gen, gen_ins, gen_ref_outs = _transformers_layers(hf, generate)
        out, gen_outs = _fed_transformers_inputs(llm, gen_ins, lambda: llm.generate([prompt], p)[0])
        layer_err = 0.0
        for i in range(len(ins)):
            xs, ys, hs = ins[i] + gen_ins[i], outs[i] + gen_outs[i], ref_outs[i] + gen_ref_outs[i]
            change = max((h - x).abs().max() for x, h in zip(xs, hs))
            err = torch.cat([(y - h).abs().amax(-1) for y, h in zip(ys, hs)]) / change
            _rows_close(err, tol, flipped, FLIPPED_BOUND, f"layer {i}")
            layer_err = max(layer_err, err.max().item())
    else:
        with torch.no_grad():
            ref, gen = hf(torch.tensor([ids])).logits[0], generate()
        got, out = llm.logits(ids), llm.generate([prompt], p)[0]
    err = (got - ref).abs().amax(-1) / ref.abs().max()
    _rows_close(err, tol, flipped, FLIPPED_BOUND, "logits")
    ref_tokens = gen.sequences[0, len(prompt):].tolist()
    parted = parting(out.token_ids, ref_tokens, [lp.top for lp in out.logprobs],
                     2 * (FLIPPED_LOGPROB if flipped else lp_tol))
    same = steps if fed or parted is None else parted + 1
    ref_lp = [logits[0].float().log_softmax(-1) for logits in gen.logits[:same]]
    lp_err = torch.tensor([max(abs(v - lp[t].item()) for t, v in step.top)
                           for lp, step in zip(ref_lp, out.logprobs)])
    _rows_close(lp_err, lp_tol, flipped, FLIPPED_LOGPROB, "log-probabilities")
    return err.max().item(), layer_err, lp_err.max().item()


@pytest.mark.parametrize("tensor_scales", [False, True], ids=["per-channel", "per-tensor"])
def test_fp8_checkpoint_loads_as_stored(tmp_path, tensor_scales):
    from models.loader import load_model
    _save(_tiny_llama(), tmp_path, "FP8_DYNAMIC", tensor_scales=tensor_scales)
    loaded = load_model(str(tmp_path), CPU, torch.float32)
    _check_bit_exact(tmp_path, loaded, "fp8")
    assert loaded.model.lm_head.backend.name == "bf16"      # the checkpoint's ignore list
    assert loaded.checkpoint.weights == "fp8"
    # transformers runs the same checkpoint with per-token FP8 activations (its fake quantisation).
    from engine import LLM
    llm = LLM(str(tmp_path), device="cpu", dtype="fp32")
    try:
        _matches_transformers(llm, _transformers(tmp_path), IDS, **TRANSFORMERS_TOLERANCES["fp8"][0])
    finally:
        llm.shutdown(timeout=1)


def test_nvfp4_checkpoint_loads_as_stored(tmp_path):
    from models.loader import load_model
    model = _tiny_llama()
    _save(model, tmp_path, "NVFP4A16")
    loaded = load_model(str(tmp_path), CPU, torch.float32)
    _check_bit_exact(tmp_path, loaded, "nvfp4")
    # The stored bytes themselves, not only their product: packed codes and e4m3 block scales.
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "model.safetensors"))
    o = loaded.model.layers[0].self_attn.o_proj.backend
    assert torch.equal(o.packed, sd["model.layers.0.self_attn.o_proj.weight_packed"])
    assert torch.equal(o.block_scale.view(torch.uint8), sd["model.layers.0.self_attn.o_proj.weight_scale"].view(torch.uint8))
    # transformers cannot run it in fp32: compressed-tensors' NVFP4 decompression (NVFP4PackedCompressor.
    # decompress) unpacks the codes in unpack_fp4_from_uint8's default bf16 and dequantises in it, and
    # the fp32 model then meets bf16 weights. (Checked, so that this test tells when it can.) The
    # reference is compressed-tensors' decompressed weights (in fp32) run as a dense checkpoint.
    with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype"), torch.no_grad():
        _transformers(tmp_path)(torch.tensor([IDS]))
    from engine import LLM
    dense_dir = tmp_path.parent / (tmp_path.name + "-dense")
    _dense_copy(tmp_path, dense_dir)
    ours, ref = LLM(str(tmp_path), device="cpu", dtype="fp32"), LLM(str(dense_dir), device="cpu", dtype="fp32")
    try:
        assert ours.engine.model.layers[0].mlp.down_proj.backend.name == "nvfp4"
        assert (ours.logits(IDS) - ref.logits(IDS)).abs().max().item() < 1e-3
    finally:
        ours.shutdown(timeout=1)
        ref.shutdown(timeout=1)


def test_sparse_24_checkpoints(tmp_path):
    """Dense tensors holding a 2:4 pattern (sparsity_config format dense), alone and with FP8."""
    from models.loader import load_model
    model = _tiny_llama()
    _prune_ffn_24(model)
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    _save(model, tmp_path / "bf16", sparse=True)
    loaded = load_model(str(tmp_path / "bf16"), CPU, torch.float32)
    gu = loaded.model.layers[1].mlp.gate_up_proj.backend
    assert gu.name == "2:4"
    assert torch.equal(gu.dequantize(), torch.cat([dense["model.layers.1.mlp.gate_proj.weight"],
                                                   dense["model.layers.1.mlp.up_proj.weight"]]))
    assert loaded.model.layers[1].self_attn.qkv_proj.backend.name == "bf16"

    model = _tiny_llama()
    _prune_ffn_24(model)
    _save(model, tmp_path / "fp8", "FP8_DYNAMIC", sparse=True)
    loaded = load_model(str(tmp_path / "fp8"), CPU, torch.float32)
    assert loaded.model.layers[0].mlp.down_proj.backend.name == "2:4+fp8"
    assert loaded.model.layers[0].self_attn.o_proj.backend.name == "fp8"
    ref = _ct_decompressed(tmp_path / "fp8")
    down = loaded.model.layers[0].mlp.down_proj.backend
    assert torch.equal(down.dequantize(), ref["model.layers.0.mlp.down_proj"])


@pytest.mark.parametrize("preset", [None, "FP8_DYNAMIC"], ids=["2:4", "2:4+fp8"])
def test_sparse_24_bitmask_checkpoints(tmp_path, preset):
    """The sparse-24-bitmask format loads into the backends its dense form gives (values, metadata,
    scales), and the model computes what it computes with compressed-tensors' decompression of its FFN
    weights as dense weights (on the CPU the 2:4 + FP8 kernel takes unquantised activations)."""
    from engine import LLM
    from models.loader import load_model
    model = _tiny_llama()
    _prune_ffn_24(model)
    _save(model, tmp_path / "dense", preset, sparse=True)
    _bitmask_copy(tmp_path / "dense", tmp_path / "bitmask")
    _dense_copy(tmp_path / "dense", tmp_path / "ref", only=".mlp.")
    ours = load_model(str(tmp_path / "bitmask"), CPU, torch.float32)
    dense_form = load_model(str(tmp_path / "dense"), CPU, torch.float32)
    sparse = "2:4+fp8" if preset else "2:4"
    assert {lin.backend.name for name, lin in ours.model.linear_layers() if ".mlp." in name} == {sparse}
    assert ours.checkpoint.describe() == dense_form.checkpoint.describe()
    a, b = ours.model.state_dict(), dense_form.model.state_dict()
    assert a.keys() == b.keys() and any(k.endswith("down_proj.backend.meta") for k in a)
    for k in a:     # e4m3 compared as numbers: the bitmask format keeps no zero's sign
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].float(), b[k].float()), k
    ids = torch.randint(0, 49152, (40,)).tolist()
    llm = LLM(str(tmp_path / "bitmask"), device="cpu", dtype="fp32")
    ref = LLM(str(tmp_path / "ref"), device="cpu", dtype="fp32")
    try:
        assert ref.engine.model.layers[0].mlp.down_proj.backend.name == "bf16"
        assert ref.engine.model.layers[0].self_attn.o_proj.backend.name == ("fp8" if preset else "bf16")
        got, expected = llm.logits(ids), ref.logits(ids)
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    finally:
        llm.shutdown(timeout=1)
        ref.shutdown(timeout=1)


def test_corrupt_bitmask_checkpoints_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from models.loader import ModelLoadError, load_model
    model = _tiny_llama()
    _prune_ffn_24(model)
    _save(model, tmp_path / "dense", sparse=True)
    ckpt = tmp_path / "bitmask"
    _bitmask_copy(tmp_path / "dense", ckpt)
    original = load_file(str(ckpt / "model.safetensors"))
    down = "model.layers.1.mlp.down_proj"

    def refused(edit, match):
        sd = dict(original)
        edit(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(ckpt / "model.safetensors"),
                  metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=match):
            load_model(str(ckpt), CPU, torch.float32)

    def three_in_a_group(sd):       # as many kept weights in the row, 3 of them in one group of 4
        sd[down + ".bitmask"] = sd[down + ".bitmask"].clone()
        sd[down + ".bitmask"][5, 3] = 0b0111_0001
    refused(three_in_a_group, rf"{down}\.bitmask: does not mark 2 of every 4 weights along K")
    refused(lambda sd: sd.update({down + ".bitmask": sd[down + ".bitmask"][:, :-1]}),
            rf"{down}\.bitmask: stored as torch.uint8 \(96, 23\), the config says torch.uint8 \(96, 24\)")
    refused(lambda sd: sd.update({down + ".shape": torch.tensor([[96], [200]])}), rf"{down}\.shape: \[96, 200\]")
    refused(lambda sd: sd.update({down + ".compressed": sd[down + ".compressed"][:, :-2]}),
            rf"{down}\.compressed: stored as torch.float32 \(96, 94\)")
    refused(lambda sd: sd.pop(down + ".bitmask"), rf"1 weights missing, e.g. {down}\.bitmask")


def test_engine_formats_follow_the_checkpoint(tmp_path):
    from engine.config import EngineConfig, resolve_formats
    from models.compressed import CheckpointFormat
    stored = CheckpointFormat({"model.layers.0.mlp.down_proj": "2:4+fp8", "model.layers.0.self_attn.o_proj": "fp8"})
    assert resolve_formats(EngineConfig(model="ckpt"), stored).weights == "fp8"
    assert resolve_formats(EngineConfig(model="ckpt", weights="fp8", sparse_ffn="magnitude"), stored).weights == "fp8"
    with pytest.raises(ValueError, match="weights: 'nvfp4' was asked for.*fp8 with 2:4"):
        resolve_formats(EngineConfig(model="ckpt", weights="nvfp4"), stored)
    with pytest.raises(ValueError, match="sparse_ffn"):
        resolve_formats(EngineConfig(model="ckpt", sparse_ffn="magnitude"),
                        CheckpointFormat({"model.layers.0.mlp.down_proj": "fp8"}))
    assert resolve_formats(EngineConfig(model="ckpt"), None).weights == "bf16"


def test_unusable_checkpoints_are_refused(tmp_path):
    from models.loader import ModelLoadError, load_model
    _save(_tiny_llama(), tmp_path, "FP8_DYNAMIC")
    original = (tmp_path / "config.json").read_text()

    def refused(edit, match):
        (tmp_path / "config.json").write_text(original)
        _edit_config(tmp_path, edit)
        with pytest.raises(ModelLoadError, match=match):
            load_model(str(tmp_path), CPU, torch.float32)

    def group(q):
        return q["quantization_config"]["config_groups"]["group_0"]
    # Schemes the engine cannot run, each named.
    refused(lambda q: group(q)["weights"].update(num_bits=4, type="int", strategy="group", group_size=128),
            r"config_groups.group_0 \(weights int4 group group 128.*not supported")
    refused(lambda q: group(q)["weights"].update(symmetric=False), "asymmetric.*not supported")
    refused(lambda q: group(q)["input_activations"].update(dynamic=False, strategy="tensor"),
            "input activations float8 tensor static.*dynamic per-token FP8 activations only")
    refused(lambda q: q["quantization_config"].update(quant_method="gptq"), "quant_method 'gptq'")
    refused(lambda q: q["quantization_config"].update(ignore=[]), "lm_head is quantised")
    refused(lambda q: q["quantization_config"].update(
        sparsity_config={"format": "sparse-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}),
        "sparsity_config.format 'sparse-bitmask'")
    refused(lambda q: q["quantization_config"].update(
        sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}),
        "lm_head is stored in the sparse-24-bitmask format")
    # A config that contradicts the tensors: NVFP4 said, FP8 stored.
    refused(lambda q: group(q).update(weights={"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                               "group_size": 16, "symmetric": True},
                                      input_activations=None, format="nvfp4-pack-quantized"),
            r"model\.safetensors: model\.layers\.\d\.\S+\.weight does not belong to the nvfp4 weight")
    (tmp_path / "config.json").write_text(original)
    # A truncated file.
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or truncated"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_differing_nvfp4_global_scales_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from models.loader import ModelLoadError, load_model
    _save(_tiny_llama(), tmp_path, "NVFP4A16")
    sd = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.0.self_attn.k_proj.weight_global_scale"
    sd[key] = sd[key] * 2
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="q_proj.*weight_global_scale differs"):
        load_model(str(tmp_path), CPU, torch.float32)


@pytest.mark.parametrize("stored", ["fp8", "2:4"])
def test_stored_layers_allocate_no_dense_weight(tmp_path, monkeypatch, stored):
    """Loading a checkpoint allocates dense weights only for the Linears it holds dense (here the LM
    head, and attention in the 2:4 checkpoint): the others get their backends without a placeholder."""
    import engine.formats
    import engine.linear
    from models.loader import load_model
    allocated = []

    class CountingDense(engine.formats.DenseWeight):
        def __init__(self, weight):
            super().__init__(weight)
            if not weight.is_meta:
                allocated.append(weight.nbytes)
    monkeypatch.setattr(engine.linear, "DenseWeight", CountingDense)
    monkeypatch.setattr(engine.formats, "DenseWeight", CountingDense)
    model = _tiny_llama()
    if stored == "2:4":
        _prune_ffn_24(model)
    _save(model, tmp_path, "FP8_DYNAMIC" if stored == "fp8" else None, sparse=stored == "2:4")
    loaded = load_model(str(tmp_path), CPU, torch.float32)
    dense = [loaded.model.lm_head] + [lin for _, lin in loaded.model.linear_layers() if lin.backend.name == "bf16"]
    assert len(dense) == (1 if stored == "fp8" else 1 + 2 * len(loaded.model.layers))
    assert sum(allocated) == sum(lin.in_features * lin.out_features * 4 for lin in dense)
    assert not any(t.is_meta for t in loaded.model.state_dict().values())


def _recipe():
    """benchmarks/make_checkpoint.py as a module (benchmarks/ is no package)."""
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "make_checkpoint.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.mark.parametrize("preset", [None, "FP8_DYNAMIC"], ids=["2:4", "2:4+fp8"])
def test_recipe_records_the_2_4_structure(tmp_path, preset):
    """benchmarks/make_checkpoint.py writes the sparsity_config llm-compressor leaves empty (through
    compressed-tensors' config class): a pruned model saved by compressed-tensors then loads as 2:4; a
    weight that is not 2:4 is refused before anything is written."""
    recipe = _recipe()
    from models.loader import load_model
    ffn = ("gate_proj", "up_proj", "down_proj")
    model = _tiny_llama()
    _prune_ffn_24(model)
    pruned = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ffn}
    _save(model, tmp_path, preset)
    written = (tmp_path / "config.json").read_text()
    dense = {n: m.weight for n, m in _tiny_llama().named_modules() if n.endswith("mlp.up_proj")}
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj: .*not 2:4"):
        recipe.record_sparsity(str(tmp_path), dense)
    assert (tmp_path / "config.json").read_text() == written
    recipe.record_sparsity(str(tmp_path), pruned)
    loaded = load_model(str(tmp_path), CPU, torch.float32)
    mlp, attn = ("2:4+fp8", "fp8") if preset else ("2:4", "bf16")
    assert {lin.backend.name for name, lin in loaded.model.linear_layers() if ".mlp." in name} == {mlp}
    assert {lin.backend.name for name, lin in loaded.model.linear_layers() if ".self_attn." in name} == {attn}
    gate_up = loaded.model.layers[1].mlp.gate_up_proj.backend.dequantize().float()
    kept = torch.cat([pruned["model.layers.1.mlp.gate_proj"], pruned["model.layers.1.mlp.up_proj"]]) != 0
    assert not ((gate_up != 0) & ~kept).any()      # FP8 may round a kept value to 0, never the reverse
    sc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert sc["format"] == "dense" and sc["sparsity_structure"] == "2:4" and sc["global_sparsity"] >= 0.5



def _projections_match_transformers(model, hf):
    """Each decoder projection of the engine's `model`, on fresh random activations of several scales,
    gives what transformers' compressed-tensors layers `hf` give: the same activations (per-token FP8
    where the scheme quantises them: both round the same inputs), then fp32 products in another order."""
    from models.compressed import FUSED_PROJECTIONS
    with torch.no_grad():
        hf(torch.tensor([IDS[:2]]))      # decompresses its layers
        for i, layer in enumerate(model.layers):
            for fused, parts in FUSED_PROJECTIONS.items():
                lin = layer.get_submodule(fused)
                x = torch.randn(9, lin.in_features) * torch.rand(9, 1) * 10
                # [batch, tokens, K] as in the model: its per-token scales are per row of x
                ref = torch.cat([hf.model.layers[i].get_submodule(p)(x[None])[0] for p in parts], dim=-1)
                got = lin(x)
                assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), (i, fused)


def test_fp8_layers_match_transformers(tmp_path):
    """Each FP8 projection gives what transformers' compressed-tensors layer gives. End to end,
    per-token FP8 rounding of two summation orders parts at rounding boundaries and the parting grows
    layer by layer, so the layer is where the two are compared tightly."""
    from models.loader import load_model
    _save(_tiny_llama(), tmp_path, "FP8_DYNAMIC")
    loaded = load_model(str(tmp_path), CPU, torch.float32)
    assert {lin.backend.name for _, lin in loaded.model.linear_layers()} == {"fp8"}
    _projections_match_transformers(loaded.model, _transformers(tmp_path))


def _embedded_copy(hf_smollm2):
    """transformers' SmolLM2 with its own copy of the embedded model's weights (quantising or pruning
    it leaves the session's fixture as it is)."""
    from transformers import LlamaForCausalLM
    config = hf_smollm2.config.to_dict()
    config.pop("quantization_config", None)     # read from GGUF, which transformers will not save
    with torch.device("meta"):      # no random initialisation: the weights are copied in
        model = LlamaForCausalLM(type(hf_smollm2.config).from_dict(config)).eval()
    model.load_state_dict({k: v.clone() for k, v in hf_smollm2.state_dict().items()}, assign=True)
    model.tie_weights()
    return model


# The embedded model's checkpoints against transformers running them (_matches_transformers: logits
# and layers relative to the largest, log-probabilities absolute), measured on sets of 48 random tokens:
# - 2:4 (fp32 weights and activations: summation orders apart). End to end, 150 sets: logits up to
#   8.7e-5 (at one position whose residual stream the pruned model takes to 1e4: transformers itself,
#   its embeddings perturbed by 1e-7, moves it by 4.5e-5), log-probabilities up to 9.6e-5. Fed layer by
#   layer, 40 sets: layers up to 1.1e-5, logits 7.7e-7, log-probabilities 8.3e-6.
# - fp8, fed layer by layer: see FLIPPED_ROWS.
# - 2:4+fp8, fed, 80 sets: beyond the tolerances at up to 4 of a layer's 71 rows, 3 of 48 positions
#   and 1 of 8 steps, by at most 5.5e-3 (layers), 4.8e-4 (logits) and 1.5e-4 (log-probabilities). Its
#   FFN takes unquantised activations on both sides: the engine's 2:4+fp8 backend does on the CPU, and
#   transformers' per-token FP8 FFN activations part each layer's output by up to 13% of its largest
#   change from the engine's.
TRANSFORMERS_TOLERANCES = {"2:4": [dict(tol=2e-4, lp_tol=1e-3), dict(tol=1e-4, lp_tol=1e-4, fed=True)],
                           "fp8": [dict(tol=1e-4, lp_tol=1e-4, fed=True, flipped=FLIPPED_ROWS)],
                           "2:4+fp8": [dict(tol=1e-4, lp_tol=1e-4, fed=True, flipped=FLIPPED_ROWS)]}


@pytest.mark.parametrize("preset, sparse", [("FP8_DYNAMIC", False), (None, True), ("FP8_DYNAMIC", True)],
                         ids=["fp8", "2:4", "2:4+fp8"])
def test_embedded_model_checkpoints_run_as_the_engines_own(tmp_path, hf_smollm2, preset, sparse):
    """The embedded SmolLM2 quantised to FP8 by compressed-tensors (per-channel round to nearest, as
    llm-compressor's FP8_DYNAMIC), its FFN weights pruned to 2:4 along K (the two largest |w| of every
    4, as `--sparse-ffn magnitude` prunes), or both; 2:4 saved in the dense form and in the
    sparse-24-bitmask form. The weights load bit for bit, and the engine runs each checkpoint exactly as
    it runs its own load-time FP8 / pruning of the same model, which computes the same values, scales
    and pattern: the logits are equal.

    And transformers running the dense form (it reads no sparse-24-bitmask: compressed-tensors 0.20 has
    no decompressor for it, so transformers takes the FFN weights for missing and initialises them at
    random, or with e4m3 weights fails to: "normal_kernel_cpu" not implemented) gives the same
    logits and greedy tokens within the format's tolerance (TRANSFORMERS_TOLERANCES), its FP8
    projections the same products. The bitmask form's logits being the dense form's, it is compared too.
    The model is compared layer by layer (`fed`: each layer given transformers' input to it) and, where
    no activation is quantised (2:4), end to end. With per-token FP8 activations two summation orders
    round an activation to different e4m3 values now and then, and through 30 layers such partings grow
    as large as the quantisation itself. Measured on this model: transformers against itself, its
    embeddings perturbed by 1e-7 (relative), parts by up to 17% of the largest logit, and its argmax
    at 10-20% of the positions of 48 random tokens; the engine's FP8 logits part from transformers' as
    much, and from the unquantised model's only 2-3 times more."""
    from engine import LLM
    from models.compressed import FUSED_PROJECTIONS
    model = _embedded_copy(hf_smollm2)
    if sparse:
        _prune_ffn_24(model)
    # The values the test wrote: the reference where nothing is quantised (compressed-tensors has no
    # decompression of plain weights to compare with).
    written = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("_proj")}
    _save(model, tmp_path / "ckpt", preset, sparse=sparse)
    kinds = {f: ("2:4" if sparse and f.startswith("mlp.") else "bf16") for f in FUSED_PROJECTIONS}
    if preset:
        kinds = {f: "fp8" if k == "bf16" else "2:4+fp8" for f, k in kinds.items()}
    checkpoints = [tmp_path / "ckpt"]
    if sparse:
        _bitmask_copy(tmp_path / "ckpt", tmp_path / "bitmask")
        checkpoints.append(tmp_path / "bitmask")
    own = LLM("llama", device="cpu", dtype="fp32", weights="fp8" if preset else None,
              sparse_ffn="magnitude" if sparse else None)
    try:
        ids = torch.randint(0, own.tokenizer.vocab_size, (48,)).tolist()
        expected = own.logits(ids)
    finally:
        own.shutdown(timeout=1)
    dense_form = None
    for path in checkpoints:
        stored = LLM(str(path), device="cpu", dtype="fp32", enable_prefix_caching=False)
        try:
            if dense_form is None:
                _check_bit_exact(path, stored.engine, kinds, ref=None if preset else written)
                dense_form = {k: v.clone() for k, v in stored.engine.model.state_dict().items()}
                hf = _transformers(path, ffn_activations=not (preset and sparse))
                if preset:
                    _projections_match_transformers(stored.engine.model, hf)
                name = "2:4+fp8" if preset and sparse else "fp8" if preset else "2:4"
                for tolerances in TRANSFORMERS_TOLERANCES[name]:
                    _matches_transformers(stored, hf, ids, **tolerances)
            else:
                # The bitmask form holds the dense form's backends (e4m3 compared as numbers: the
                # bitmask format keeps no zero's sign).
                a = stored.engine.model.state_dict()
                assert a.keys() == dense_form.keys() and any(k.endswith("down_proj.backend.meta") for k in a)
                for k in a:
                    assert a[k].dtype == dense_form[k].dtype and torch.equal(a[k].float(), dense_form[k].float()), k
            assert torch.equal(stored.logits(ids), expected), path.name
        finally:
            stored.shutdown(timeout=1)


def test_embedded_model_nvfp4_checkpoint(tmp_path, hf_smollm2):
    """The embedded SmolLM2 quantised to NVFP4 (W4A16) by compressed-tensors: its codes and block
    scales load bit for bit, and the engine's logits are those of compressed-tensors' decompression of
    the same checkpoint run as dense fp32 weights. The engine's own `--weights nvfp4` is no reference
    here: compressed-tensors multiplies by its global scale (448 * 6 / amax, one per fused q/k/v and
    gate/up) where the engine divides by amax / (448 * 6) of the fused weight, and on this model 44 of
    the 120 tensor scales, 831 block scales and 6922 code bytes come out different (logits 6e-3 of
    their largest apart)."""
    _save(_embedded_copy(hf_smollm2), tmp_path / "ckpt", "NVFP4A16")
    _nvfp4_runs_as_its_decompression(tmp_path / "ckpt", tmp_path / "dense")


def _nvfp4_runs_as_its_decompression(path, dense_dir):
    """The NVFP4 checkpoint at `path` loads bit for bit, and the engine's logits on fresh random tokens
    are those of its compressed-tensors decompression run densely (written to `dense_dir`)."""
    from engine import LLM
    _dense_copy(path, dense_dir)
    stored = LLM(str(path), device="cpu", dtype="fp32")
    ref = LLM(str(dense_dir), device="cpu", dtype="fp32")
    try:
        _check_bit_exact(path, stored.engine, "nvfp4")
        assert ref.engine.model.layers[0].mlp.down_proj.backend.name == "bf16"
        ids = torch.randint(0, stored.tokenizer.vocab_size, (48,)).tolist()
        got, expected = stored.logits(ids), ref.logits(ids)
        # fp32 apart only: the NVFP4 forward multiplies by the fp32 reciprocal of the global scale
        # where the decompression divides (a weight can differ in its last bit) and sums in another
        # order. Over 30 layers a single logit can move far more than the rest (up to 1.2e-4 of the
        # largest logit on some prompts), so the bound is on the difference's norm: at most 2.8e-6
        # of the logits' over 40 random prompts of 48 tokens.
        assert rel_err(got, expected) < 1e-4
    finally:
        stored.shutdown(timeout=1)
        ref.shutdown(timeout=1)


def _exactly_quantisable(model, preset):
    """Give the decoder projections values that `preset` represents exactly, each fp8 row (nvfp4
    block, and each fused tensor) reaching the format's largest code: compressed-tensors and the
    engine then derive the same scales and codes from them. Zeros (a 2:4 pattern) stay zero."""
    from engine.formats.nvfp4 import E2M1_MAX, E4M3_MAX
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                w = lin.weight
                n, k = w.shape
                kept = w != 0
                if preset == "FP8_DYNAMIC":      # e4m3 codes times a power-of-two channel scale
                    q = (torch.randn(n, k, generator=gen) * 64).to(torch.float8_e4m3fn).float()
                    q[torch.arange(n), kept.float().argmax(1)] = E4M3_MAX
                    w.copy_(q * 2.0 ** torch.randint(-12, -8, (n, 1), generator=gen) * kept)
                elif preset == "NVFP4A16":       # e2m1 codes x e4m3 block scales x one tensor scale
                    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
                    codes = grid[torch.randint(0, 7, (n, k // 16, 16), generator=gen)]
                    codes *= torch.randint(0, 2, codes.shape, generator=gen) * 2 - 1
                    codes[..., 0] = E2M1_MAX
                    scales = (torch.rand(n, k // 16, 1, generator=gen) * 64 + 1).to(torch.float8_e4m3fn).float()
                    scales[0, 0] = E4M3_MAX
                    w.copy_((codes * scales * 2.0 ** -12).reshape(n, k))


@pytest.mark.gpu
@pytest.mark.parametrize("preset, sparse", [("FP8_DYNAMIC", False), ("NVFP4A16", False), (None, True),
                                            ("FP8_DYNAMIC", True)], ids=["fp8", "nvfp4", "2:4", "2:4+fp8"])
def test_gpu_checkpoints_run_as_the_engines_own_quantisation(tmp_path, preset, sparse):
    """At shapes the Hopper kernels take, a checkpoint loaded as stored holds the backends the engine's
    own quantisation makes of the same values (the decompressed copy loaded with --weights /
    --sparse-ffn), and gives the same greedy tokens (tests/ties.py)."""
    from ties import assert_same_greedy

    from engine import LLM, SamplingParams
    model = _tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    if sparse:
        _prune_ffn_24(model)
    _exactly_quantisable(model, preset)
    _save(model, tmp_path / "ckpt", preset, sparse=sparse)
    _dense_copy(tmp_path / "ckpt", tmp_path / "dense")
    weights = {"FP8_DYNAMIC": "fp8", "NVFP4A16": "nvfp4", None: None}[preset]
    kw = dict(device="cuda", dtype="bf16", kv_cache_tokens=4096, max_num_seqs=8)
    stored = LLM(str(tmp_path / "ckpt"), **kw)
    own = LLM(str(tmp_path / "dense"), weights=weights, sparse_ffn="magnitude" if sparse else None, **kw)
    try:
        pairs = list(zip(stored.engine.model.linear_layers(), own.engine.model.linear_layers()))
        assert len(pairs) == 2 * 4
        for (name, a), (_, b) in pairs:
            fmt = weights or "bf16"
            if sparse and ".mlp." in name:
                fmt = "2:4" if weights is None else "2:4+" + weights
            assert a.backend.name == b.backend.name == fmt, name
            assert torch.equal(a.backend.dequantize(), b.backend.dequantize()), name
        prompts = [IDS, IDS[:7], list(range(40, 300, 3))]
        p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
        assert_same_greedy(stored.generate(prompts, p), own.generate(prompts, p))
    finally:
        stored.shutdown(timeout=1)
        own.shutdown(timeout=1)
