"""Comparing greedy continuations of the same prompt computed two ways: in another batch, through
another kernel, or by another library.

Two computations of the same logits round differently when the work is split differently (a GEMM
over 5 rows or over 6 may take another BLAS kernel; a fused kernel sums in another order than its
reference). Where the two most likely next tokens are closer than that rounding, greedy decoding may
take either, and from there on the contexts, and so the continuations, differ. So the continuations
must be equal, except that they may part at a near-tie: a position where both tokens are among the
top tokens of the log-probabilities given, within `tol` of each other. Nothing after that is compared.
A real fault (a wrong KV block, a wrong position) parts them where no tie is.
"""


def parting(tokens: list[int], reference: list[int], top: list[list[tuple[int, float]]],
            tol: float = 1e-3) -> int | None:
    """Where `tokens` part from `reference` at a near-tie (None where they do not part), or an
    AssertionError naming the position. `top[i]`: (token, log-probability) pairs of the most likely
    tokens at position i, from either computation (both agree up to i)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a == b:
            continue
        lp = dict(top[i])
        assert a in lp and b in lp and abs(lp[a] - lp[b]) < tol, (
            f"the continuations part at token {i} ({a} against {b}), where the top log-probabilities "
            f"are {top[i]}: no near-tie within {tol}\n  got       {tokens}\n  reference {reference}")
        return i
    assert len(tokens) == len(reference), f"lengths {len(tokens)} and {len(reference)}: {tokens} / {reference}"
    return None


def assert_same_greedy(outputs, reference, tol: float = 1e-3) -> None:
    """Engine outputs (greedy, `logprobs` >= 1 in the reference) against reference outputs of the
    same prompts, one by one: equal tokens, or parted at a near-tie (see the module docstring)."""
    assert len(outputs) == len(reference)
    for out, ref in zip(outputs, reference):
        assert ref.logprobs is not None, "the reference needs logprobs to tell a near-tie"
        parting(out.token_ids, ref.token_ids, [lp.top for lp in ref.logprobs], tol)
