"""Layer-wise weight streaming (`--offload`, `--gpu-memory-limit`): models larger than the GPU.

`plan_offload` decides which decoder layers stay on the device under a memory limit. The others
live in pinned host memory; `LayerStreamer` copies each one, on the H2D stream, into one of two
device buffers while the layer before it computes, so the copy engine and the SMs work at once:

    H2D:      [copy L1 -> B1]        [copy L3 -> B1]        [copy L5 -> B1] ...
    compute:        [L0] [L1 in B1] [L2] [L3 in B1] [L4] ...      (L0, L2, L4 resident here)

Events order it: compute waits for a buffer's `ready` event before the layer that uses it, and the
next copy into that buffer waits for the `done` event recorded after that layer's compute.

Any weight format works: the streamer does not know the formats. It takes each layer's parameters
and buffers (every format's backend holds its tensors as buffers), packs their bytes into one blob
per layer and repoints each tensor object in place (`Tensor.set_`) at the device buffer that holds
the layer's blob while it runs; the blob's home is a pinned host allocation of its own. Tensors that share storage (a view of a packed buffer,
a Parameter and its `.data`) keep sharing it. It hooks the layers (forward pre/post hooks), so the
model's layer loop is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

BLOB_ALIGN = 256     # bytes; every storage in a layer blob starts here (TMA and vector loads need 16)


def _blob_align(n: int) -> int:
    return (n + BLOB_ALIGN - 1) // BLOB_ALIGN * BLOB_ALIGN


# ----------------------------------------------------------------------------- the plan

@dataclass
class OffloadPlan:
    resident_layers: list[int]
    offloaded_layers: list[int]
    buffer_bytes: int             # both device buffers together (0 when nothing is offloaded)

    @property
    def offloads(self) -> bool:
        return bool(self.offloaded_layers)


def _spread(n: int, k: int) -> list[int]:
    """k of n layer indices, evenly spaced, so every streamed layer has resident compute around it
    to hide its copy behind."""
    return [int((j + 0.5) * n / k) for j in range(k)]


def plan_offload(layer_bytes: list[int], resident_bytes: int, gpu_memory_limit: int,
                 kv_bytes: int) -> OffloadPlan:
    """Which layers stay on the device. Offloads the fewest layers that make everything fit:
    resident_bytes (embeddings, LM head, final norm) + kv_bytes (KV cache and activation reserve)
    + the resident layers + two device buffers each as large as the largest streamed layer."""
    n = len(layer_bytes)
    base = resident_bytes + kv_bytes
    for k in range(n + 1):
        offloaded = _spread(n, k)
        buffers = 2 * max((layer_bytes[i] for i in offloaded), default=0)
        kept = [i for i in range(n) if i not in set(offloaded)]
        if base + sum(layer_bytes[i] for i in kept) + buffers <= gpu_memory_limit:
            return OffloadPlan(kept, offloaded, buffers)
    least = base + 2 * max(layer_bytes, default=0)
    raise ValueError(
        f"--gpu-memory-limit {gpu_memory_limit} bytes is too small even with every layer streamed: "
        f"non-layer weights {resident_bytes} + KV cache {kv_bytes} + double buffer "
        f"2 x {max(layer_bytes, default=0)} (largest layer) = {least} bytes")


# ----------------------------------------------------------------------------- finding tensors

def find_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """Every distinct parameter and buffer tensor of `layer` (weight-format backends hold theirs as
    buffers), in a fixed order."""
    found: dict[int, torch.Tensor] = {}
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        if type(t) not in (torch.Tensor, nn.Parameter):
            raise TypeError(f"weight streaming cannot move the tensor subclass {type(t).__name__} "
                            f"at {name}: hold plain tensors in the backend")
        found.setdefault(id(t), t)
    return list(found.values())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of t's storage that t reads."""
    es = t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * es, t.storage_offset() * es
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.storage_offset() * es, (last + 1) * es


@dataclass
class _Placed:
    tensor: torch.Tensor
    offset: int                   # in elements of tensor.dtype, from the blob's start
    size: tuple[int, ...]
    stride: tuple[int, ...]


