"""A ring of pinned host buffers for the step inputs, uploaded on the copy stream.

Each slot is one pinned byte buffer and its device twin. A step packs all its inputs (token ids,
positions, slot mapping, block tables, context lengths, ...) into its slot at aligned offsets, and
`upload` moves them in a single H2D copy, so a step costs one copy launch however many fields it
has. While step N computes from slot N % num_slots, the host fills and uploads slot N + 1.

Two events per slot keep the reuse safe without ever synchronising the device:
- `uploaded` (H2D stream, after the copy): the compute stream waits on it before reading the twin;
  the host waits on it (that event only) before writing the slot's pinned buffer again.
- `consumed` (compute stream, recorded by `release` once the step's compute is queued): the next
  upload into the same twin waits on it on the GPU.
"""
from __future__ import annotations

import torch

from engine.streams.streams import align


class Slot:
    """One step's inputs: a pinned byte buffer the host fills, its device twin, and their events."""

    def __init__(self, index: int, host: torch.Tensor, streams):
        self.index, self.streams = index, streams
        self.host = host                  # pinned uint8
        self.device: torch.Tensor | None = None  # the device twin, allocated on the H2D stream
        self.uploaded = streams.new_event(f"uploaded{index}")
        self.consumed = streams.new_event(f"consumed{index}")
        self.fields: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}  # offset, bytes, ...
        self.used = 0
        self.in_use = False

    def put(self, name: str, data, dtype: torch.dtype) -> torch.Tensor:
        """Write `data` (a tensor, a list, or a list of equal-length lists) into the slot; returns its
        pinned view. Grows the slot when the step needs more room."""
        src = torch.as_tensor(data, dtype=dtype)
        nbytes = src.numel() * src.element_size()
        offset, end = self.used, self.used + align(nbytes)
        if end > self.host.numel():
            # Safe to drop the old buffer: acquire() waited for its last upload.
            grown = self.streams.host_empty(max(end, 2 * self.host.numel()))
            grown[:self.used].copy_(self.host[:self.used])
            self.host = grown
        view = self.host[offset:offset + nbytes].view(dtype).view(src.shape)
        view.copy_(src)
        self.fields[name] = (offset, nbytes, dtype, tuple(src.shape))
        self.used = end
        return view

    def contents(self) -> tuple[dict, bytes]:
        """What `put` wrote (field table, bytes): another rank's `restore` rebuilds the same slot."""
        return dict(self.fields), self.host[:self.used].numpy().tobytes()

    def restore(self, fields: dict, data: bytes) -> None:
        if len(data) > self.host.numel():
            self.host = self.streams.host_empty(max(len(data), 2 * self.host.numel()))
        self.host[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.fields, self.used = dict(fields), len(data)


class PinnedRing:
    """`num_slots` slots of pinned step inputs, `capacity_bytes` each to start with."""

    def __init__(self, num_slots: int, capacity_bytes: int, streams):
        if num_slots < 2:
            raise ValueError("PinnedRing needs at least 2 slots to overlap an upload with compute")
        self.streams = streams
        self.slots = [Slot(i, streams.host_empty(align(capacity_bytes)), streams) for i in range(num_slots)]
        self.next = 0
        self.host_waits = 0            # how often acquire() had to block: 0 in a healthy steady state

    def acquire(self) -> Slot:
        """The next slot, empty. Blocks only if that slot's last upload has not finished yet."""
        slot = self.slots[self.next]
        if slot.in_use:
            raise RuntimeError(f"PinnedRing: slot {slot.index} is acquired again before its step "
                               "released it (call release(slot) once the step's compute is queued)")
        if not slot.uploaded.query():
            self.host_waits += 1
            slot.uploaded.synchronize()
        self.next = (self.next + 1) % len(self.slots)
        slot.fields.clear()
        slot.used = 0
        slot.in_use = True
        return slot

    def upload(self, slot: Slot) -> dict[str, torch.Tensor]:
        """Copy the slot to the device on the H2D stream; returns its fields as device tensors.
        The compute stream is made to wait for the copy, so kernels queued after this read them safely."""
        s = self.streams
        s.wait(s.h2d, slot.consumed)        # the twin's previous step has finished reading it
        if slot.device is None or slot.device.numel() < slot.used:
            # Allocated on the H2D stream after the wait above: any earlier user of this memory is
            # ordered before the copy that overwrites it.
            slot.device = s.device_empty(max(slot.used, slot.host.numel()), s.h2d)
        s.copy(slot.device[:slot.used], slot.host[:slot.used], s.h2d, f"inputs{slot.index}")
        s.record(slot.uploaded, s.h2d)
        s.wait(s.compute, slot.uploaded)
        return {name: slot.device[off:off + nbytes].view(dtype).view(shape)
                for name, (off, nbytes, dtype, shape) in slot.fields.items()}

    def release(self, slot: Slot) -> None:
        """Call once the step that read `slot` has all its compute queued."""
        self.streams.record(slot.consumed, self.streams.compute)
        slot.in_use = False
