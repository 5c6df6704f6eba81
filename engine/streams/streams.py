"""The step's three streams and the events that order them, plus the way sampled tokens come back.

A step is: upload its inputs (H2D stream) -> compute (compute stream) -> copy the sampled tokens
back (D2H stream). Each hand-over is an event recorded on the producing stream and waited on by the
consuming stream (`wait_event`: the GPU waits, the host does not), so the host can queue step N+1
while step N still runs. The host blocks only on one specific event, and only when it needs that
event's data (a pinned slot it is about to overwrite, a token it is about to read).

`StepStreams` is the CUDA implementation. `FakeStreams` has the same interface on the CPU: copies run
at once, and every record / wait / copy / host wait is appended to `log`, so tests can check the
ordering the CUDA version relies on without a GPU.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch

ALIGN = 64      # bytes; every field of a packed buffer starts on this boundary (fits any dtype)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StepStreams:
    """A compute, an H2D and a D2H stream, all created non-blocking (none syncs with stream 0)."""

    def __init__(self, device):
        self.device = torch.device(device)
        # torch's pool streams are created with cudaStreamNonBlocking: no implicit sync with the
        # legacy default stream.
        self.compute = torch.cuda.Stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)

    def new_event(self, name: str) -> torch.cuda.Event:
        """An event (`name` is for FakeStreams' log); no timing: record and wait cost less."""
        return torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def on(self, stream):
        """Context in which new work (and new allocations) go to `stream`."""
        return torch.cuda.stream(stream)

    def current(self):
        """The stream new work goes to now (the compute stream inside the step loop)."""
        return torch.cuda.current_stream(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream, what: str = "") -> None:
        """Asynchronous copy on `stream` (pinned host <-> device)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_empty(self, nbytes: int, stream) -> torch.Tensor:
        """A device buffer allocated on `stream`: the allocator reuses its memory only after the
        work already queued on `stream`."""
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class FakeEvent:
    """A CPU stand-in for a CUDA event: pending from its record until `complete()` or a host wait.
    Never recorded, it is complete (as a CUDA event is)."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.done = name, log, True

    def query(self) -> bool:
        return self.done

    def complete(self) -> None:
        self.done = True

    def synchronize(self) -> None:
        self.log.append(("host_wait", self.name))
        self.done = True


class FakeStreams:
    """StepStreams' interface on the CPU, logging each operation in order.

    With `auto_complete=False` a recorded event stays pending until the test completes it, to check
    that nothing reuses a buffer whose event has not fired. The engine on the CPU runs on these with
    `keep_log=False`.
    """

    compute, h2d, d2h = "compute", "h2d", "d2h"

    def __init__(self, auto_complete: bool = True, keep_log: bool = True):
        self.device = torch.device("cpu")
        # A long-running CPU engine keeps no log (a deque of length 0 drops every entry).
        self.log: list[tuple] | deque = [] if keep_log else deque(maxlen=0)
        self.events: list[FakeEvent] = []
        self.auto_complete = auto_complete
        self._current = self.compute

    def new_event(self, name: str) -> FakeEvent:
        event = FakeEvent(name, self.log)
        self.events.append(event)
        return event

    def record(self, event: FakeEvent, stream) -> None:
        event.done = self.auto_complete
        self.log.append(("record", stream, event.name))

    def wait(self, stream, event: FakeEvent) -> None:
        self.log.append(("wait", stream, event.name))

    @contextlib.contextmanager
    def on(self, stream):
        before, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = before

    def current(self):
        return self._current

    def copy(self, dst, src, stream, what: str = "") -> None:
        dst.copy_(src)
        self.log.append(("copy", stream, what))

    def kernel(self, what: str) -> None:
        """Tests call this for the compute they stand in for."""
        self.log.append(("kernel", self._current, what))

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def device_empty(self, nbytes: int, stream) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class Ticket:
    """One step's sampled tokens (and whatever else was sent with them) on their way to pinned host
    memory."""

    def __init__(self, readback: "TokenReadback", slot: int, step: int, parts, many: bool, source):
        self.readback, self.slot, self.step = readback, slot, step
        self.parts, self.many = parts, many     # (offset, nbytes, dtype, shape) per tensor sent
        # Holding the device bytes keeps the allocator from handing their memory to later compute
        # work before the D2H copy has read them.
        self._source = source
        self.read = False

    def ready(self) -> bool:
        """Whether the copy has landed (never blocks)."""
        return self.readback.events[self.slot].query()

    def result(self):
        """What was sent, in pinned host memory: a tensor, or a list if a list was sent. Waits for
        this copy's event only. The views stay valid until this slot is sent again (`num_slots`
        steps later): take what you need from them."""
        self.readback.events[self.slot].synchronize()
        self._source = None
        self.read = True
        buf = self.readback.host[self.slot]
        out = [buf[off:off + n].view(dtype).view(shape) for off, n, dtype, shape in self.parts]
        return out if self.many else out[0]


class TokenReadback:
    """Sampled tokens back to the host through a ring of pinned buffers, without a device sync.

    `send(tokens)` (tokens made on the compute stream) queues: D2H waits for the compute event,
    copies into the next pinned slot, records the slot's event; it returns at once with a Ticket.
    The host reads the ticket once the next step is queued. A slot is sent again only after its
    previous ticket was read. `send([tokens, logprobs, ...])` packs several tensors into one copy.
    """

    def __init__(self, streams, num_slots: int = 2, capacity_bytes: int = 4096):
        self.streams, self.num_slots = streams, num_slots
        self.host = [streams.host_empty(align(capacity_bytes)) for _ in range(num_slots)]
        self.events = [streams.new_event(f"d2h{i}") for i in range(num_slots)]
        self.computed = streams.new_event("sampled")
        self.tickets: list[Ticket | None] = [None] * num_slots
        self.step = 0

    def send(self, tensors) -> Ticket:
        s, i = self.streams, self.step % self.num_slots
        previous = self.tickets[i]
        if previous is not None and not previous.read:
            raise RuntimeError(f"TokenReadback: step {previous.step}'s tokens were never read; read "
                               f"each ticket before sending {self.num_slots} more steps")
        many = isinstance(tensors, (list, tuple))
        parts, pieces, offset = [], [], 0
        for t in tensors if many else [tensors]:
            raw = t.contiguous().view(-1).view(torch.uint8)
            pad = (-raw.numel()) % 8            # every part starts 8-byte aligned
            parts.append((offset, raw.numel(), t.dtype, tuple(t.shape)))
            pieces += [raw, raw.new_zeros(pad)] if pad else [raw]
            offset += raw.numel() + pad
        with s.on(s.compute):
            # One copy however many parts (the concatenation is one small kernel on the compute stream).
            source = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if offset > self.host[i].numel():
            # The slot's last copy was read, so its old buffer is free to drop.
            self.host[i] = s.host_empty(align(2 * offset))
        s.record(self.computed, s.compute)
        s.wait(s.d2h, self.computed)
        s.copy(self.host[i][:offset], source, s.d2h, f"tokens{self.step}")
        s.record(self.events[i], s.d2h)
        self.tickets[i] = ticket = Ticket(self, i, self.step, parts, many, source)
        self.step += 1
        return ticket