class LayerBlob:
    """One layer's tensors packed into a byte blob: where each tensor lives in it."""

    @torch.inference_mode()    # weights may be inference tensors (made under inference_mode)
    def __init__(self, layer: nn.Module):
        tensors = find_tensors(layer)
        spans: dict[tuple, list[int]] = {}      # storage -> the byte span the layer uses
        for t in tensors:
            key = (t.device, t.untyped_storage().data_ptr())
            lo, hi = _span(t)
            cur = spans.setdefault(key, [lo, hi])
            cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
        self.sources: list[tuple[torch.Tensor, int, int, int]] = []   # (storage bytes, lo, hi, blob offset)
        where: dict[tuple, tuple[int, int]] = {}
        nbytes = 0
        for t in tensors:
            key = (t.device, t.untyped_storage().data_ptr())
            if key in where:
                continue
            lo, hi = spans[key]
            lo -= lo % BLOB_ALIGN            # keeps every element offset a multiple of its size
            where[key] = (nbytes, lo)
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            self.sources.append((whole, lo, hi, nbytes))
            nbytes = _blob_align(nbytes + hi - lo)
        self.nbytes = nbytes
        self.placed = []
        for t in tensors:
            base, lo = where[(t.device, t.untyped_storage().data_ptr())]
            byte_offset = base + t.storage_offset() * t.element_size() - lo
            self.placed.append(_Placed(t, byte_offset // t.element_size(), tuple(t.shape), tuple(t.stride())))

    @torch.inference_mode()
    def fill(self, blob: torch.Tensor) -> None:
        for whole, lo, hi, offset in self.sources:
            blob[offset:offset + hi - lo].copy_(whole[lo:hi])
        self.sources = []             # drop the references: the old storages can be freed

    @torch.inference_mode()
    def point_at(self, buffer: torch.Tensor) -> None:
        """Repoint every tensor of the layer at `buffer` (a uint8 tensor holding the blob)."""
        storage = buffer.untyped_storage()
        base = buffer.storage_offset()
        for p in self.placed:
            # set_ offsets count elements of the tensor's own dtype
            p.tensor.set_(storage, base // p.tensor.element_size() + p.offset, p.size, p.stride)


def layer_stream_bytes(layer: nn.Module) -> int:
    """Bytes one layer takes in a streaming buffer: what plan_offload's layer_bytes should hold."""
    return LayerBlob(layer).nbytes


# ----------------------------------------------------------------------------- the streamer

class LayerStreamer:
    """Keeps `plan.offloaded_layers` of `layers` in pinned host memory and streams them through two
    device buffers. Each streamed layer is handed over in its final weight format (all at construction,
    or one by one through `adopt` while the model is placed layer by layer); the
    layers' forward hooks then do the rest, on whatever stream the forward runs on.

    Outside its own forward a streamed layer's tensors alias a device buffer that may hold another
    layer's bytes: read them only inside the forward (the pinned copy is `host[layer]`).

    prefetch=True (the default): each layer's post-hook queues the copy of the next streamed layer
    into the buffer it frees, so copies run on the H2D stream while resident layers compute.
    prefetch=False: every streamed layer is copied in its own pre-hook, after all work queued so far
    on the compute stream, and the compute stream waits for that copy: copy and compute serialise
    (the baseline the prefetch is measured against). The attribute may be flipped between forwards."""

    def __init__(self, layers, plan: OffloadPlan, streams, device=None, prefetch: bool = True,
                 adopt: bool = True):
        """adopt=True: every streamed layer is on the device now and moves to host memory at once.
        adopt=False: the caller hands each streamed layer over with `adopt(i)` as soon as it is on
        the device, which is how a model larger than the device loads (one layer there at a time)."""
        self.layers, self.streams = list(layers), streams
        self.prefetch = prefetch
        self.order = list(plan.offloaded_layers)
        device = torch.device(device) if device is not None else streams.device
        self.buffer_bytes = plan.buffer_bytes // 2
        self.buffers = [torch.empty(self.buffer_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.blobs: dict[int, LayerBlob] = {}
        self.host: dict[int, torch.Tensor] = {}     # pinned, one allocation per layer
        self.ready = [streams.new_event(f"ready{b}") for b in range(2)]
        self.done = [streams.new_event(f"done{b}") for b in range(2)]
        self.issued = streams.new_event("issued")     # prefetch=False: the compute reached a layer
        self.holds: list[int | None] = [None, None]
        self.active: dict[int, int] = {}               # layer -> buffer, while it runs
        self.copied_bytes = 0
        self._serial_buffer = 0                        # prefetch=False alternates the two buffers
        for i in self.order:
            self.layers[i].register_forward_pre_hook(self._pre_hook(i))
            self.layers[i].register_forward_hook(self._post_hook(i))
            if adopt:
                self.adopt(i)

    def adopt(self, i: int) -> None:
        """Move streamed layer i (on the device, in its final weight format) to pinned host memory."""
        if i not in self.order or i in self.blobs:
            raise ValueError(f"LayerStreamer: layer {i} is not a streamed layer waiting to be adopted")
        blob = LayerBlob(self.layers[i])
        elsewhere = {str(p.tensor.device) for p in blob.placed if p.tensor.device != self.buffers[0].device}
        if elsewhere:
            raise ValueError(f"LayerStreamer: layer {i} holds tensors on {', '.join(sorted(elsewhere))}, "
                             f"not on {self.buffers[0].device}: move it to the device first (torch "
                             "repoints a tensor in place only within one device)")
        if blob.nbytes > self.buffer_bytes:
            raise ValueError(f"LayerStreamer: layer {i} takes {blob.nbytes} bytes, more than the planned "
                             f"buffer of {self.buffer_bytes}")
        self.blobs[i] = blob
        # Its weights exist on the device only while it runs: the layer before must not read them
        # (models/llama.py hands a norm across layers only into a layer that is not streamed).
        self.layers[i].streamed = True
        self.host[i] = self.streams.host_empty(blob.nbytes)
        blob.fill(self.host[i])
        # A tensor cannot move between devices in place, so a streamed layer's tensors always point
        # into a device buffer (the pre-hook picks which); this frees their old storage.
        blob.point_at(self.buffers[0])
        b = self.order.index(i)
        if self.prefetch and b < 2:     # the first two streamed layers wait in the buffers
            self._load(i, b)

    def _load(self, layer: int, b: int) -> None:
        s = self.streams
        s.wait(s.h2d, self.done[b])                    # the buffer's last layer has finished with it
        n = self.blobs[layer].nbytes
        s.copy(self.buffers[b][:n], self.host[layer], s.h2d, f"layer{layer}->buf{b}")
        s.record(self.ready[b], s.h2d)
        self.holds[b] = layer
        self.copied_bytes += n

    def _next_after(self, layer: int) -> int:
        return self.order[(self.order.index(layer) + 1) % len(self.order)]

    def _pre_hook(self, layer: int):
        def hook(module, args):
            if layer not in self.blobs:
                raise RuntimeError(f"LayerStreamer: streamed layer {layer} runs before it was adopted")
            if not self.prefetch:
                # Serialised: the copy starts only when the compute has reached this layer, and
                # the layer waits for it. Both buffers take turns, as with the prefetch.
                s, b = self.streams, self._serial_buffer
                self._serial_buffer = 1 - b
                s.record(self.issued, s.current())
                s.wait(s.h2d, self.issued)
                self._load(layer, b)
            elif layer in self.holds:
                b = self.holds.index(layer)
            else:   # out of the usual order (a forward broke off): fetch it now, sparing the next one
                nxt = self._next_after(layer)
                b = 1 - self.holds.index(nxt) if nxt in self.holds else 0
                self._load(layer, b)
            self.streams.wait(self.streams.current(), self.ready[b])
            self.blobs[layer].point_at(self.buffers[b])
            self.active[layer] = b
        return hook

    def _post_hook(self, layer: int):
        def hook(module, args, output):
            b = self.active.pop(layer)
            self.streams.record(self.done[b], self.streams.current())
            if not self.prefetch:
                return
            nxt = self._next_after(layer)
            if nxt in self.holds:                          # already fetched into the other buffer
                nxt = self._next_after(nxt)
            if nxt not in self.holds:
                self._load(nxt, b)
        return hook
