"""Tensor parallelism over torch.distributed: the process group, the ranks' processes, and the step
message by which rank 0 drives the others.

Process model. One process per device. Rank 0 is the caller's process: it schedules, samples and
serves. `start_workers` spawns ranks 1..N-1 (or torchrun started them: `from_environment`); each
builds the same Engine on its shards (engine/engine.py) and then runs `serve_steps`: it waits for a
message from rank 0 and runs the forward it names. Collectives go through two groups:
- the device group (NCCL on GPUs; on the CPU, the host group): the model's all-reduces and the
  logits gather, queued on the compute stream like any kernel, captured inside the decode CUDA
  graphs;
- the host group (gloo): one broadcast per step carrying the step's packed inputs (the bytes rank 0
  uploads itself), so a worker does no scheduling, no per-layer round trip and never waits for its
  device. The message is pickled into a fixed-size buffer with its length (`MESSAGE_HEAD_BYTES`,
  which a decode step's message fits); only a longer one (a large prefill) takes a second
  broadcast. A rank blocked in that broadcast while rank 0 is idle is kept alive by `keepalive`.

Failure. Every collective has the group's timeout. A rank that dies closes its sockets: the others'
next host broadcast raises `ParallelError`; rank 0 then fails every caller (engine/llm.py) and the
workers exit. A worker also exits when its parent process is gone.

NVLink multicast stays off in every process (NO_MULTICAST): the two-GPU machines here require it.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger("microengine")

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 120.0     # every collective's limit; $MICROENGINE_TP_TIMEOUT overrides it
MESSAGE_HEAD_BYTES = 16 * 1024   # a step message's first broadcast: its length (8 bytes), then its start


def timeout_s() -> float:
    return float(os.environ.get("MICROENGINE_TP_TIMEOUT", DEFAULT_TIMEOUT_S))


# Newer torch names it all_gather_single; older releases have only all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died or timed out): the engine cannot go on."""


def split_evenly(size: int, parts: int, granule: int = 1) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous pieces of range(size), each starting on a multiple of
    `granule`, as equal as that allows (the first ones are larger)."""
    units = -(-size // granule)
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for p in range(parts):
        end = min(size, start + (base + (p < extra)) * granule)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group of `size` ranks."""
    rank: int
    size: int
    device_group: object        # NCCL (cuda) or gloo (cpu)
    host_group: object          # gloo: step messages and small host-side agreements
    last_send: float = 0.0
    head: torch.Tensor = field(default_factory=lambda: torch.zeros(MESSAGE_HEAD_BYTES, dtype=torch.uint8))

    # ------------------------------------------------------------ device collectives (the model)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), group=self.device_group)
        return out.view(self.size, *x.shape)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, in place on every rank (the tokens it sampled, which only it holds)."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """Logits [M, V] from each rank's vocabulary slice [M, V/size] (rank r holds rows r*V/size..)."""
        parts = self.all_gather(local)                       # [size, M, V/size]
        return parts.permute(1, 0, 2).reshape(local.shape[0], vocab)

    # ------------------------------------------------------------ host side
    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def send(self, message) -> None:
        """Rank 0: hand every other rank this step's message (a picklable tuple)."""
        self._broadcast(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self.last_send = time.monotonic()

    def recv(self):
        return pickle.loads(self._broadcast(None))

    def keepalive(self) -> None:
        """Rank 0, idle: a no-op message, so no worker's wait for the next step reaches the timeout."""
        if time.monotonic() - self.last_send > timeout_s() / 4:
            self.send(("noop",))

    def _broadcast(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank: the head buffer carries its length and first bytes, a
        second broadcast the rest where it does not fit (one collective for a decode step, where
        broadcast_object_list always takes two)."""
        room = self.head.numel() - 8
        length = self.head[:8].view(torch.int64)
        try:
            if data is not None:
                length.fill_(len(data))
                first = min(len(data), room)
                self.head[8:8 + first].copy_(torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8))
            dist.broadcast(self.head, src=0, group=self.host_group)
            n = int(length)
            if n > room:
                rest = (torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8) if data is not None
                        else torch.empty(n - room, dtype=torch.uint8))
                dist.broadcast(rest, src=0, group=self.host_group)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses of its own
            raise ParallelError(f"tensor parallel rank {self.rank}: the step broadcast failed "
                                f"({type(e).__name__}: {e}); a rank has died or timed out") from e
        if data is not None:
            return data
        return self.head[8:8 + min(n, room)].numpy().tobytes() + (rest.numpy().tobytes() if n > room else b"")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, device: torch.device, init_method: str | None = None) -> TPGroup:
    """Join (or create) the default process group and the two groups the engine uses."""
    os.environ.update(NO_MULTICAST)     # read by NCCL when the communicator starts
    timeout = datetime.timedelta(seconds=timeout_s())
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                            timeout=timeout, **kw)
    # The gloo collectives run on a group of the engine's own, never on the default one: other code
    # keeps the default group alive (torch.distributed.nn's functions hold it as a default argument
    # once imported), and only a group whose last handle the engine drops can be torn down
    # (`leave_group`).
    host = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, dist.group.WORLD if backend == "nccl" else host, host)


def leave_group(tp: TPGroup | None) -> None:
    """Leave the process group, broken or not: the process goes on without it.

    `tp`'s handles on the groups are dropped too (the model's layers share it). Dropping the last
    handle on a gloo group joins its worker threads, and that must happen while the interpreter
    still runs: a worker frees a finished collective's tensors after the caller has returned, which
    takes the GIL, and a thread that takes the GIL during interpreter exit aborts the process
    ("terminate called without an active exception")."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may fail to tear down
        pass
    if tp is not None:
        tp.device_group = tp.host_group = None


def from_environment() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def check_size(size: int, device: torch.device) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: must be a positive integer (got {size!r})")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: {size} ranks need {size} GPUs, and torch sees "
                         f"{torch.cuda.device_count()}")


