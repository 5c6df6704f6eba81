"""The epilogue both FP8 GEMMs (sm90 and sm100) share: per-row x per-column scales (and the residual)
applied to the fp32 accumulators in registers, before the bf16 store."""
import cutlass
import cutlass.cute as cute


@cute.jit
def scale_accumulators(acc: cute.Tensor, coords: cute.Tensor, mXs: cute.Tensor, mWs: cute.Tensor,
                       mR: cute.Tensor, has_residual: cutlass.Constexpr, acc_dtype: cutlass.Constexpr):
    """acc[i] *= xs[row] * ws[col] (+ residual[row, col]) in the accumulator's own register layout;
    coords[i] is acc[i]'s (row, col). Rows past M (a tile's, or the padded rows an A operand may be
    described with) are clamped for the loads to M = the x scales' length, which the residual shares;
    the store drops them."""
    m_total = cute.size(mXs)
    for i in cutlass.range_constexpr(cute.size(acc)):
        row, col = coords[i]
        safe_row = cutlass.min(row, m_total - 1)
        v = acc[i] * (mXs[safe_row] * mWs[col])
        if cutlass.const_expr(has_residual):
            v = v + mR[safe_row, col].to(acc_dtype)
        acc[i] = v
