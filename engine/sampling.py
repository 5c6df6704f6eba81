"""Sampling parameters and the batched sampler: greedy, temperature, top-k, top-p, penalties, seeds.

Everything runs on the logits' device in one pass over the batch. Randomness uses the exponential
race (argmax of p / E, E ~ Exp(1)), which samples exactly from p; a request with a seed draws its E
from its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from engine.kernels.argmax import argmax


# Temperatures below this sample greedily (vLLM's convention too): the sampler divides fp32 logits by
# the temperature, and a tinier one (fp32 has none below 1e-45) overflows them to inf and the softmax to
# NaN, while the distribution it stands for is already the argmax.
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes any integer in [-2**63, 2**64).
SEED_RANGE = (-(2**63), 2**64 - 1)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to sample one request. A parameter of the wrong type raises TypeError, one out of range
    ValueError; both messages start with the parameter's name."""
    max_tokens: int | None = None          # None: up to the context limit
    temperature: float = 1.0               # 0 (or below GREEDY_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = 0                         # 0: off
    seed: int | None = None
    stop: str | list[str] | None = None    # stop strings; the text is cut before them
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None            # None: none; n >= 0: the chosen token's and the top n
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    detokenize: bool = True                # False: token ids only (benchmarks)
    # Constrained decoding (engine/structured_output.py): the output is JSON that follows this JSON
    # schema (a dict, or its JSON text), or with json_object any JSON object.
    json_schema: dict | str | None = None
    json_object: bool = False
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        def wrong_type(name, accepts):
            value = getattr(self, name)
            raise TypeError(f"{name}: must be {accepts} (got {type(value).__name__} {value!r})")

        def bad(name, why):
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                wrong_type("max_tokens", "a positive integer or None")
            if self.max_tokens < 1:
                bad("max_tokens", "must be a positive integer")
        if not _is_number(self.temperature):
            wrong_type("temperature", "a number in [0, 100]")
        if not 0 <= self.temperature <= 100:
            bad("temperature", "must be in [0, 100]")
        if not _is_number(self.top_p):
            wrong_type("top_p", "a number in (0, 1]")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k):
            wrong_type("top_k", "an integer >= 0 (0 disables it)")
        if self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if self.seed is not None:
            if not _is_int(self.seed):
                wrong_type("seed", "an integer or None")
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                bad("seed", "must be in [-2**63, 2**64 - 1]")
        if self.logprobs is not None:
            if not _is_int(self.logprobs):
                wrong_type("logprobs", "an integer in [0, 20] or None")
            if not 0 <= self.logprobs <= 20:
                bad("logprobs", "must be an integer in [0, 20]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                wrong_type(name, "a number in [-2, 2]")
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        for name in ("ignore_eos", "detokenize", "json_object"):
            if not isinstance(getattr(self, name), bool):
                wrong_type(name, "True or False")
        if isinstance(self.stop, str):
            stops = [self.stop]
        elif self.stop is None:
            stops = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            wrong_type("stop", "a string, a list of strings, or None")
        if not all(stops):
            bad("stop", "stop strings must not be empty")
        self.stop_list = stops
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(map(_is_int, self.stop_token_ids)):
                wrong_type("stop_token_ids", "a list of token ids or None")
            if any(t < 0 for t in self.stop_token_ids):
                bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.json_schema is not None:
            if isinstance(self.json_schema, str):
                try:
                    schema = json.loads(self.json_schema)
                except ValueError as e:
                    bad("json_schema", f"is not valid JSON: {e}")
            elif isinstance(self.json_schema, dict):
                schema = self.json_schema
            else:
                wrong_type("json_schema", "a JSON schema as a dict or as JSON text, or None")
            if not isinstance(schema, dict):
                bad("json_schema", "must be a JSON object")
            if self.json_object:
                raise ValueError("json_object: give json_schema or json_object, not both")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output (json_schema or json_object)."""
        return self.json_schema is not None or self.json_object


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Sampler:
    """Samples on the device and returns device tensors: the engine reads them back later, through
    pinned memory, so sampling never makes the host wait. Per-row parameters arrive as device
    tensors uploaded with the step's other inputs (`fields` says which)."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @staticmethod
    def fields(params: list[SamplingParams]) -> dict[str, tuple[list, torch.dtype]]:
        """The per-row parameters `sample` reads from the device, as host lists to upload."""
        if all(p.greedy for p in params):
            return {}
        return {"temperature": ([p.temperature if not p.greedy else 1.0 for p in params], torch.float32),
                "top_k": ([p.top_k for p in params], torch.int64),
                "top_p": ([p.top_p for p in params], torch.float32),
                "greedy": ([p.greedy for p in params], torch.bool)}

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None], histories: list[list[int]],
               dev: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """logits: [B, V] fp32, one row per request; dev: `fields(params)` on the device. Returns
        [tokens [B] int64] and, if any row wants logprobs, [chosen [B], top values [B, k] fp32,
        top ids [B, k] int64] after it. `histories` are the output tokens so far (penalties)."""
        logits = self._apply_penalties(logits, params, histories)
        if "token_bitmask" in dev:      # constrained rows (engine/structured_output.py)
            logits = apply_token_bitmask(logits, dev["token_bitmask"])
        if all(p.greedy for p in params):
            tokens = argmax(logits)
        else:
            tokens = self._sample(logits, params, generators, dev)
        return [tokens, *self._logprobs(logits, tokens, params)]

    def _apply_penalties(self, logits, params, histories):
        # The history goes to the device as a pageable copy; the engine runs steps that hold
        # penalised requests without overlap, so their histories are complete on the host.
        rows = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and histories[i]]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            ids = torch.tensor(histories[i], device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).float()
            logits[i] -= params[i].frequency_penalty * counts + params[i].presence_penalty * (counts > 0).float()
        return logits

    def _sample(self, logits, params, generators, dev):
        probs = (logits / dev["temperature"][:, None]).softmax(-1)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            probs = _top_k_top_p(probs, dev["top_k"], dev["top_p"])
        # Every row draws from the shared generator; seeded rows then redraw from their own, so
        # their tokens do not depend on what else is in the batch.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = argmax(probs / noise)
        return torch.where(dev["greedy"], argmax(logits), sampled)

    @staticmethod
    def _logprobs(logits, tokens, params) -> list[torch.Tensor]:
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if k is None:
            return []
        lp = logits.log_softmax(-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        return [chosen, top_v, top_i]

    @staticmethod
    def logprobs_on_host(params, tokens: list[int], chosen, top_v, top_i) -> list[TokenLogprob | None]:
        """The rows' TokenLogprobs from the host copies of `sample`'s logprob tensors."""
        chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
        return [None if p.logprobs is None else
                TokenLogprob(tokens[r], chosen[r], list(zip(top_i[r][:p.logprobs], top_v[r][:p.logprobs])))
                for r, p in enumerate(params)]


def _top_k_top_p(probs, top_k, top_p):
    """Zero out what top-k (per row, 0 = off) and top-p (nucleus) exclude; rows stay unnormalised,
    which the exponential race does not mind."""
    sorted_p, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[1])[:, None]
    # Keep a token if it is within the top k and the mass before it is below top_p.
    before = sorted_p.cumsum(-1) - sorted_p
    keep = (rank < k) & (before < top_p[:, None])
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The logits with -inf where a packed bitmask excludes the token: bit j of word w allows token
    32 * w + j (xgrammar's layout); bitmask: [B, ceil(V / 32)] int32, all ones for a free row."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:        # LM-head padding past the tokenizer's vocabulary
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))