# ---------------------------------------------------------------- spawned workers

class Workers:
    """Ranks 1..N-1 as child processes of rank 0 (spawned, so CUDA starts fresh in each)."""

    def __init__(self, config, size: int, init_method: str):
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(config, r, size, init_method, os.getpid()),
                                  name=f"microengine-tp{r}", daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()

    def dead(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of the workers that have exited."""
        return [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]

    def while_alive(self, fn):
        """fn() (a blocking rendezvous) on a helper thread; raises as soon as a worker has exited
        instead of waiting for the rendezvous' timeout."""
        result: list = []

        def run():
            try:
                result.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                result.append((False, e))
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = self.dead()
            if dead and thread.is_alive():
                rank, code = dead[0]
                raise ParallelError(f"tensor parallel rank {rank} exited (code {code}) before joining the "
                                    "group; its error is in the log above. A program that starts ranks "
                                    "must guard its entry point with if __name__ == '__main__':")
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:        # one that would not stop is killed: nothing is left behind
            if p.is_alive():
                p.kill()
                p.join(5)


def start_workers(config, size: int) -> tuple[Workers, str]:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    return Workers(config, size, init_method), init_method


def _watch_parent(parent_pid: int) -> None:
    """A worker whose rank 0 is gone (killed, crashed) exits rather than waits for the timeout."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _worker_main(config, rank: int, size: int, init_method: str, parent_pid: int) -> None:
    os.environ.update(NO_MULTICAST)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING)
    from engine.engine import Engine
    try:
        engine = Engine(config, tp_rank=rank, tp_init=init_method)
    except Exception as e:  # noqa: BLE001 - rank 0 fails the same way and reports it to the caller
        log.warning("tensor parallel rank %d could not start: %s: %s", rank, type(e).__name__, e)
        os._exit(1)
    try:
        serve_steps(engine)
    except ParallelError as e:
        log.warning("%s", e)
        os._exit(2)
    engine.close()


def serve_steps(engine) -> None:
    """A worker's life after its engine is built: run what rank 0 sends until it says stop."""
    tp = engine.tp
    while True:
        message = tp.recv()
        kind = message[0]
        if kind == "stop":
            return
        if kind == "step":
            engine.replay_step(*message[1:])
        elif kind == "hidden":
            engine.sequence_pass(*message[1:])


@dataclass(frozen=True)
class Shard:
    """The part of a [N, K] weight that one rank holds: `rows`, ranges of the full weight's rows in
    the order this rank stores them (a fused weight takes one range from each of its sections), and
    `cols`, one range of its K."""
    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int]

    @staticmethod
    def whole(n: int, k: int) -> "Shard":
        return Shard(((0, n),), (0, k))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(b - a for a, b in self.rows), self.cols[1] - self.cols[0]

    def row_index(self, device=None) -> torch.Tensor:
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.rows])
